"""Pure-PyTorch reference backend: gathers each sequence's pages and runs SDPA on them.

It is the CPU path and the oracle the FlashInfer backend is tested against. Per-sequence work is a
Python loop, fine for the batch sizes a CPU serves; on GPU the FlashInfer backend takes over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


@dataclass
class _SeqPlan:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # [num_pages] int64 block ids covering kv_len
    mask: torch.Tensor | None  # [q_len, kv_len] bool, None when q_len == 1 (sees every key)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> None:
        seq_plans: list[_SeqPlan] = []
        start = 0
        for q_len, kv_len, table in zip(meta.q_lens, meta.kv_lens, meta.block_tables, strict=True):
            num_pages = -(-kv_len // meta.page_size)
            pages = torch.tensor(table[:num_pages], dtype=torch.int64, device=self.device)
            mask = None
            if q_len > 1:
                # Bottom-right causal: row r sees keys 0 .. kv_len - q_len + r.
                rows = torch.arange(q_len, device=self.device).unsqueeze(1)
                cols = torch.arange(kv_len, device=self.device).unsqueeze(0)
                mask = cols <= rows + (kv_len - q_len)
            seq_plans.append(_SeqPlan(start, q_len, kv_len, pages, mask))
            start += q_len
        meta.plan = seq_plans

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        for sp in meta.plan:  # type: ignore[union-attr]
            keys = k_cache[sp.pages].flatten(0, 1)[: sp.kv_len]  # [kv_len, Hkv, D]
            values = v_cache[sp.pages].flatten(0, 1)[: sp.kv_len]
            qs = q[sp.q_start : sp.q_start + sp.q_len].transpose(0, 1)  # [H, q_len, D]
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1).to(q.dtype),
                values.transpose(0, 1).to(q.dtype),
                attn_mask=sp.mask,
                scale=self.scale,
            )  # [H, q_len, D]
            out[sp.q_start : sp.q_start + sp.q_len] = o.transpose(0, 1)
        return out
