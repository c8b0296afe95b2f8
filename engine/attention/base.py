"""The attention contract every backend implements.

A step's batch is flat and ragged: sequence i contributes ``q_lens[i]`` query rows (a prefill
chunk, one decode token, or a last token plus k drafts to verify) and, after this step's keys are
written, has ``kv_lens[i]`` keys in its pages. Attention is causal aligned bottom-right: query row
r of sequence i sees keys ``0 .. kv_lens[i] - q_lens[i] + r``. Keys and values of the new rows are
first written into the paged pool at ``slot_mapping`` (slot = block_id * page_size + offset).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch, shared by every layer of one model."""

    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    page_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    qo_indptr: torch.Tensor  # [num_seqs + 1] int32, prefix sums of q_lens
    # Filled by the backend's plan(): whatever it needs per step, computed once, used per layer.
    plan: object | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


def build_attention_metadata(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build metadata from per-sequence lengths; new rows occupy kv positions [kv-q, kv)."""
    slots: list[int] = []
    for q, kv, table in zip(q_lens, kv_lens, block_tables, strict=True):
        if q < 1 or kv < q:
            raise ValueError(f"need 1 <= q_len <= kv_len, got q_len={q}, kv_len={kv}")
        if len(table) * page_size < kv:
            raise ValueError(f"block table of {len(table)} pages cannot hold {kv} keys")
        for pos in range(kv - q, kv):
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    indptr = [0]
    for q in q_lens:
        indptr.append(indptr[-1] + q)
    return AttentionMetadata(
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        block_tables=[list(t) for t in block_tables],
        page_size=page_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
    )


class AttentionBackend(ABC):
    """Paged attention over a ragged batch. One instance per model (its head shape is fixed)."""

    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.device = device

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-step state once, before the first layer (index arrays, kernel plans)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into the pool at meta.slot_mapping, then attend bottom-right causally."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into their pool slots (pool viewed as [num_slots, heads, dim])."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
