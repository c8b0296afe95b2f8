"""Pure-PyTorch reference backend: gathers each sequence's pages and runs SDPA on them.

It is the CPU path and the oracle the FlashInfer backend is tested against. Per-sequence work is a
Python loop, fine for the batch sizes a CPU serves; on GPU the FlashInfer backend takes over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specdec.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    sequence_mask,
    write_kv,
)


@dataclass
class _SeqPlan:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # [num_pages] int64 block ids covering kv_len
    # [group * q_len, kv_len] bool; None for a one-row sequence without a tree mask (sees all)
    mask: torch.Tensor | None


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> None:
        seq_plans: list[_SeqPlan] = []
        start = 0
        group = self.num_heads // self.num_kv_heads
        for i, (q_len, kv_len, table) in enumerate(
            zip(meta.q_lens, meta.kv_lens, meta.block_tables, strict=True)
        ):
            num_pages = -(-kv_len // meta.page_size)
            pages = torch.tensor(table[:num_pages], dtype=torch.int64, device=self.device)
            tree = meta.tree_mask(i)
            mask = None
            if q_len > 1 or tree is not None:
                # Bottom-right causal, or the tree mask over the new rows after the context;
                # repeated per query head of a KV group (see forward), once per step, not per layer.
                mask = sequence_mask(q_len, kv_len, tree, self.device).repeat(group, 1)
            seq_plans.append(_SeqPlan(start, q_len, kv_len, pages, mask))
            start += q_len
        meta.plan = seq_plans

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        hkv, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        for sp in meta.plan:  # type: ignore[union-attr]
            keys = k_cache[sp.pages].flatten(0, 1)[: sp.kv_len].transpose(0, 1)  # [Hkv, kv, D]
            values = v_cache[sp.pages].flatten(0, 1)[: sp.kv_len].transpose(0, 1)
            # GQA without copying K/V per query head: the `group` query heads sharing a KV head
            # become extra rows of one attention problem per KV head.
            qs = q[sp.q_start : sp.q_start + sp.q_len].view(sp.q_len, hkv, group, dim)
            qs = qs.permute(1, 2, 0, 3).reshape(hkv, group * sp.q_len, dim)
            o = F.scaled_dot_product_attention(
                qs, keys.to(q.dtype), values.to(q.dtype), attn_mask=sp.mask, scale=self.scale
            )  # [Hkv, group * q_len, D]
            o = o.view(hkv, group, sp.q_len, dim).permute(2, 0, 1, 3)
            out[sp.q_start : sp.q_start + sp.q_len] = o.reshape(sp.q_len, -1, dim)
        return out
