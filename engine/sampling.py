"""Turning logits into next-token distributions and drawing tokens from them.

The same `compute_probs` serves plain decode rows, the target's verify rows and the draft model's
rows, so draft and target distributions are warped by exactly the same rules; this is what makes
speculative sampling lossless with respect to the *warped* target distribution.

Order of operations on each row (logits -> probabilities):

1. repetition penalty (HF/vLLM): every token seen in prompt or output has its logit divided by
   ``r`` when positive and multiplied by ``r`` otherwise;
2. presence and frequency penalties (OpenAI): ``logit -= frequency * count + presence * [count>0]``
   with counts over output tokens only;
3. greedy rows become a one-hot at the argmax (ties go to the lowest token id); when every row
   is greedy, `greedy_picks` returns those argmaxes without building the one-hot rows;
4. other rows: temperature, top-k, top-p, min-p, then softmax (which renormalises).

Tie rules (documented because tests pin them): top-k keeps every token whose logit equals the k-th
largest logit, so ties at the boundary may keep more than k tokens; top-p likewise keeps every token
whose probability equals that of the last token of the smallest prefix (in descending order) whose
mass reaches ``top_p``. Both rules are independent of sort stability and of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from specdec.engine import noise
from specdec.engine.sampling_params import SamplingParams

# Cumulative float32 sums of a large vocabulary are off by a few ulps; a prefix whose mass is
# within this of top_p counts as having reached it, so exact boundaries behave as written.
_TOP_P_EPS = 1e-6
# Dividing logits by a vanishing temperature overflows to inf and softmax then yields NaN; below
# this value the distribution is a one-hot in all but name, so the divisor is clamped here.
_MIN_TEMPERATURE = 1e-5


@dataclass
class RowContext:
    """One row of logits to be turned into a distribution.

    ``output_ids`` holds the committed output tokens plus, for a verify row, the draft tokens that
    precede the row, so the penalties at every verify row equal what plain decode would use at that
    position.
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def compute_probs(logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
    """Warp logits into probabilities, one `RowContext` per row.

    Args:
        logits: ``[num_rows, vocab]`` float tensor (any float dtype, any device); not modified.
        rows: one context per logits row.

    Returns:
        ``[num_rows, vocab]`` float32 probabilities; greedy rows are exactly one-hot.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if len(rows) != num_rows:
        raise ValueError(f"got {len(rows)} row contexts for {num_rows} logits rows")
    # A contiguous copy: penalties use a flat view of it, and the caller's logits stay intact.
    x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [N, vocab]
    if num_rows == 0:
        return x
    apply_penalties(x, rows)

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not greedy:
        # Common all-sampled batch: no gather/scatter copies of the whole logits tensor.
        return _warp(x, [r.params for r in rows])
    probs = torch.empty_like(x)  # [num_rows, vocab]
    g_idx = torch.tensor(greedy, device=x.device)
    # torch.argmax returns the first maximal index, i.e. the lowest token id on ties.
    top = x.index_select(0, g_idx).argmax(dim=-1)  # [num_greedy]
    one_hot = torch.zeros(len(greedy), vocab, dtype=torch.float32, device=x.device)
    one_hot.scatter_(1, top[:, None], 1.0)
    probs.index_copy_(0, g_idx, one_hot)
    if sampled:
        s_idx = torch.tensor(sampled, device=x.device)
        sub = x.index_select(0, s_idx)  # [num_sampled, vocab]
        probs.index_copy_(0, s_idx, _warp(sub, [rows[i].params for i in sampled]))
    return probs


def greedy_picks(logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor | None:
    """The tokens `compute_probs` would make one-hot when every row is greedy (the argmax of the
    penalised logits, lowest id on ties), without building a vocabulary-wide distribution per
    row; None when any row samples. A greedy verify needs no more than its picks."""
    if not all(r.params.greedy for r in rows):
        return None
    if any(r.params.needs_penalties for r in rows):
        x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        apply_penalties(x, rows)
        return x.argmax(dim=-1)
    return logits.argmax(dim=-1)


def apply_penalties(x: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """Apply repetition, then presence/frequency penalties to ``x`` ([num_rows, vocab]) in place.

    Each (row, token) pair is addressed by its flat index ``row * vocab + token`` so that all rows
    are handled by one `unique` and one gather/scatter, touching only tokens that were seen.
    """
    vocab = x.shape[1]
    rep_keys: list[np.ndarray] = []
    rep_rows: list[int] = []
    freq_keys: list[np.ndarray] = []
    freq_rows: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        output = _as_ids(row.output_ids, vocab)
        if p.repetition_penalty != 1.0:
            seen = np.concatenate([_as_ids(row.prompt_ids, vocab), output])
            if seen.size:
                rep_keys.append(seen + i * vocab)
                rep_rows.append(i)
        if (p.presence_penalty != 0 or p.frequency_penalty != 0) and output.size:
            freq_keys.append(output + i * vocab)
            freq_rows.append(i)

    flat = x.view(-1)
    device = x.device
    if rep_keys:
        keys = torch.unique(torch.from_numpy(np.concatenate(rep_keys)).to(device))  # [num_seen]
        penalty = torch.ones(x.shape[0], dtype=torch.float32, device=device)
        penalty[torch.tensor(rep_rows, device=device)] = torch.tensor(
            [rows[i].params.repetition_penalty for i in rep_rows],
            dtype=torch.float32,
            device=device,
        )
        r = penalty[keys // vocab]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / r, vals * r)
    if freq_keys:
        all_keys = torch.from_numpy(np.concatenate(freq_keys)).to(device)
        keys, counts = torch.unique(all_keys, return_counts=True)  # [num_distinct]
        freq = torch.zeros(x.shape[0], dtype=torch.float32, device=device)
        pres = torch.zeros(x.shape[0], dtype=torch.float32, device=device)
        f_idx = torch.tensor(freq_rows, device=device)
        freq[f_idx] = torch.tensor(
            [rows[i].params.frequency_penalty for i in freq_rows],
            dtype=torch.float32,
            device=device,
        )
        pres[f_idx] = torch.tensor(
            [rows[i].params.presence_penalty for i in freq_rows], dtype=torch.float32, device=device
        )
        row_of = keys // vocab
        flat[keys] -= freq[row_of] * counts.to(torch.float32) + pres[row_of]


def _as_ids(ids: Sequence[int], vocab: int) -> np.ndarray:
    """Token ids as int64 numpy, checked to lie in the vocabulary (a stray id would otherwise
    silently penalise a token of the next row through the flat index)."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"token id out of range [0, {vocab}) in penalty context")
    return arr


def _warp(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and softmax for non-greedy rows.

    Args:
        x: ``[num_rows, vocab]`` float32 penalised logits; modified in place.
        params: one per row, none greedy.

    Returns:
        ``[num_rows, vocab]`` float32 probabilities.
    """
    num_rows, vocab = x.shape
    device = x.device
    temps = torch.tensor(
        [max(p.temperature, _MIN_TEMPERATURE) for p in params], dtype=torch.float32, device=device
    )
    x.div_(temps[:, None])
    neg_inf = float("-inf")

    # Each filter runs only on the rows that ask for it, via index_select / index_copy.
    k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if k_rows:
        idx = torch.tensor(k_rows, device=device)
        sub = x.index_select(0, idx)  # [num_k_rows, vocab]
        ks = torch.tensor([params[i].top_k for i in k_rows], device=device)
        top_vals = torch.topk(sub, int(max(params[i].top_k for i in k_rows)), dim=-1).values
        kth = top_vals.gather(1, (ks - 1)[:, None])  # [num_k_rows, 1]
        x.index_copy_(0, idx, sub.masked_fill(sub < kth, neg_inf))

    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        idx = torch.tensor(p_rows, device=device)
        sub = x.index_select(0, idx)  # [num_p_rows, vocab]
        top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=torch.float32, device=device)
        probs = torch.softmax(sub, dim=-1)
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values
        # Mass strictly before each position; a position is kept while the mass before it has not
        # yet reached top_p, which keeps the smallest prefix with mass >= top_p (and at least one).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_count = (mass_before < (top_p - _TOP_P_EPS)[:, None]).sum(dim=-1).clamp_min(1)
        cutoff = sorted_probs.gather(1, (keep_count - 1)[:, None])  # [num_p_rows, 1]
        x.index_copy_(0, idx, sub.masked_fill(probs < cutoff, neg_inf))

    m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        idx = torch.tensor(m_rows, device=device)
        sub = x.index_select(0, idx)  # [num_m_rows, vocab]
        min_p = torch.tensor([params[i].min_p for i in m_rows], dtype=torch.float32, device=device)
        probs = torch.softmax(sub, dim=-1)
        # The ratio to the top probability does not change under renormalisation, so min-p can be
        # judged on the already-truncated distribution; the top token always survives.
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        x.index_copy_(0, idx, sub.masked_fill(probs < threshold, neg_inf))

    return torch.softmax(x, dim=-1)


def sample(
    probs: torch.Tensor,
    seeds: Sequence[int | None] | None = None,
    positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """Draw one token per row of ``probs`` ([num_rows, vocab]); returns ``[num_rows]`` int64.

    Sampling is an exponential race (the exponential form of the Gumbel-max trick): with
    ``E_i ~ Exp(1)`` i.i.d., ``argmax_i p_i / E_i`` is distributed as ``Categorical(p)`` (``p_i /
    E_i`` is the reciprocal of an exponential with rate ``p_i``, and the minimum of independent
    exponentials falls on ``i`` with probability ``p_i / sum p``). Unnormalised rows therefore work
    too, no multinomial host round-trip is needed, and a one-hot row returns its token whatever the
    noise.

    Row ``b`` with ``seeds[b]`` set races on the counter-based stream keyed by (seed,
    ``positions[b]``, `specdec.engine.noise.TOKEN`): its token is a function of its seed, its position and
    its distribution alone, whatever else is in the batch or was drawn before. This is the one
    rule every token of a seeded request is picked by: plain decode, the draft's proposals and the
    target's verification (`specdec.rejection_sampler.coupled_verify`). Rows without a seed race
    on streams keyed by draws from the device's default generator.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [num_rows, vocab], got shape {tuple(probs.shape)}")
    num_rows, vocab = probs.shape
    seeds = [None] * num_rows if seeds is None else list(seeds)
    if len(seeds) != num_rows:
        raise ValueError(f"got {len(seeds)} seeds for {num_rows} rows")
    seeded = [b for b, s in enumerate(seeds) if s is not None]
    if seeded and (positions is None or len(positions) != num_rows):
        raise ValueError(f"seeded rows need one position per row ({num_rows} rows)")
    if len(seeded) == num_rows:  # a fully seeded batch leaves the default generator as it was
        keys = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    else:
        keys = noise.random_keys(num_rows, probs.device)
    if seeded:
        stream = [seeds[b] for b in seeded], [positions[b] for b in seeded]
        keys[torch.tensor(seeded, device=probs.device)] = noise.stream_keys(
            *stream, noise.TOKEN, probs.device
        )
    return noise.race(keys, probs)
