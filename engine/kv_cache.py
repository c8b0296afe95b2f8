"""The KV pool tensors: per model, per layer, K and V pages addressed by one shared block id space.

Block id b addresses ``page_size`` token slots in every layer of every registered model (target
and draft), so a sequence's single block table serves both. Memory per block is the sum over
models of page_size x (K+V bytes per token).

Pages hold the model dtype, or with ``--kv-cache-dtype`` one byte per element: int8 rows with a
scale each, or float8 (`specdec.engine.attention.kv_format` has the encodings).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specdec.engine.attention.kv_format import as_bytes, row_width
from specdec.engine.models.arch import ModelArch

logger = logging.getLogger(__name__)

GIB = 1 << 30
KV_CACHE_TORCH_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``--kv-cache-dtype`` (auto: the model's)."""
    return KV_CACHE_TORCH_DTYPES.get(name, model_dtype)


@dataclass
class ModelKV:
    """One model's pages: per layer (k, v), each [num_blocks, page_size, num_kv_heads, row] (row:
    head_dim, plus an int8 pool's per-row scale)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]


def bytes_per_block(archs: list[ModelArch], page_size: int, dtype: torch.dtype) -> int:
    size = torch.empty(0, dtype=dtype).element_size()
    per_token = [
        a.kv_bytes_per_token(size) * row_width(a.head_dim, dtype) // a.head_dim for a in archs
    ]
    return page_size * sum(per_token)


def num_blocks_for_budget(
    archs: list[ModelArch], page_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    return max(0, budget_bytes // bytes_per_block(archs, page_size, dtype))


def allocate_model_kv(
    arch: ModelArch, num_blocks: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> ModelKV:
    shape = (num_blocks, page_size, arch.num_key_value_heads, row_width(arch.head_dim, dtype))
    layers = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]
    return ModelKV(layers)


def copy_kv_slots(kv: ModelKV, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
    """Copy the keys and values at pool slots ``src_slots[j]`` to ``dst_slots[j]``, in every layer.

    Moves an accepted token-tree path into place: the node at depth d, verified at scratch slot
    ``context_len + j`` (breadth-first index j >= d), goes to the slot of ``context_len + d``.
    Each layer's sources are gathered into a new tensor before any destination is written, so
    overlapping source and destination sets are safe in any order (the in-order case, where a
    destination is the source of an earlier-listed node, included); destinations must be distinct.
    Raises ValueError, with nothing copied, on lists of different lengths, a repeated destination
    or a slot outside the pool.
    """
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots for {len(dst_slots)} destinations")
    if len(set(dst_slots)) != len(dst_slots):
        raise ValueError(f"destination slots must be distinct, got {list(dst_slots)}")
    if not kv.layers or not src_slots:
        return
    k0 = kv.layers[0][0]
    num_slots = k0.shape[0] * k0.shape[1]
    bad = [s for s in (*src_slots, *dst_slots) if not 0 <= s < num_slots]
    if bad:
        raise ValueError(f"slots {bad} are outside the pool of {num_slots} slots")
    src = torch.tensor(list(src_slots), dtype=torch.int64, device=k0.device)
    dst = torch.tensor(list(dst_slots), dtype=torch.int64, device=k0.device)
    for k_cache, v_cache in kv.layers:
        for cache in (k_cache, v_cache):
            flat = as_bytes(cache).view(-1, *cache.shape[2:])  # [num_slots, kv_heads, row]
            flat.index_copy_(0, dst, flat.index_select(0, src))
