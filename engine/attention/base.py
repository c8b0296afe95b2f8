"""The attention contract every backend implements.

A step's batch is flat and ragged: sequence i contributes ``q_lens[i]`` query rows (a prefill
chunk, one decode token, a last token plus k drafts to verify, or the nodes of a token tree) and,
after this step's keys are written, has ``kv_lens[i]`` keys in its pages. The new rows' keys occupy
positions ``kv_lens[i] - q_lens[i] .. kv_lens[i] - 1`` and are first written into the paged pool at
``slot_mapping`` (slot = block_id * page_size + offset).

Attention is causal aligned bottom-right: query row r of sequence i sees keys
``0 .. kv_lens[i] - q_lens[i] + r``. A sequence may instead carry a tree mask, a ``[q_len, m]``
bool matrix over its last ``m`` keys (``q_len <= m <= kv_len``: the new rows, and before them the
nodes of the same tree written by earlier forwards, as when a draft grows a tree level by level).
Row r then sees every key before those m and, of them, column c only where ``tree_mask[r, c]``.
Row r is key column ``m - q_len + r``; it must see itself and no later column (a node's ancestors
come before it, as in breadth-first order). Masks equal to the causal one are dropped when the
metadata is built: a batch without a real tree keeps every fast path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from specdec.engine.attention.kv_format import as_bytes, encode


@dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch, shared by every layer of one model."""

    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    page_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    qo_indptr: torch.Tensor  # [num_seqs + 1] int32, prefix sums of q_lens
    # Per sequence a [q_len, m] bool CPU tensor over its last m keys, or None (causal); the list
    # itself is None when no sequence has one. Built by `build_attention_metadata`.
    tree_masks: list[torch.Tensor | None] | None = None
    # Filled by the backend's plan(): whatever it needs per step, computed once, used per layer.
    plan: object | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    def tree_mask(self, i: int) -> torch.Tensor | None:
        """Sequence i's tree mask over its last keys, or None when it attends causally."""
        return None if self.tree_masks is None else self.tree_masks[i]


def slots_for_positions(
    block_table: Sequence[int], positions: Sequence[int], page_size: int
) -> list[int]:
    """Pool slots (block_id * page_size + offset) of a sequence's token positions."""
    return [block_table[p // page_size] * page_size + p % page_size for p in positions]


def check_tree_mask(
    mask: torch.Tensor, q_len: int, kv_len: int | None = None
) -> torch.Tensor | None:
    """Validate one sequence's tree mask; returns it on the CPU, or None when it is causal.

    Raises ValueError unless it is a ``[q_len, m]`` bool matrix (``q_len <= m <= kv_len``) whose
    row r sees its own column ``m - q_len + r`` and no column after it.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"a tree mask must be a bool tensor, got {getattr(mask, 'dtype', mask)}")
    limit = q_len if kv_len is None else kv_len
    if mask.dim() != 2 or mask.shape[0] != q_len or not q_len <= mask.shape[1] <= limit:
        raise ValueError(
            f"a tree mask for {q_len} new rows must be [{q_len}, m] with {q_len} <= m <= "
            f"{limit} (the keys it covers), got {list(mask.shape)}"
        )
    mask = mask.cpu()
    offset = mask.shape[1] - q_len  # column of row 0
    if not bool(mask.diagonal(offset).all()):
        row = int((~mask.diagonal(offset)).nonzero()[0])
        raise ValueError(f"tree mask row {row} does not see itself")
    upper = mask.triu(offset + 1)
    if bool(upper.any()):
        row, col = (int(x) for x in upper.nonzero()[0])
        raise ValueError(
            f"tree mask row {row} sees the later key {col}; a node's ancestors must come before it"
        )
    if torch.equal(mask, torch.ones_like(mask).tril(offset)):
        return None  # every covered key up to the row's own: exactly the causal mask
    return mask


def tree_mask_from_parents(parents: Sequence[int]) -> torch.Tensor:
    """The ``[n, n]`` tree mask of n nodes listed parents first (breadth-first order, say).

    ``parents[j]`` is node j's parent index, below j, or -1 for a root; row j sees node j and
    its ancestors. Raises ValueError when a parent does not come before its child.
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"node {j} has parent {parent}; parents must come before children")
        if parent >= 0:
            mask[j] = mask[parent]
        mask[j, j] = True
    return mask


def sequence_mask(
    q_len: int,
    kv_len: int,
    tree_mask: torch.Tensor | None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``[q_len, kv_len]`` bool on `device` (default CPU): which keys each new row of a sequence
    sees (the contract: causal bottom-right, or every key before the tree mask's, then it)."""
    if tree_mask is None:
        rows = torch.arange(q_len, device=device).unsqueeze(1)
        return torch.arange(kv_len, device=device).unsqueeze(0) <= rows + (kv_len - q_len)
    ones = torch.ones(q_len, kv_len - tree_mask.shape[1], dtype=torch.bool, device=device)
    return torch.cat([ones, tree_mask.to(device)], dim=1)


def build_attention_metadata(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device,
    tree_masks: Sequence[torch.Tensor | None] | None = None,
) -> AttentionMetadata:
    """Build metadata from per-sequence lengths; new rows occupy kv positions [kv-q, kv).

    ``tree_masks``, when given, has one entry per sequence: None (causal) or its tree mask
    (`check_tree_mask`; ValueError on a malformed one).
    """
    if tree_masks is not None and len(tree_masks) != len(q_lens):
        raise ValueError(f"{len(tree_masks)} tree masks for {len(q_lens)} sequences")
    slots: list[int] = []
    for q, kv, table in zip(q_lens, kv_lens, block_tables, strict=True):
        if q < 1 or kv < q:
            raise ValueError(f"need 1 <= q_len <= kv_len, got q_len={q}, kv_len={kv}")
        if len(table) * page_size < kv:
            raise ValueError(f"block table of {len(table)} pages cannot hold {kv} keys")
        slots.extend(slots_for_positions(table, range(kv - q, kv), page_size))
    masks: list[torch.Tensor | None] | None = None
    if tree_masks is not None:
        masks = []
        for i, (m, q, kv) in enumerate(zip(tree_masks, q_lens, kv_lens, strict=True)):
            try:
                masks.append(None if m is None else check_tree_mask(m, q, kv))
            except ValueError as exc:
                raise ValueError(f"sequence {i}: {exc}") from None
        if all(m is None for m in masks):
            masks = None
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
        tree_masks=masks,
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
        """Write k/v into the pool at meta.slot_mapping, then attend bottom-right causally (or
        through the sequence's tree mask where it has one)."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into their pool slots (pool viewed as [num_slots, heads, row]),
    encoded in the pool's format (`kv_format`)."""
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = as_bytes(cache).view(-1, *cache.shape[2:])
        flat.index_copy_(0, slot_mapping, encode(new, cache.dtype))
