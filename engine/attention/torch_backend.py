"""Pure-PyTorch reference backend: gathers each sequence's pages and runs SDPA on them.

It is the CPU path and the oracle the FlashInfer backend is tested against. Per-sequence work is a
Python loop, fine for the batch sizes a CPU serves; on GPU the FlashInfer backend takes over.

A sequence with a tree mask is computed row by row: each row attends to its visible keys gathered
into one contiguous run (the context, then its ancestors, then itself), the very call a plain
decode makes at that position. A masked call over the tree's scattered slots would sum the same
terms in another blocking, and in bf16 that rounding difference can flip a greedy token; this way
a tree node's logits are bit for bit those of plain decode, in every format.
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
from specdec.engine.attention.kv_format import decode


@dataclass
class _SeqPlan:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # [num_pages] int64 block ids covering kv_len
    # [group * q_len, kv_len] bool; None for a one-row sequence (sees all) or a tree
    mask: torch.Tensor | None
    # a tree's rows: the key positions each one sees, in order (None without a tree)
    row_keys: list[torch.Tensor] | None = None


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
            mask, row_keys = None, None
            if tree is not None:
                visible = sequence_mask(q_len, kv_len, tree, self.device)
                row_keys = [row.nonzero().flatten() for row in visible]
            elif q_len > 1:
                # Bottom-right causal, repeated per query head of a KV group (see forward), once
                # per step, not per layer.
                mask = sequence_mask(q_len, kv_len, None, self.device).repeat(group, 1)
            seq_plans.append(_SeqPlan(start, q_len, kv_len, pages, mask, row_keys))
            start += q_len
        meta.plan = seq_plans

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        hkv, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        for sp in meta.plan:  # type: ignore[union-attr]
            if sp.row_keys is not None:
                self._tree_rows(q, k_cache, v_cache, sp, out)
                continue
            keys = k_cache[sp.pages].flatten(0, 1)[: sp.kv_len].transpose(0, 1)  # [Hkv, kv, D]
            values = v_cache[sp.pages].flatten(0, 1)[: sp.kv_len].transpose(0, 1)
            # GQA without copying K/V per query head: the `group` query heads sharing a KV head
            # become extra rows of one attention problem per KV head.
            qs = q[sp.q_start : sp.q_start + sp.q_len].view(sp.q_len, hkv, group, dim)
            qs = qs.permute(1, 2, 0, 3).reshape(hkv, group * sp.q_len, dim)
            o = F.scaled_dot_product_attention(
                qs, decode(keys, q.dtype), decode(values, q.dtype), attn_mask=sp.mask,
                scale=self.scale,
            )  # [Hkv, group * q_len, D]  # fmt: skip
            o = o.view(hkv, group, sp.q_len, dim).permute(2, 0, 1, 3)
            out[sp.q_start : sp.q_start + sp.q_len] = o.reshape(sp.q_len, -1, dim)
        return out

    def _tree_rows(self, q, k_cache, v_cache, sp: _SeqPlan, out: torch.Tensor) -> None:
        """A tree's rows one by one, each over its visible keys as one contiguous run."""
        hkv, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        all_keys = k_cache[sp.pages].flatten(0, 1)[: sp.kv_len]  # [kv, Hkv, D]
        all_values = v_cache[sp.pages].flatten(0, 1)[: sp.kv_len]
        for r, idx in enumerate(sp.row_keys or []):
            keys = decode(all_keys.index_select(0, idx).transpose(0, 1), q.dtype)  # [Hkv, n, D]
            values = decode(all_values.index_select(0, idx).transpose(0, 1), q.dtype)
            qs = q[sp.q_start + r].view(hkv, group, dim)
            o = F.scaled_dot_product_attention(qs, keys, values, scale=self.scale)
            out[sp.q_start + r] = o.reshape(-1, dim)
