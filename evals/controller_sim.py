"""Synthetic engine steps for driving a speculation controller without models: decode-ready
sequences, the draft forwards a draft-model proposer would run, and one sequence's verify with a
given acceptance.
Shared by the controller's tests and `evals.profile_controller`."""

from __future__ import annotations

import random

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from specdec.controller_base import SeqOutcome


def make_seqs(n: int, start: int = 0, mode: str = "auto", prompt_len: int = 8) -> list[Sequence]:
    """Decode-ready sequences whose draft is caught up (as after a few steps of decoding)."""
    seqs = []
    for i in range(start, start + n):
        seq = Sequence(
            i, f"req-{i}", list(range(prompt_len)), SamplingParams(max_tokens=10**6), mode
        )
        seq.num_computed_tokens = seq.num_draft_computed_tokens = prompt_len - 1
        seqs.append(seq)
    return seqs


def draft_forwards(seqs: list[Sequence], ks: list[int]) -> list[tuple[int, int]]:
    """(rows, seqs) of each draft forward a draft-model proposer runs for these k's."""
    out = []
    for j in range(max(ks, default=0)):
        drafting = [s for s, k in zip(seqs, ks, strict=True) if k > j]
        rows = sum(s.num_tokens - s.num_draft_computed_tokens for s in drafting) if j == 0 else 0
        out.append((rows or len(drafting), len(drafting)))
    return out


def verify_step(seq: Sequence, k: int, acceptance: float, rng: random.Random) -> SeqOutcome:
    """Verify ``k`` drafts of ``seq``, each accepted with probability ``acceptance`` until the
    first rejection; commit the accepted tokens plus one, and roll the target and draft back as
    the engine does."""
    accepted = 0
    while accepted < k and rng.random() < acceptance:
        accepted += 1
    for _ in range(accepted + 1):
        seq.append_token(3)
    seq.num_computed_tokens = seq.num_tokens - 1
    if k > 0:  # the draft has seen everything up to its own k-th token
        seq.num_draft_computed_tokens = min(seq.num_tokens - 1, seq.num_tokens - 2 - accepted + k)
    return SeqOutcome(seq, k, accepted)
