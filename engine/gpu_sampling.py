"""Sampling and speculative verification through batched kernels (FlashInfer on CUDA), with the
torch reference as the fallback.

Three operations, each taking ``kernels``: a `SamplingKernels` implementation (`FlashInferKernels`
on CUDA, `TorchKernels` to run the same batched path in plain torch) or None for the reference
path, which *is* `specdec.engine.sampling.compute_probs` / `specdec.engine.sampling.sample` and
`specdec.rejection_sampler.rejection_sample`:

* `warp_probs`: penalised logits -> probabilities. Same order as the reference: greedy rows become
  one-hot at the argmax (lowest id on ties); other rows get softmax(logits / T), then top-k
  (renormalised), then top-p on that (renormalised), then min-p relative to the top probability.
* `sample_from_probs`: one token per row.
* `verify_drafts`: each row's drafts against its target rows.

Each row follows one of two rules, whatever the kernels:

* **picked** rows (greedy or seeded requests) take the argmax, or for a seeded request the
  exponential race on counter-based noise keyed by (seed, position) (`specdec.engine.sampling.sample`),
  computed in torch for all such rows at once. Their drafts are verified by the coupling
  `specdec.rejection_sampler.coupled_verify` (accept while the draft is the target's pick), so the
  committed tokens equal plain decode's for any k, batch or arm. No kernel call, no per-row call.
* **free** rows (unseeded sampled requests) draw from the device's default generator: all of a
  step's free rows in one ``kernels.sample`` call, and their drafts by the Leviathan/Chen rule
  (accept x with probability min(1, p(x)/q(x)), else draw from norm(max(0, p - q)); a bonus token
  from p when all drafts pass) in FlashInfer's ``chain_speculative_sampling``, which needs one
  draft count per call: one call per distinct draft count (at most k per step), never per row.

Identical semantics means identical distributions, not identical random numbers for free rows:
the reference and the kernels draw from different streams. The only other difference is at exact
probability ties on the top-k / top-p boundary, where the reference keeps every tied token and
FlashInfer's pivot search may keep a different subset; with real-valued logits such ties have
probability zero.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Protocol

import torch
from specdec.engine.sampling import RowContext, apply_penalties, compute_probs, sample
from specdec.engine.sampling_params import SamplingParams

from specdec.rejection_sampler import RejectionResult, coupled_verify, rejection_sample

logger = logging.getLogger(__name__)

_MIN_TEMPERATURE = 1e-5  # as in engine.sampling: below this a row is one-hot in all but name
_TOP_P_EPS = 1e-6  # as in engine.sampling: a prefix within this of top_p has reached it


class SamplingKernels(Protocol):
    """Batched kernels drawing from the device's default generator."""

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` [b, V] -> [b] int64 tokens."""
        ...

    def chain(
        self,
        draft_probs: torch.Tensor,  # [b, n, V]
        draft_token_ids: torch.Tensor,  # [b, n]
        target_probs: torch.Tensor,  # [b, n + 1, V]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (output ids [b, n + 1] int64 with -1 after the final token, num_accepted [b])."""
        ...

    def top_k_renorm(self, probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        """Keep each row's top_k [b] (int32; >= V keeps all) probabilities, renormalise."""
        ...

    def top_p_renorm(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Keep each row's smallest nucleus of mass >= top_p [b] (float32), renormalise."""
        ...


class TorchKernels:
    """`SamplingKernels` in plain torch with the reference's tie rules, so the batched path runs
    (and its calls can be counted) on the CPU too."""

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        return sample(probs)

    def chain(self, draft_probs, draft_token_ids, target_probs):
        b, n = draft_token_ids.shape
        full = torch.full((b,), n, dtype=torch.int64)
        result = rejection_sample(target_probs, draft_token_ids, draft_probs, full)
        return result.output_token_ids, result.num_accepted

    def top_k_renorm(self, probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        k = top_k.to(device=probs.device, dtype=torch.int64).clamp(1, probs.shape[1])
        kth = torch.topk(probs, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        kept = probs.masked_fill(probs < kth, 0.0)
        return kept / kept.sum(-1, keepdim=True)

    def top_p_renorm(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        top_p = top_p.to(device=probs.device, dtype=torch.float32)
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = (mass_before < (top_p - _TOP_P_EPS)[:, None]).sum(-1).clamp_min(1)
        cutoff = sorted_probs.gather(1, (keep - 1)[:, None])
        # A row with top_p >= 1 keeps everything (cumulative rounding must not cut its tail).
        cutoff = torch.where(top_p[:, None] >= 1.0, torch.zeros_like(cutoff), cutoff)
        kept = probs.masked_fill(probs < cutoff, 0.0)
        return kept / kept.sum(-1, keepdim=True)


class FlashInferKernels:
    """`SamplingKernels` on FlashInfer's fused sampling kernels (CUDA tensors only)."""

    def __init__(self) -> None:
        self._fi = importlib.import_module("flashinfer.sampling")

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        return self._fi.sampling_from_probs(probs.float().contiguous(), deterministic=True).long()

    def chain(self, draft_probs, draft_token_ids, target_probs):
        # The kernels index raw row-major memory: slices of a larger batch must be made dense.
        out, _, emitted = self._fi.chain_speculative_sampling(
            draft_probs.float().contiguous(),
            draft_token_ids.to(torch.int32).contiguous(),
            target_probs.float().contiguous(),
            deterministic=True,
        )
        return out.long(), emitted.long()

    def top_k_renorm(self, probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        return self._fi.top_k_renorm_probs(probs.contiguous(), top_k.to(probs.device, torch.int32))

    def top_p_renorm(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return self._fi.top_p_renorm_probs(
            probs.contiguous(), top_p.to(probs.device, torch.float32)
        )


_kernels_cache: dict[str, SamplingKernels | None] = {}


def flashinfer_sampling_kernels(device: torch.device) -> SamplingKernels | None:
    """FlashInfer kernels when `device` is CUDA and they work there, else None (reference path);
    one log line when CUDA is present but FlashInfer is not usable.

    "Work" is checked by one tiny call of each kernel at start-up (the first call JIT-compiles
    the sampling module), so a broken build falls back here rather than failing a request."""
    key = str(device)
    if key not in _kernels_cache:
        kernels: SamplingKernels | None = None
        if device.type == "cuda" and torch.cuda.is_available():
            try:
                kernels = FlashInferKernels()
                _smoke_test(kernels, device)
            except Exception as exc:
                kernels = None
                logger.info(
                    "FlashInfer sampling unavailable (%s: %s); using torch sampling",
                    type(exc).__name__,
                    exc,
                )
        _kernels_cache[key] = kernels
    return _kernels_cache[key]


def _smoke_test(kernels: SamplingKernels, device: torch.device) -> None:
    """Every kernel once on a 2 x 8 batch whose answers are forced (one-hot distributions)."""
    probs = torch.zeros(2, 8, device=device)
    probs[0, 3] = probs[1, 5] = 1.0
    if kernels.sample(probs).tolist() != [3, 5]:
        raise RuntimeError("sampling kernel returned the wrong token for a one-hot row")
    ids, accepted = kernels.chain(
        probs[:, None],
        torch.tensor([[3], [5]], device=device),
        probs[:, None].expand(2, 2, 8),
    )
    if accepted.tolist() != [1, 1] or ids[:, 0].tolist() != [3, 5]:
        raise RuntimeError("chain_speculative_sampling rejected drafts with p == q one-hot")
    kernels.top_k_renorm(probs, torch.full((2,), 2, dtype=torch.int32, device=device))
    kernels.top_p_renorm(probs, torch.full((2,), 0.5, device=device))


# ---- the three operations -------------------------------------------------------------------
def probs_for_rows(
    logits: torch.Tensor,  # [B, V], not modified
    rows: Sequence[RowContext],
    kernels: SamplingKernels | None = None,
) -> torch.Tensor:  # [B, V] float32
    """`specdec.engine.sampling.compute_probs` (penalties, then the warp) with the warp on `kernels`."""
    if kernels is None:
        return compute_probs(logits, rows)
    if len(rows) != logits.shape[0]:
        raise ValueError(f"got {len(rows)} row contexts for {logits.shape[0]} logits rows")
    x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if len(rows):
        apply_penalties(x, rows)
    return warp_probs(x, [r.params for r in rows], kernels)


def warp_probs(
    logits: torch.Tensor,  # [B, V] penalised logits, any float dtype
    params: Sequence[SamplingParams],
    kernels: SamplingKernels | None = None,
) -> torch.Tensor:  # [B, V] float32
    """Temperature, top-k, top-p, min-p and softmax; greedy rows exactly one-hot."""
    if kernels is None:
        return compute_probs(logits, [RowContext(p, (), ()) for p in params])
    num_rows, vocab = logits.shape
    if len(params) != num_rows:
        raise ValueError(f"got {len(params)} params for {num_rows} rows")
    dev = logits.device
    x = logits.float()
    temps = torch.tensor(
        [max(p.temperature, _MIN_TEMPERATURE) for p in params], dtype=torch.float32, device=dev
    )
    probs = torch.softmax(x / temps[:, None], dim=-1)
    if any(0 < p.top_k < vocab for p in params):
        k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        probs = kernels.top_k_renorm(probs, torch.tensor(k, dtype=torch.int32, device=dev))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        probs = kernels.top_p_renorm(probs, top_p)
    if any(p.min_p > 0.0 for p in params):
        # Elementwise, no sort: the ratio to the top probability survives renormalisation.
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=dev)
        top = x.index_select(0, idx).argmax(dim=-1)  # first maximal index: lowest id on ties
        one_hot = torch.zeros(len(greedy), vocab, dtype=torch.float32, device=dev)
        one_hot.scatter_(1, top[:, None], 1.0)
        probs = probs.index_copy(0, idx, one_hot)
    return probs


def sample_from_probs(
    probs: torch.Tensor,  # [B, V]
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int],  # the position in its sequence of the token each row picks
    kernels: SamplingKernels | None = None,
) -> torch.Tensor:  # [B] int64
    """One token per row: greedy rows by argmax (they are one-hot, so the race would pick the
    same token: no noise drawn over their vocabulary), seeded rows by the reference race, free
    rows in one kernel call (by the reference without kernels)."""
    num_rows = probs.shape[0]
    if not len(greedy) == len(seeds) == len(positions) == num_rows:
        raise ValueError(f"need {num_rows} greedy flags, seeds and positions")
    free = [b for b in range(num_rows) if not greedy[b] and seeds[b] is None]
    drawn = [b for b in range(num_rows) if not greedy[b]]
    if kernels is not None and len(free) == num_rows:  # the common all-unseeded batch: no gathers
        return kernels.sample(probs)
    if kernels is None and len(drawn) == num_rows:
        return sample(probs, seeds, positions)
    out = probs.argmax(dim=-1)  # greedy rows; lowest id on ties
    raced = drawn if kernels is None else [b for b in drawn if seeds[b] is not None]
    if raced:
        idx = torch.tensor(raced, device=probs.device)
        out[idx] = sample(
            probs.index_select(0, idx), [seeds[b] for b in raced], [positions[b] for b in raced]
        )
    if free and kernels is not None:
        idx = torch.tensor(free, device=probs.device)
        out[idx] = kernels.sample(probs.index_select(0, idx))
    return out


def verify_drafts(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    draft_token_ids: torch.Tensor,  # [B, K], entries past num_draft_tokens[b] ignored
    draft_probs: torch.Tensor | None,  # [B, K, V], or None when every draft is one-hot
    num_draft_tokens: Sequence[int],  # host list, each in 0..K
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int],  # position in its sequence of the token row 0 of each row picks
    kernels: SamplingKernels | None = None,
) -> RejectionResult:
    """Verify each row's drafts (module docstring): picked rows and rows without drafts through
    `sample_from_probs` and `coupled_verify`, the other free rows by the rejection rule."""
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    n_host = [int(n) for n in num_draft_tokens]
    if not len(n_host) == len(greedy) == len(seeds) == len(positions) == batch:
        raise ValueError(f"need {batch} draft counts, greedy flags, seeds and positions")
    if any(not 0 <= n <= k for n in n_host):
        raise ValueError(f"num_draft_tokens must lie in [0, {k}], got {n_host}")
    dev = target_probs.device
    drafts = draft_token_ids.to(device=dev, dtype=torch.int64)
    free = [b for b in range(batch) if not greedy[b] and seeds[b] is None and n_host[b] > 0]
    picked = [b for b in range(batch) if greedy[b] or seeds[b] is not None or n_host[b] == 0]
    out = torch.full((batch, k + 1), -1, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=dev)

    def select(rows: list[int]) -> torch.Tensor | slice:
        # The whole batch in one rule (the common case) is sliced: no copies of its grids.
        return slice(None) if len(rows) == batch else torch.tensor(rows, device=dev)

    def put(idx: torch.Tensor | slice, res: RejectionResult, width: int) -> None:
        out[idx, :width] = res.output_token_ids.to(torch.int64)
        num_accepted[idx] = res.num_accepted.to(torch.int64)

    if picked:
        idx = select(picked)
        res = _verify_picked(
            target_probs[idx],
            drafts[idx],
            [n_host[b] for b in picked],
            [greedy[b] for b in picked],
            [seeds[b] for b in picked],
            [positions[b] for b in picked],
            kernels,
        )
        put(idx, res, k + 1)
    if free and kernels is None:
        idx = select(free)
        counts = torch.tensor([n_host[b] for b in free], dtype=torch.int64)
        q = None if draft_probs is None else draft_probs[idx]
        put(idx, rejection_sample(target_probs[idx], drafts[idx], q, counts), k + 1)
        return RejectionResult(output_token_ids=out, num_accepted=num_accepted)
    # The kernel takes one draft count per call: one call per distinct count.
    by_count: dict[int, list[int]] = {}
    for b in free:
        by_count.setdefault(n_host[b], []).append(b)
    for n, rows in by_count.items():
        idx = select(rows)
        ids = drafts[idx, :n]  # [g, n]
        if draft_probs is None:  # one-hot q at each draft (n-gram proposals)
            q = torch.zeros(len(rows), n, vocab, dtype=torch.float32, device=dev)
            q.scatter_(2, ids[:, :, None], 1.0)
        else:
            q = draft_probs[idx, :n].to(device=dev, dtype=torch.float32)
        got_ids, got_acc = kernels.chain(q, ids, target_probs[idx, : n + 1])
        put(idx, RejectionResult(got_ids, got_acc), n + 1)
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


def _verify_picked(
    target_probs: torch.Tensor,  # [g, K + 1, V]
    drafts: torch.Tensor,  # [g, K]
    num_drafts: list[int],
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    kernels: SamplingKernels | None,
) -> RejectionResult:
    """The target's pick at every row (one `sample_from_probs` over the flattened grid; padding
    rows count as greedy, so they cost an argmax and are never read), then `coupled_verify`."""
    g, k_plus_1, vocab = target_probs.shape
    real = [j <= num_drafts[b] for b in range(g) for j in range(k_plus_1)]
    picks = sample_from_probs(
        target_probs.reshape(g * k_plus_1, vocab),
        [greedy[r // k_plus_1] or not real[r] for r in range(g * k_plus_1)],
        [seeds[r // k_plus_1] if real[r] else None for r in range(g * k_plus_1)],
        [positions[r // k_plus_1] + r % k_plus_1 for r in range(g * k_plus_1)],
        kernels,
    )
    counts = torch.tensor(num_drafts, dtype=torch.int64, device=target_probs.device)
    return coupled_verify(picks.view(g, k_plus_1), drafts[:, : k_plus_1 - 1], counts)
