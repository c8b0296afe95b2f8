"""FlashInfer paged attention behind the engine's attention contract (CUDA only).

The KV pool is already what FlashInfer calls the NHD layout: per layer, K and V pages of shape
``[num_blocks, page_size, num_kv_heads, head_dim]``, passed to the kernels as a ``(k, v)`` tuple.
A step's ragged batch becomes four int32 arrays (built on the host by `build_flashinfer_indices`,
so planning never waits on the device):

* ``qo_indptr``: prefix sums of ``q_lens``; sequence i owns query rows
  ``qo_indptr[i] .. qo_indptr[i + 1]``;
* ``paged_kv_indptr``: prefix sums of the pages each sequence uses, ``ceil(kv_len / page_size)``;
* ``paged_kv_indices``: those pages' block ids, concatenated in sequence order;
* ``paged_kv_last_page_len``: keys in each sequence's last page, in ``1 .. page_size``.

Kernel choice per step (planned once in `plan`, reused by every layer):

* every sequence has one query row (plain decode, or draft steps): the batch-decode wrapper with
  tensor cores, which for grouped-query heads beats the CUDA-core decode kernel;
* anything else (prompt chunks, k + 1-row verifies, or a mix): the batch-prefill wrapper with
  ``causal=True``. FlashInfer aligns its causal mask bottom-right, which is exactly the engine's
  contract: row r of a sequence sees keys ``0 .. kv_len - q_len + r``;
* a batch where some sequence carries a tree mask (token-tree verification): a second
  batch-prefill wrapper, always on the FA2 kernels, planned with FlashInfer's custom mask. The
  mask mode is one per batch, so every sequence of such a batch gets an explicit mask: its
  ``[q_len, kv_len]`` rows (`sequence_mask`: the tree mask after the context, or causal) flattened
  row-major and concatenated in sequence order (`build_flashinfer_custom_mask`), which FlashInfer
  bit-packs per sequence ("little" bit order) and reads at byte offset ``mask_indptr[i]``, bit
  ``r * kv_len + c``. FlashInfer's FA3 kernels take no custom mask (its backend check refuses
  FA3 whenever one is given), hence the FA2 pin for this wrapper whatever ``prefill_kernel`` is.
  The mask is passed unpacked, on the device, with the index arrays on the device too: FlashInfer
  packs it with a CUDA kernel that needs its segment offsets on the mask's device (0.6.x computes
  them from the index arrays passed to ``plan``), and a pre-packed mask would be paired with
  offsets counted in bits while the kernel reads them as bytes. Packing reads its output length
  back, so planning a tree batch waits for the device once; batches without a tree are unchanged.
  CUDA graphs never replay tree batches (`cuda_graphs.graph_bucket`).

The prefill wrapper is pinned to the FA2 kernels rather than FlashInfer's "auto" (FA3 on Hopper):
the tensor-core decode path is built on the same FA2 module, so one JIT-compiled module per
(dtype, head_dim) serves every step, and verify batches (a few rows per sequence) are not where FA3
wins. The model dtype is passed as ``q_data_type`` (FlashInfer's default is float16).

`flashinfer` is imported only when a backend is built or `self_test` runs, so this module imports
on machines without it; the registry imports it only when this backend is asked for.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from specdec.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    build_attention_metadata,
    sequence_mask,
    write_kv,
)
from specdec.engine.errors import ConfigError

logger = logging.getLogger(__name__)

# Float workspace for split-KV partial results, shared by every wrapper of a backend. FlashInfer
# suggests 128 MiB, but CUDA-graph wrappers always split KV and size their partials by the
# padded tile count: a 7B-class head layout (28 q / 4 kv heads, head_dim 128) verifying 5 rows
# for each of 64 sequences needs ~143 MiB on a 132-SM H200, 9 rows ~168 MiB.
WORKSPACE_BYTES = 256 * 1024 * 1024
PREFILL_KERNELS = ("fa2", "fa3", "auto")
DEFAULT_PREFILL_KERNEL = "fa2"


class FlashInferIndices(TypedDict):
    """Host-side index arrays for one step (int32 CPU tensors) and the kernel family to use."""

    qo_indptr: torch.Tensor  # [num_seqs + 1]
    paged_kv_indptr: torch.Tensor  # [num_seqs + 1]
    paged_kv_indices: torch.Tensor  # [paged_kv_indptr[-1]]
    paged_kv_last_page_len: torch.Tensor  # [num_seqs], each in 1..page_size
    kv_lens: torch.Tensor  # [num_seqs]
    is_pure_decode: bool  # every sequence has exactly one query row


def build_flashinfer_indices(meta: AttentionMetadata) -> FlashInferIndices:
    """Turn the step's per-sequence lengths and block tables into FlashInfer's index arrays.

    Pure host arithmetic on ``meta.q_lens``, ``meta.kv_lens`` and ``meta.block_tables`` (no
    device tensor is read, so no synchronisation). Raises ValueError on lengths that break the
    contract (``1 <= q_len <= kv_len``) or a block table too short for ``kv_len`` keys.
    """
    return flashinfer_indices_from_lengths(
        meta.q_lens, meta.kv_lens, meta.block_tables, meta.page_size
    )


def flashinfer_indices_from_lengths(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
) -> FlashInferIndices:
    """`build_flashinfer_indices` on plain lists (what CUDA-graph replays build for padded rows)."""
    if not len(q_lens) == len(kv_lens) == len(block_tables):
        raise ValueError(
            f"q_lens ({len(q_lens)}), kv_lens ({len(kv_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    qo_indptr = [0]
    kv_indptr = [0]
    indices: list[int] = []
    last_page_len: list[int] = []
    for q, kv, table in zip(q_lens, kv_lens, block_tables, strict=True):
        if q < 1 or kv < q:
            raise ValueError(f"need 1 <= q_len <= kv_len, got q_len={q}, kv_len={kv}")
        num_pages = -(-kv // page_size)
        if len(table) < num_pages:
            raise ValueError(f"block table of {len(table)} pages cannot hold {kv} keys")
        qo_indptr.append(qo_indptr[-1] + q)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        indices.extend(table[:num_pages])
        last_page_len.append(kv - (num_pages - 1) * page_size)
    i32 = torch.int32
    return FlashInferIndices(
        qo_indptr=torch.tensor(qo_indptr, dtype=i32),
        paged_kv_indptr=torch.tensor(kv_indptr, dtype=i32),
        paged_kv_indices=torch.tensor(indices, dtype=i32),
        paged_kv_last_page_len=torch.tensor(last_page_len, dtype=i32),
        kv_lens=torch.tensor(list(kv_lens), dtype=i32),
        is_pure_decode=all(q == 1 for q in q_lens),
    )


def build_flashinfer_custom_mask(meta: AttentionMetadata) -> torch.Tensor | None:
    """The step's custom mask in FlashInfer's flattened layout, or None when no sequence has a
    tree mask.

    A 1-D bool CPU tensor of ``sum(q_len[i] * kv_len[i])`` entries: sequence i's
    ``[q_len, kv_len]`` mask (`sequence_mask`, query rows first) flattened row-major, sequences
    concatenated in batch order; True means the key is attended to.
    """
    if meta.tree_masks is None:
        return None
    parts = [
        sequence_mask(q, kv, meta.tree_mask(i)).flatten()
        for i, (q, kv) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True))
    ]
    return torch.cat(parts)


def import_flashinfer() -> Any:
    """Import and return the `flashinfer` package; ConfigError with the cause when it fails."""
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # ImportError, or a broken install failing at import time
        raise ConfigError(
            f"the FlashInfer attention backend needs the flashinfer-python package "
            f"({type(exc).__name__}: {exc}); install it or use --attention-backend torch"
        ) from exc


@dataclass
class FlashInferStepPlan:
    """What `plan` leaves in ``meta.plan``: the index arrays and the wrapper planned for them."""

    indices: FlashInferIndices
    page_size: int
    wrapper: Any = None  # a planned FlashInfer wrapper; None until the kernels are planned
    # `build_flashinfer_custom_mask`: set when some sequence has a tree mask, else None.
    custom_mask: torch.Tensor | None = None


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer's batch decode / batch prefill wrappers."""

    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        prefill_kernel: str = DEFAULT_PREFILL_KERNEL,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        if device.type != "cuda":
            raise ConfigError(f"the FlashInfer attention backend needs a CUDA device, got {device}")
        if prefill_kernel not in PREFILL_KERNELS:
            raise ConfigError(f"prefill_kernel must be one of {PREFILL_KERNELS}")
        self._flashinfer = import_flashinfer()
        self.prefill_kernel = prefill_kernel
        # One float workspace serves both wrappers: a step plans and runs only one of them.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_kernel
        )
        self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self._tree_prefill: Any = None  # FA2 prefill wrapper for custom-mask (tree) batches
        # The model dtype (q and KV pages). Unknown until the owner sets it or the first forward
        # shows it; until then planning the kernels waits for layer 0 of the first step.
        self.dtype: torch.dtype | None = None
        # The KV pages' element type when it differs from the model's (--kv-cache-dtype fp8);
        # None: the model dtype. FlashInfer reads float8 pages and computes in q's dtype.
        self.kv_dtype: torch.dtype | None = None
        # Per wrapper: an event recorded after its last plan (see plan_wrapper).
        self._planned: dict[int, torch.cuda.Event] = {}

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> None:
        step = FlashInferStepPlan(
            build_flashinfer_indices(meta),
            meta.page_size,
            custom_mask=build_flashinfer_custom_mask(meta),
        )
        meta.plan = step
        if self.dtype is not None:
            self.plan_wrapper(step, self.eager_wrapper_for(step), self.dtype)

    def eager_wrapper_for(self, step: FlashInferStepPlan) -> Any:
        if step.custom_mask is not None:
            if self._tree_prefill is None:  # built on the first tree batch
                self._tree_prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend="fa2"
                )
            return self._tree_prefill
        return self._decode if step.indices["is_pure_decode"] else self._prefill

    def plan_wrapper(self, step: FlashInferStepPlan, wrapper: Any, dtype: torch.dtype) -> None:
        """Plan `wrapper` (a decode or prefill wrapper, eager or CUDA-graph) for `step`.

        FlashInfer's plan writes its schedule into one pinned host buffer per wrapper and queues
        an asynchronous copy from it. Planning the same wrapper again before the device has made
        that copy (several draft steps queued back to back) would overwrite the schedule under
        it, so the host first waits for the event recorded after the previous plan: it may run
        ahead of the device by one plan of a wrapper, not more.
        """
        previous = self._planned.get(id(wrapper))
        if previous is not None:
            previous.synchronize()
        ix = step.indices
        indices = ix["paged_kv_indices"]
        is_graph = bool(getattr(wrapper, "is_cuda_graph_enabled", False))
        is_decode = isinstance(wrapper, self._flashinfer.BatchDecodeWithPagedKVCacheWrapper)
        if step.custom_mask is not None and (is_decode or is_graph):
            raise ValueError("a tree-mask batch runs on the eager prefill wrapper only")
        if is_graph:
            # A graph wrapper copies host indices into its fixed buffer with a blocking copy,
            # which waits for every queued kernel: the host could never run ahead of the GPU.
            # Handed a device tensor, it makes an asynchronous device-to-device copy instead.
            indices = indices.to(self.device, non_blocking=True)
        common: dict[str, Any] = {
            "q_data_type": dtype,
            "kv_data_type": self.kv_dtype or dtype,
            "sm_scale": self.scale,
        }
        if is_decode:
            if not ix["is_pure_decode"]:
                raise ValueError("a decode wrapper can only serve batches of one-row sequences")
            wrapper.plan(
                ix["paged_kv_indptr"],
                indices,
                ix["paged_kv_last_page_len"],
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                step.page_size,
                **common,
            )
        elif step.custom_mask is not None:
            # Mask and index arrays on the device: FlashInfer packs the mask there (module doc).
            dev = self.device
            wrapper.plan(
                ix["qo_indptr"].to(dev),
                ix["paged_kv_indptr"].to(dev),
                indices,
                ix["paged_kv_last_page_len"].to(dev),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                step.page_size,
                custom_mask=step.custom_mask.to(dev),
                causal=False,
                **common,
            )
        else:
            wrapper.plan(
                ix["qo_indptr"],
                ix["paged_kv_indptr"],
                indices,
                ix["paged_kv_last_page_len"],
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                step.page_size,
                causal=True,
                **common,
            )
        event = torch.cuda.Event()
        event.record()
        self._planned[id(wrapper)] = event
        step.wrapper = wrapper

    def forward(self, q, k, v, k_cache, v_cache, meta):
        step = meta.plan
        if not isinstance(step, FlashInferStepPlan):
            raise RuntimeError("plan(meta) must run before forward")
        if step.wrapper is None:
            self.dtype = q.dtype
            if k_cache.dtype != q.dtype:
                self.kv_dtype = k_cache.dtype
            self.plan_wrapper(step, self.eager_wrapper_for(step), q.dtype)
        elif q.dtype != self.dtype:
            raise RuntimeError(f"planned for {self.dtype} but q is {q.dtype}")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return step.wrapper.run(q.contiguous(), (k_cache, v_cache))  # [T, H, D]

    # ---- CUDA graphs ------------------------------------------------------------------------
    def make_graph_wrapper(self, batch_size: int, q_len: int, max_pages: int) -> Any:
        """A wrapper in CUDA-graph mode for ``batch_size`` sequences of ``q_len`` rows each.

        Its index arrays live in fixed device buffers that `plan_wrapper` refills before every
        replay (planning stays outside the graph, as FlashInfer requires).
        """
        fi, dev, i32 = self._flashinfer, self.device, torch.int32
        kv_indptr = torch.zeros(batch_size + 1, dtype=i32, device=dev)
        kv_indices = torch.zeros(max_pages, dtype=i32, device=dev)
        last_page_len = torch.ones(batch_size, dtype=i32, device=dev)
        if q_len == 1:
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=kv_indptr,
                paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(batch_size + 1, dtype=i32, device=dev),
            paged_kv_indptr_buf=kv_indptr,
            paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last_page_len,
            backend=self.prefill_kernel,
        )


# ---- start-up self-test ---------------------------------------------------------------------
# Mixed batch: a prompt chunk crossing page boundaries, a 1-row decode, a 5-row verify, a sequence
# whose keys end exactly on a page boundary; then a pure-decode batch. Page size 16.
_SELF_TEST_BATCHES: tuple[tuple[list[int], list[int]], ...] = (
    ([37, 1, 5, 16], [37, 70, 21, 32]),
    ([1, 1, 1], [1, 17, 48]),
)
SELF_TEST_TOLERANCE = 2e-2  # relative L2 error; bf16 inputs land near 4e-3


def self_test(
    device: torch.device,
    head_dim: int = 128,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """Run FlashInfer and the torch reference on small random batches; True when they agree.

    Raises whatever FlashInfer raises (missing package, JIT failure); the caller turns that
    into a fallback. The first call JIT-compiles FlashInfer's kernels for this dtype/head_dim.
    """
    from specdec.engine.attention.torch_backend import TorchAttentionBackend

    page_size = 16
    fi = FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, device)
    ref = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, device)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    for q_lens, kv_lens in _SELF_TEST_BATCHES:
        pages = [-(-kv // page_size) for kv in kv_lens]
        perm = torch.randperm(sum(pages) + 3, generator=gen).tolist()  # scattered block ids
        tables, at = [], 0
        for n in pages:
            tables.append(perm[at : at + n])
            at += n
        shape = (len(perm), page_size, num_kv_heads, head_dim)
        k_pool = torch.randn(shape, generator=gen).to(device, dtype)
        v_pool = torch.randn(shape, generator=gen).to(device, dtype)
        t = sum(q_lens)
        q = torch.randn(t, num_heads, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        outs = []
        for backend in (fi, ref):
            meta = build_attention_metadata(q_lens, kv_lens, tables, page_size, device)
            backend.plan(meta)
            kc, vc = k_pool.clone(), v_pool.clone()
            outs.append(backend.forward(q, k, v, kc, vc, meta).float())
        err = (outs[0] - outs[1]).norm() / outs[1].norm().clamp_min(1e-12)
        if not torch.isfinite(outs[0]).all() or float(err) > SELF_TEST_TOLERANCE:
            logger.warning("FlashInfer self-test: relative error %.3g on q_lens=%s", err, q_lens)
            return False
    return True
