"""Pure-PyTorch reference backend: gathers each sequence's pages and runs SDPA on them.

It is the CPU path and the oracle the FlashInfer backend is tested against. Per-sequence work is a
Python loop, fine for the batch sizes a CPU serves; on GPU the FlashInfer backend takes over.

Rows that are sampled from (a decode, a verify of up to 1 + MAX_SPECULATIVE_TOKENS rows, a tree)
are computed one by one, each over exactly the keys it sees as one contiguous run: the very call
a plain decode makes at that position. One masked call over a longer run of keys sums the same
terms in another blocking (a softmax and a product over more keys, some masked), which rounds
differently in fp32 and bf16 and can flip a greedy token; row by row, a verified or tree row's
logits are bit for bit those of plain decode. Longer runs (prompt chunks) take one masked call.
Every call passes 4-D tensors, which selects torch's fused CPU attention kernel (the 3-D form
falls back to unfused matrix products: several times slower at a few hundred keys and over ten
times at two thousand).

Where the native kernels build (``engine/models/native.py``) and the pool holds float32 or bf16,
all of a step's row-by-row rows go to one native call per layer instead (``paged_attention.c``):
the same computation, each row alone over its ordered keys, read from the pages in place. At one
row and a few hundred keys the torch calls' fixed overhead (two gathers, the dtype view, SDPA)
was most of a layer's attention time. Either way every such row goes through the same routine,
so verified and tree rows stay bit for bit plain decode's.
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
from specdec.engine.config import MAX_SPECULATIVE_TOKENS
from specdec.engine.models import native

# Sequences with at most this many new rows are computed row by row (module docstring): every
# verify of a chain fits, and a prompt's short last chunk costs a few calls more.
ROW_BY_ROW_MAX = MAX_SPECULATIVE_TOKENS + 1


@dataclass
class _SeqPlan:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # [num_pages] int64 block ids covering kv_len
    mask: torch.Tensor | None  # [group * q_len, kv_len] bool, for one masked call
    # a tree's rows: the key positions each one sees, in order (None without a tree)
    row_keys: list[torch.Tensor] | None = None


@dataclass
class _NativeRows:
    """A step's row-by-row rows as the native kernel takes them (``paged_attention.c``)."""

    pages: torch.Tensor  # int64: every such sequence's block ids, one after another
    row: torch.Tensor  # int32 [R]: the row's index in q and out
    page_start: torch.Tensor  # int32 [R]: where its sequence's block ids start in `pages`
    key_start: torch.Tensor  # int32 [R + 1]: its key positions are keys[key_start[r]:...[r + 1]]
    keys: torch.Tensor  # int32: key positions within the row's sequence, in order


@dataclass
class _StepPlan:
    seqs: list[_SeqPlan]  # the sequences the torch calls compute
    native: _NativeRows | None  # the rows the native kernel computes


def _native_rows(seqs: list[_SeqPlan]) -> _NativeRows:
    pages, rows, page_start, key_start, keys = [], [], [], [0], []
    at = 0
    for sp in seqs:
        pages.append(sp.pages)
        first = sp.kv_len - sp.q_len
        for r in range(sp.q_len):
            seen = sp.row_keys[r] if sp.row_keys is not None else torch.arange(first + r + 1)
            rows.append(sp.q_start + r)
            page_start.append(at)
            keys.append(seen.to(torch.int32))
            key_start.append(key_start[-1] + len(seen))
        at += len(sp.pages)
    i32 = torch.int32
    return _NativeRows(
        torch.cat(pages) if pages else torch.empty(0, dtype=torch.int64),
        torch.tensor(rows, dtype=i32),
        torch.tensor(page_start, dtype=i32),
        torch.tensor(key_start, dtype=i32),
        torch.cat(keys) if keys else torch.empty(0, dtype=i32),
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device):
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        # The kernel's head_dim: whole 16-lane vectors, at most 256 (MAX_VECTORS).
        fits = head_dim % 16 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0
        use_native = device.type == "cpu" and fits
        self.native = native.library() if use_native else None

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
            elif q_len > ROW_BY_ROW_MAX:
                # Bottom-right causal, repeated per query head of a KV group (see forward), once
                # per step, not per layer.
                mask = sequence_mask(q_len, kv_len, None, self.device).repeat(group, 1)
            seq_plans.append(_SeqPlan(start, q_len, kv_len, pages, mask, row_keys))
            start += q_len
        by_rows = [sp for sp in seq_plans if sp.mask is None]
        native_rows = _native_rows(by_rows) if self.native is not None and by_rows else None
        meta.plan = _StepPlan(seq_plans, native_rows)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        hkv, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        step: _StepPlan = meta.plan  # type: ignore[assignment]
        # A pool in another format (int8, fp8) is decoded by the torch calls.
        natively = (
            step.native is not None
            and k_cache.dtype == q.dtype
            and q.dtype in (torch.float32, torch.bfloat16)
        )
        if natively:
            self._native_call(q.contiguous(), k_cache, v_cache, step.native, out)
        for sp in step.seqs:
            if natively and sp.mask is None:
                continue
            if sp.row_keys is not None:
                self._tree_rows(q, k_cache, v_cache, sp, out)
                continue
            # [Hkv, kv, D] in the model dtype
            keys = decode(_gather(k_cache, sp), q.dtype).transpose(0, 1)
            values = decode(_gather(v_cache, sp), q.dtype).transpose(0, 1)
            if sp.mask is None:  # row by row, each over the keys up to its own
                rows = q[sp.q_start : sp.q_start + sp.q_len].view(sp.q_len, 1, hkv, group, dim)
                keys, values = keys[None], values[None]
                first = sp.kv_len - sp.q_len
                for r in range(sp.q_len):
                    seen = first + r + 1
                    o = F.scaled_dot_product_attention(
                        rows[r], keys[:, :, :seen], values[:, :, :seen], scale=self.scale
                    )
                    out[sp.q_start + r] = o.view(-1, dim)
                continue
            # GQA without copying K/V per query head: the `group` query heads sharing a KV head
            # become extra rows of one attention problem per KV head.
            qs = q[sp.q_start : sp.q_start + sp.q_len].view(sp.q_len, hkv, group, dim)
            qs = qs.permute(1, 2, 0, 3).reshape(1, hkv, group * sp.q_len, dim)
            o = F.scaled_dot_product_attention(
                qs, keys[None], values[None], attn_mask=sp.mask, scale=self.scale
            )  # [1, Hkv, group * q_len, D]
            o = o.view(hkv, group, sp.q_len, dim).permute(2, 0, 1, 3)
            out[sp.q_start : sp.q_start + sp.q_len] = o.reshape(sp.q_len, -1, dim)
        return out

    def _native_call(self, q, k_cache, v_cache, rows: _NativeRows, out: torch.Tensor) -> None:
        """Every row-by-row row of the step in one native call (module docstring)."""
        status = self.native.paged_attention_rows(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
            self.num_kv_heads, self.num_heads, self.head_dim, rows.pages.data_ptr(),
            rows.row.data_ptr(), rows.page_start.data_ptr(), rows.key_start.data_ptr(),
            rows.keys.data_ptr(), len(rows.row), self.scale, int(q.dtype == torch.bfloat16),
            out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the native attention kernel could not allocate its scratch")

    def _tree_rows(self, q, k_cache, v_cache, sp: _SeqPlan, out: torch.Tensor) -> None:
        """A tree's rows one by one, each over its visible keys as one contiguous run."""
        hkv, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        all_keys, all_values = _gather(k_cache, sp), _gather(v_cache, sp)  # [kv, Hkv, D]
        for r, idx in enumerate(sp.row_keys or []):
            keys = decode(all_keys.index_select(0, idx).transpose(0, 1), q.dtype)  # [Hkv, n, D]
            values = decode(all_values.index_select(0, idx).transpose(0, 1), q.dtype)
            # The call a plain decode makes at this position (forward's row-by-row loop).
            qs = q[sp.q_start + r].view(1, hkv, group, dim)
            o = F.scaled_dot_product_attention(qs, keys[None], values[None], scale=self.scale)
            out[sp.q_start + r] = o.view(-1, dim)


def _gather(cache: torch.Tensor, sp: _SeqPlan) -> torch.Tensor:
    """The sequence's keys (or values) in order, [kv_len, Hkv, D]: its pages copied out of the
    pool. ``index_select`` rather than indexing with the page tensor: the same copy, without
    advanced indexing's general path (3x faster at 5 pages, 10x at 124 on a 2-core CPU)."""
    return cache.index_select(0, sp.pages).flatten(0, 1)[: sp.kv_len]
