"""Speculative verification: keep the longest accepted draft prefix plus one target token.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

For draft position j with target distribution ``p_j`` and draft distribution ``q_j`` (the one the
draft token ``x_j`` was actually sampled from), accept ``x_j`` with probability
``min(1, p_j(x_j) / q_j(x_j))``. At the first rejection emit a replacement drawn from the residual
``r_j = max(0, p_j - q_j) / sum(max(0, p_j - q_j))`` and stop. If all ``n`` drafts are accepted,
emit a bonus token drawn from ``p_n``.

Why this is exact: with ``beta = sum_y min(p(y), q(y))`` the chance to accept, the token emitted at
a position has probability

    P(y) = q(y) * min(1, p(y)/q(y)) + (1 - beta) * r(y)
         = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y),

since ``sum_y max(0, p - q) = 1 - beta``. Given the emitted prefix, the next position is verified
against the target row that saw exactly that prefix, so by induction the whole output follows the
target distribution. A one-hot ``q`` (n-gram proposals, greedy drafts) accepts with probability
``p(x)`` and resamples from ``p`` with ``x`` removed; a one-hot ``p`` (greedy target) accepts iff
``x`` is the argmax and otherwise emits the argmax, so greedy speculation reproduces greedy decode.

Acceptance is tested as ``u * q(x) < p(x)`` with ``u ~ U[0, 1)``, which equals ``u < min(1, p/q)``
for ``q(x) > 0``, needs no division, never accepts a token with ``p(x) == 0`` and always accepts
when ``p(x) >= q(x) > 0``.

Seeded and greedy sequences are verified by a coupling instead (`coupled_verify`): the token
committed at each position is the one the target's distribution picks on its own, so it does not
depend on the drafts at all. A seeded sequence picks every token by an exponential race on noise
keyed by (seed, position) (`specdec.engine.sampling.sample`); the draft proposes the winner of the same
race on its own distribution (``argmax q/E``, the same ``E``), and a draft is accepted iff it is
the target's winner (``argmax p/E``). At the first mismatch, or as the bonus, the target's winner
is emitted. Each committed token is then an exact sample of ``p`` (the race at a position uses
noise independent of every earlier position, on which ``p`` depends) and equals what plain decode
commits at that position, for any k, batch or arm. A greedy sequence is the same rule with the
argmax for the winner. The price is acceptance: the draft's and the target's winners agree with
probability ``sum_i 1 / sum_j max(p_j / p_i, q_j / q_i)``, which never exceeds the rejection
rule's ``sum_i min(p_i, q_i)`` (``evals/coupling_cost.py`` measures both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.sampling import sample


@dataclass
class RejectionResult:
    """Verification outcome for a batch of ``B`` sequences with up to ``K`` drafts each."""

    output_token_ids: torch.Tensor  # [B, K + 1] int64: accepted drafts, then one token, then -1
    num_accepted: torch.Tensor  # [B] int64 in 0..n_b; the sequence emits num_accepted + 1 tokens


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    draft_token_ids: torch.Tensor,  # [B, K], -1 past num_draft_tokens
    draft_probs: torch.Tensor | None,  # [B, K, V], or None for one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int in 0..K
) -> RejectionResult:
    """Verify drafts against target distributions, one speculative step for ``B`` sequences.

    Args:
        target_probs: row ``j`` of sequence ``b`` is the (warped) target distribution after the
            draft tokens before ``j``; rows past ``num_draft_tokens[b]`` are padding and unread.
        draft_token_ids: proposed tokens; entries past ``num_draft_tokens[b]`` are ignored.
        draft_probs: the distributions the drafts were sampled from, or None when each draft was
            chosen deterministically (q one-hot at the draft token).
        num_draft_tokens: number of real drafts per sequence; 0 samples row 0 like plain decode.
            Randomness comes from the device's default generator.

    Returns:
        `RejectionResult` with accepted drafts, the replacement or bonus token, -1 padding.
    """
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    if draft_token_ids.shape != (batch, k):
        raise ValueError(
            f"draft_token_ids must be [{batch}, {k}], got {tuple(draft_token_ids.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [{batch}, {k}, {vocab}], got {tuple(draft_probs.shape)}"
        )
    n_host = [int(n) for n in num_draft_tokens.tolist()]
    if any(not 0 <= n <= k for n in n_host):
        raise ValueError(f"num_draft_tokens must lie in [0, {k}], got {n_host}")

    target_probs = target_probs.to(torch.float32)
    n = torch.tensor(n_host, dtype=torch.long, device=device)  # [B]
    rows = torch.arange(batch, device=device)
    valid = torch.arange(k, device=device)[None, :] < n[:, None]  # [B, K]
    drafts = torch.where(valid, draft_token_ids.to(device=device, dtype=torch.long), 0)  # [B, K]

    p_at_draft = target_probs[:, :k, :].gather(2, drafts[:, :, None]).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_at_draft = torch.ones_like(p_at_draft)
    else:
        draft_probs = draft_probs.to(device=device, dtype=torch.float32)
        q_at_draft = draft_probs.gather(2, drafts[:, :, None]).squeeze(2)  # [B, K]
    uniforms = torch.rand(batch, k, device=device)  # [B, K]
    accepted = (uniforms * q_at_draft < p_at_draft) & valid  # [B, K]
    # Accepted prefix length: count leading accepts (cumprod zeroes everything after a reject).
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    final_dist = target_probs[rows, num_accepted]  # [B, V]: p at the first unaccepted position
    if k > 0:
        rejected = num_accepted < n  # [B]: stopped by a rejection, not by running out of drafts
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_rows = torch.zeros_like(final_dist)
            q_rows.scatter_(1, drafts[rows, at][:, None], 1.0)
        else:
            q_rows = draft_probs[rows, at]  # [B, V]
        residual = (final_dist - q_rows).clamp_min(0.0)
        mass = residual.sum(dim=1, keepdim=True)  # [B, 1]
        # An all-zero residual means p == q up to rounding; p itself is then the right answer.
        use_residual = rejected[:, None] & (mass > 0)
        final_dist = torch.where(use_residual, residual / mass.clamp_min(1e-30), final_dist)
    final_token = sample(final_dist)  # [B]

    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    keep = torch.arange(k, device=device)[None, :] < num_accepted[:, None]  # [B, K]
    out[:, :k] = torch.where(keep, drafts, -1)
    out.scatter_(1, num_accepted[:, None], final_token[:, None])
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


def coupled_verify(
    target_tokens: torch.Tensor,  # [B, K + 1] the target's pick at each row; unread past n_b
    draft_token_ids: torch.Tensor,  # [B, K], entries past num_draft_tokens ignored
    num_draft_tokens: torch.Tensor,  # [B] int in 0..K
) -> RejectionResult:
    """Verify by the coupling (module docstring): accept drafts while each equals the target's
    pick at its row, then emit the target's pick at the first mismatch (or the bonus row).

    ``target_tokens[b, j]`` is the token the target commits at row ``j`` on its own: the argmax
    for a greedy sequence, the exponential race on the (seed, position) noise for a seeded one.
    No randomness is drawn here.
    """
    batch, k_plus_1 = target_tokens.shape
    k = k_plus_1 - 1
    device = target_tokens.device
    if draft_token_ids.shape != (batch, k):
        raise ValueError(
            f"draft_token_ids must be [{batch}, {k}], got {tuple(draft_token_ids.shape)}"
        )
    n = num_draft_tokens.to(device=device, dtype=torch.long)  # [B]
    if bool(((n < 0) | (n > k)).any()):
        raise ValueError(f"num_draft_tokens must lie in [0, {k}], got {n.tolist()}")
    drafts = draft_token_ids.to(device=device, dtype=torch.long)
    pos = torch.arange(k, device=device)[None, :]
    match = (drafts == target_tokens[:, :k]) & (pos < n[:, None])  # [B, K]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    out[:, :k] = torch.where(pos < num_accepted[:, None], drafts, -1)
    out.scatter_(1, num_accepted[:, None], target_tokens.gather(1, num_accepted[:, None]))
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)
