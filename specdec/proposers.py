"""Draft proposers behind one protocol and a registry: a draft model, or n-gram prompt lookup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.gpu_sampling import SamplingKernels, probs_for_rows, sample_from_probs
from engine.model_runner import ModelRunner, RunEntry
from engine.sampling import RowContext
from engine.scheduler import ScheduledSeq
from specdec.ngram import propose_ngram


@dataclass
class Proposal:
    token_ids: list[int]  # up to k draft tokens (fewer, or none, when the proposer has nothing)
    probs: (
        torch.Tensor | None
    )  # [len(token_ids), vocab] distribution each was drawn from; None = one-hot


class Proposer(Protocol):
    name: str
    # (rows, sequences) of each forward the last ``propose`` ran, for the controller's draft-cost
    # fit; a lookup proposer reports its whole lookup as one pseudo-forward.
    last_forwards: list[tuple[int, int]]

    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        """Draft up to item.num_spec_tokens tokens after each item's sequence (one per item)."""
        ...


class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the sequence's suffix. No model."""

    name = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.last_forwards: list[tuple[int, int]] = []

    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        out = [
            Proposal(
                propose_ngram(it.seq.token_ids, it.num_spec_tokens, self.n_min, self.n_max), None
            )
            for it in items
        ]
        found = [len(p.token_ids) for p in out if p.token_ids]
        self.last_forwards = [(sum(found), len(found))] if found else []
        return out


class DraftModelProposer:
    """A smaller model sharing the target's block tables; drafts are batched across sequences.

    Step 0 catches the draft up on every token it has not seen (the last step's bonus/corrected
    token, or a whole prompt after prefill) and drafts token 1; each later step feeds one draft
    token per sequence still drafting. Greedy requests take the argmax; sampled requests draw from
    the draft's distribution warped exactly like the target's, and those probabilities are kept as
    q for the rejection sampler.
    """

    name = "draft_model"

    def __init__(self, runner: ModelRunner, kernels: SamplingKernels | None = None) -> None:
        self.runner = runner
        self.kernels = kernels  # batched sampling kernels (FlashInfer on CUDA) or the reference
        self.num_forwards = 0  # observable: tests assert the draft did not run when k = 0
        self.last_forwards: list[tuple[int, int]] = []

    def propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active = [i for i, it in enumerate(items) if it.num_spec_tokens > 0]
        self.last_forwards = []
        step = 0
        while active:
            entries = []
            for i in active:
                seq = items[i].seq
                if step == 0:
                    start = seq.num_draft_computed_tokens
                    entries.append(RunEntry(seq, seq.token_ids[start:], start, 1))
                else:
                    entries.append(RunEntry(seq, [tokens[i][-1]], seq.num_tokens + step - 1, 1))
            logits = self.runner.run(entries)  # [len(active), vocab]
            self.num_forwards += 1
            self.last_forwards.append((sum(len(e.token_ids) for e in entries), len(entries)))
            rows = [
                RowContext(
                    items[i].seq.params,
                    items[i].seq.prompt_token_ids,
                    items[i].seq.output_token_ids + tokens[i],
                )
                for i in active
            ]
            p = probs_for_rows(logits, rows, self.kernels)
            drawn = sample_from_probs(
                p,
                [items[i].seq.params.greedy for i in active],
                [items[i].seq.generator for i in active],
                self.kernels,
            ).tolist()
            for row, i in enumerate(active):
                seq = items[i].seq
                tokens[i].append(drawn[row])
                probs[i].append(p[row])
                seq.num_draft_computed_tokens = seq.num_tokens + step
            step += 1
            active = [i for i in active if items[i].num_spec_tokens > step]
        out = []
        for i, it in enumerate(items):
            if not tokens[i]:
                out.append(Proposal([], None))
            elif it.seq.params.greedy:
                out.append(Proposal(tokens[i], None))  # greedy draft: q is one-hot
            else:
                out.append(Proposal(tokens[i], torch.stack(probs[i])))
        return out


ProposerFactory = Callable[..., Proposer]
PROPOSERS: dict[str, ProposerFactory] = {
    "draft_model": DraftModelProposer,
    "ngram": NgramProposer,
}
