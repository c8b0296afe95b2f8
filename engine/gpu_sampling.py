"""Sampling and speculative verification through batched kernels (FlashInfer on CUDA), with the
torch reference as the fallback.

Three operations, each taking ``kernels``: a `SamplingKernels` implementation (`FlashInferKernels`
on CUDA, `TorchKernels` to run the same batched path in plain torch) or None for the reference
path, which *is* `engine.sampling.compute_probs` / `engine.sampling.sample` and
`specdec.rejection_sampler.rejection_sample`:

* `warp_probs`: penalised logits -> probabilities. Same order as the reference: greedy rows become
  one-hot at the argmax (lowest id on ties); other rows get softmax(logits / T), then top-k
  (renormalised), then top-p on that (renormalised), then min-p relative to the top probability.
* `sample_from_probs`: one token per row; greedy rows take the argmax and draw nothing.
* `verify_drafts`: the Leviathan/Chen rule (accept x with probability min(1, p(x)/q(x)), else
  draw from norm(max(0, p - q)); a bonus token from p when all drafts pass). Greedy rows are
  checked exactly in torch (accept while the draft is the target's argmax, then emit the argmax),
  so greedy speculative output equals greedy plain output whatever kernels are used. Sampled rows
  go to FlashInfer's ``chain_speculative_sampling``, which needs one draft count per call: rows are
  grouped by their number of drafts.

Identical semantics means identical distributions and identical guarantees about seeds, not
identical random numbers: the reference and the kernels draw from different streams. The only
other difference is at exact probability ties on the top-k / top-p boundary, where the reference
keeps every tied token and FlashInfer's pivot search may keep a different subset; with real-valued
logits such ties have probability zero.

Seeds. FlashInfer's sampling kernels take one (seed, offset) pair per call (a seed *tensor* is
read at element 0 only; it exists so a call can be captured in a CUDA graph) and give row b the
Philox subsequence b, so a row's draws depend on its position in the batch. The design here:

* rows without a seed share one batched call whose (seed, offset) come from the device's default
  generator, advanced by the call; their draws may depend on the batch, as unseeded draws may;
* each seeded row gets a call of its own (a batch of one, so always subsequence 0) whose
  (seed, offset) come from, and advance, that request's generator. Its tokens then depend only on
  its seed and its own history, never on its row or its neighbours.

A seeded row costs one extra small launch per step. Seeded requests are a small share of serving
traffic and the unseeded bulk stays one launch; deriving per-row uniforms ourselves and sampling
in torch would batch seeded rows too, but gives up the kernels' sort-free top-k/top-p.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.sampling import RowContext, apply_penalties, compute_probs, sample
from engine.sampling_params import SamplingParams
from specdec.rejection_sampler import RejectionResult, rejection_sample

logger = logging.getLogger(__name__)

_MIN_TEMPERATURE = 1e-5  # as in engine.sampling: below this a row is one-hot in all but name
_TOP_P_EPS = 1e-6  # as in engine.sampling: a prefix within this of top_p has reached it

Generator = torch.Generator | None


class SamplingKernels(Protocol):
    """Batched kernels: one (seed, offset) per call, rows drawing from one shared stream."""

    def sample(self, probs: torch.Tensor, generator: Generator) -> torch.Tensor:
        """``probs`` [b, V] -> [b] int64 tokens."""
        ...

    def chain(
        self,
        draft_probs: torch.Tensor,  # [b, n, V]
        draft_token_ids: torch.Tensor,  # [b, n]
        target_probs: torch.Tensor,  # [b, n + 1, V]
        generator: Generator,
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
    """`SamplingKernels` in plain torch with the reference's tie rules.

    Rows of one call draw in order from the one generator given, so, like FlashInfer, a row's
    draws depend on its position: the batched path's seeding design is exercised on the CPU too.
    """

    def sample(self, probs: torch.Tensor, generator: Generator) -> torch.Tensor:
        return sample(probs, [generator] * probs.shape[0])

    def chain(self, draft_probs, draft_token_ids, target_probs, generator):
        b, n = draft_token_ids.shape
        full = torch.full((b,), n, dtype=torch.int64)
        result = rejection_sample(target_probs, draft_token_ids, draft_probs, full, [generator] * b)
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

    def sample(self, probs: torch.Tensor, generator: Generator) -> torch.Tensor:
        out = self._fi.sampling_from_probs(
            probs.float().contiguous(), deterministic=True, **_seed_kwargs(generator)
        )
        return out.long()

    def chain(self, draft_probs, draft_token_ids, target_probs, generator):
        # The kernels index raw row-major memory: slices of a larger batch must be made dense.
        out, _, emitted = self._fi.chain_speculative_sampling(
            draft_probs.float().contiguous(),
            draft_token_ids.to(torch.int32).contiguous(),
            target_probs.float().contiguous(),
            deterministic=True,
            **_seed_kwargs(generator),
        )
        return out.long(), emitted.long()

    def top_k_renorm(self, probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        return self._fi.top_k_renorm_probs(probs.contiguous(), top_k.to(probs.device, torch.int32))

    def top_p_renorm(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return self._fi.top_p_renorm_probs(
            probs.contiguous(), top_p.to(probs.device, torch.float32)
        )


def _seed_kwargs(generator: Generator) -> dict[str, Any]:
    """How a call gets its (seed, offset): FlashInfer reads a CUDA generator's Philox state and
    advances it; a CPU generator (never the engine's on CUDA) supplies a fresh 62-bit seed."""
    if generator is None:
        return {}
    if generator.device.type == "cuda":
        return {"generator": generator}
    seed = int(torch.randint(0, 1 << 62, (1,), generator=generator))
    return {"seed": seed, "offset": 0}


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
    if kernels.sample(probs, None).tolist() != [3, 5]:
        raise RuntimeError("sampling kernel returned the wrong token for a one-hot row")
    ids, accepted = kernels.chain(
        probs[:, None],
        torch.tensor([[3], [5]], device=device),
        probs[:, None].expand(2, 2, 8),
        None,
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
    """`engine.sampling.compute_probs` (penalties, then the warp) with the warp on `kernels`."""
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
    generators: Sequence[Generator],
    kernels: SamplingKernels | None = None,
) -> torch.Tensor:  # [B] int64
    """One token per row; seeded rows draw only from their own generator (module docstring)."""
    num_rows = probs.shape[0]
    if len(greedy) != num_rows or len(generators) != num_rows:
        raise ValueError(f"need {num_rows} greedy flags and generators")
    if kernels is None:
        return sample(probs, generators)
    sampled = [b for b in range(num_rows) if not greedy[b]]
    shared = [b for b in sampled if generators[b] is None]
    if len(shared) == num_rows:  # the common all-unseeded batch: one call, no gathers
        return kernels.sample(probs, None)
    out = probs.argmax(dim=-1)  # greedy rows; lowest id on ties
    if shared:
        idx = torch.tensor(shared, device=probs.device)
        out[idx] = kernels.sample(probs.index_select(0, idx), None)
    for b in sampled:
        if generators[b] is not None:
            out[b : b + 1] = kernels.sample(probs[b : b + 1], generators[b])
    return out


def verify_drafts(
    target_probs: torch.Tensor,  # [B, K + 1, V]
    draft_token_ids: torch.Tensor,  # [B, K], entries past num_draft_tokens[b] ignored
    draft_probs: torch.Tensor | None,  # [B, K, V], or None when every draft is one-hot
    num_draft_tokens: Sequence[int],  # host list, each in 0..K
    greedy: Sequence[bool],
    generators: Sequence[Generator],
    kernels: SamplingKernels | None = None,
) -> RejectionResult:
    """Verify each row's drafts; same contract as `specdec.rejection_sampler.rejection_sample`."""
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    n_host = [int(n) for n in num_draft_tokens]
    if len(n_host) != batch or len(greedy) != batch or len(generators) != batch:
        raise ValueError(f"need {batch} draft counts, greedy flags and generators")
    if any(not 0 <= n <= k for n in n_host):
        raise ValueError(f"num_draft_tokens must lie in [0, {k}], got {n_host}")
    if kernels is None:
        counts = torch.tensor(n_host, dtype=torch.int64)
        return rejection_sample(target_probs, draft_token_ids, draft_probs, counts, generators)

    dev = target_probs.device
    drafts = draft_token_ids.to(device=dev, dtype=torch.int64)
    out = torch.full((batch, k + 1), -1, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=dev)

    plain = [b for b in range(batch) if n_host[b] == 0]
    if plain:
        idx = torch.tensor(plain, device=dev)
        out[idx, 0] = sample_from_probs(
            target_probs[idx, 0],
            [greedy[b] for b in plain],
            [generators[b] for b in plain],
            kernels,
        )
    exact = [b for b in range(batch) if n_host[b] > 0 and greedy[b]]
    if exact:
        idx = torch.tensor(exact, device=dev)
        n = torch.tensor([n_host[b] for b in exact], device=dev)
        ids, acc = _verify_greedy(target_probs[idx], drafts[idx], n)
        out[idx], num_accepted[idx] = ids, acc
    # Sampled rows: one call per draft count for the unseeded, one call per seeded row.
    calls: dict[tuple[int, int], list[int]] = {}
    for b in range(batch):
        if n_host[b] > 0 and not greedy[b]:
            key = (n_host[b], -1 if generators[b] is None else b)
            calls.setdefault(key, []).append(b)
    for (n, _), rows in calls.items():
        # The common case, one draft count for the whole batch, slices instead of gathering.
        whole = len(rows) == batch
        idx = slice(None) if whole else torch.tensor(rows, device=dev)
        ids = drafts[idx, :n]  # [g, n]
        if draft_probs is None:
            q = torch.zeros(len(rows), n, vocab, dtype=torch.float32, device=dev)
            q.scatter_(2, ids[:, :, None], 1.0)
        else:
            q = draft_probs[idx, :n].to(device=dev, dtype=torch.float32)
        got_ids, got_acc = kernels.chain(q, ids, target_probs[idx, : n + 1], generators[rows[0]])
        out[idx, : n + 1] = got_ids.to(torch.int64)
        num_accepted[idx] = got_acc.to(torch.int64)
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


def _verify_greedy(
    target_probs: torch.Tensor,  # [g, K + 1, V], one-hot rows
    drafts: torch.Tensor,  # [g, K]
    num_drafts: torch.Tensor,  # [g], each >= 1
) -> tuple[torch.Tensor, torch.Tensor]:  # ([g, K + 1] ids, -1 padded; [g] accepted counts)
    """Accept while the draft equals the target's argmax; then emit the argmax. No randomness."""
    g, k = drafts.shape
    top = target_probs.argmax(dim=-1)  # [g, K + 1]
    pos = torch.arange(k, device=drafts.device)[None, :]
    match = (drafts == top[:, :k]) & (pos < num_drafts[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [g]
    out = torch.where(pos < accepted[:, None], drafts, torch.full_like(drafts, -1))
    out = torch.cat([out, torch.full_like(out[:, :1], -1)], dim=1)
    out.scatter_(1, accepted[:, None], top.gather(1, accepted[:, None]))
    return out, accepted
