"""The KV pool tensors: per model, per layer, K and V pages addressed by one shared block id space.

Block id b addresses ``page_size`` token slots in every layer of every registered model (target
and draft), so a sequence's single block table serves both. Memory per block is the sum over
models of page_size x (K+V bytes per token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from specdec.engine.models.arch import ModelArch

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class ModelKV:
    """One model's pages: per layer (k, v), each [num_blocks, page_size, num_kv_heads, head_dim]."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]


def bytes_per_block(archs: list[ModelArch], page_size: int, dtype: torch.dtype) -> int:
    size = torch.empty(0, dtype=dtype).element_size()
    return page_size * sum(a.kv_bytes_per_token(size) for a in archs)


def num_blocks_for_budget(
    archs: list[ModelArch], page_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    return max(0, budget_bytes // bytes_per_block(archs, page_size, dtype))


def allocate_model_kv(
    arch: ModelArch, num_blocks: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> ModelKV:
    shape = (num_blocks, page_size, arch.num_key_value_heads, arch.head_dim)
    layers = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]
    return ModelKV(layers)
