"""Greedy speculation replayed from per-position agreement, and the draft's pruned pick.

At temperature 0 a draft token is accepted iff it equals the target's argmax, and a draft is only
judged when every draft before it in its step was accepted, i.e. when the draft has read exactly
the target's own output so far. So one forward of the draft over a target output (teacher forcing)
gives, at every position, whether the draft would agree there, and the whole greedy speculative
decode with any fixed k follows from those flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class GreedyReplay:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # target forwards after the prefill
    committed: int = 0  # tokens those forwards committed

    def add(self, other: GreedyReplay) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.steps += other.steps
        self.committed += other.committed

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


def replay_greedy(agree: Sequence[bool], k: int) -> GreedyReplay:
    """Fixed-k greedy speculation over an output of ``len(agree)`` tokens.

    ``agree[t]``: the draft, having read the prompt and output tokens ``0..t-1``, picks output
    token ``t``. The prefill commits token 0; each later step drafts ``min(k, tokens left - 1)``
    tokens, accepts the leading agreements and commits them plus the target's own token.
    """
    n = len(agree)
    out = GreedyReplay()
    t = 1
    while t < n:
        d = min(k, n - t - 1)
        a = 0
        while a < d and agree[t + a]:
            a += 1
        out.drafted += d
        out.accepted += a
        out.steps += 1
        out.committed += a + 1
        t += a + 1
    return out


def pruned_argmax(
    logits: torch.Tensor,  # [rows, vocab] full-vocabulary draft logits
    kept: torch.Tensor,  # [n] int64 ascending token ids
) -> torch.Tensor:  # [rows] int64 token ids
    """The greedy pick of a draft whose head keeps only ``kept``: the argmax over those columns
    (ties to the lowest id, as over the embedded logits)."""
    return kept[logits.index_select(1, kept.to(logits.device)).argmax(dim=-1).cpu()]


def rejection_acceptance(
    p: torch.Tensor,  # [rows, vocab] target probabilities
    logits: torch.Tensor,  # [rows, vocab] draft logits at the same temperature
    kept: torch.Tensor | None,  # [n] kept ids, None for the full vocabulary
) -> torch.Tensor:  # [rows] float64: sum_y min(p(y), q(y))
    """Probability that the rejection rule accepts a draft drawn from the (pruned) draft."""
    if kept is None:
        q = torch.softmax(logits.double(), dim=-1)
        return torch.minimum(p.double(), q).sum(dim=-1)
    sub = torch.softmax(logits.index_select(1, kept).double(), dim=-1)  # [rows, n]
    return torch.minimum(p.index_select(1, kept).double(), sub).sum(dim=-1)
