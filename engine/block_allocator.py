"""Paged KV block allocator with prefix caching: the only code that touches reference counts.

Verbs: ``can_allocate``, ``allocate(seq, n)``, ``free(seq)``, ``truncate(seq, n)``,
``match_prefix(seq)`` (lookup) and ``cache_computed_blocks(seq)`` (insert).

A full block is hashed only after the target has computed it. Its key is a SHA-256 digest of the
previous block's key and its own token ids, so a key names the whole prefix up to and including
the block: two blocks share a key only for the same prefix, or on a SHA-256 collision (no known
way to find one; by chance about 2**-128 per pair of blocks). A hit also compares the block's own
token ids with the sequence's, a cheap check of the table rather than of the prefix. A block
whose last reference goes away keeps its hash and contents in an LRU free list, reusable by a
later prefix hit until its slot is needed for new data. Blocks also record whether the *draft*
model's K/V in them is valid, so a speculating sequence that hits the cache knows how far its draft
has to catch up.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specdec.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    draft_valid: bool = False

    def reset(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.draft_valid = False


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when the caller did not check can_allocate() first (a bug)."""


def chain_hash(prev_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """The prefix-cache key of a full block: SHA-256 of the previous block's key (nothing for the
    first block) and the block's token ids as little-endian int64s. One digest per full block."""
    digest = hashlib.sha256(prev_hash or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first. Uncached blocks are put at the
        # front so they are reused before blocks that still hold a cached prefix.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block key -> block id
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq's table can be grown to cover num_tokens slots."""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq.block_table so it covers num_tokens slots."""
        extra = self.blocks_needed(num_tokens) - len(seq.block_table)
        if extra > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {extra} blocks, {self.num_free_blocks} free")
        for _ in range(extra):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the cached prefix it held
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.reset()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise AssertionError(f"block {block_id} released more often than taken")
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None or self._cached.get(block.block_hash) != block_id:
                block.reset()
                self._free.move_to_end(block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Drop all of seq's blocks (finished, aborted or preempted)."""
        # Release the tail first so the LRU list evicts a sequence's last blocks before its first.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back whole blocks past num_tokens slots (rollback after rejected drafts)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        del seq.block_hashes[keep:]

    # ---- prefix cache -----------------------------------------------------------------------
    def cached_block_hashes(self) -> list[bytes]:
        """Keys of every block whose prefix can be reused now (in use or on the free list).
        Safe to call from another thread: the dict is copied in one step under the GIL."""
        return list(self._cached.copy())

    def match_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Attach cached blocks for seq's leading full blocks. Returns (target, draft) tokens found.

        At least one token is always left uncomputed: the step needs a row to produce logits from.
        Must be called on a sequence that holds no blocks yet.
        """
        assert not seq.block_table, "match_prefix on a sequence that already holds blocks"
        if not self.enable_prefix_caching:
            return 0, 0
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // self.page_size
        self.prefix_queries += len(tokens)
        prev: bytes | None = None
        num_draft_blocks = 0
        draft_contiguous = True
        for i in range(max_blocks):
            chunk = tokens[i * self.page_size : (i + 1) * self.page_size]
            h = chain_hash(prev, chunk)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            draft_contiguous = draft_contiguous and block.draft_valid
            num_draft_blocks += draft_contiguous
            prev = h
        found = len(seq.block_table) * self.page_size
        self.prefix_hits += found
        return found, num_draft_blocks * self.page_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Hash seq's newly full blocks computed by the target; mark draft-valid ones."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.block_table))
        draft_full = seq.num_draft_computed_tokens // self.page_size
        for i in range(len(seq.block_hashes), num_full):
            chunk = tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(prev, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self._cached:
                block.block_hash, block.token_ids = h, chunk
                self._cached[h] = block.block_id
        for i in range(min(draft_full, num_full)):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                block.draft_valid = True

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free):
            self.blocks[block_id].reset()
        self._cached = {h: b for h, b in self._cached.items() if self.blocks[b].ref_count > 0}
