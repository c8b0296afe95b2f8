"""Property tests of the block allocator: no slot handed to two sequences, no block leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_allocator import BlockAllocator, NoFreeBlocksError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

PAGE = 4


def new_seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, f"s{i}", tokens, SamplingParams(), "off")


def check_invariants(alloc: BlockAllocator, live: list[Sequence]) -> None:
    refs = [0] * alloc.num_blocks
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a table holds one block twice"
        for b in s.block_table:
            refs[b] += 1
    for b, block in enumerate(alloc.blocks):
        assert block.ref_count == refs[b]
    # A block owned exclusively (ref 1) and not yet hashed may be written: never shared.
    assert alloc.num_free_blocks == sum(1 for r in refs if r == 0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "compute", "truncate", "free", "preempt"]),
        st.integers(0, 7),
        st.integers(1, 30),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, prefix_caching=st.booleans(), vocab=st.integers(2, 4))
def test_random_operations_keep_invariants_and_return_every_block(ops, prefix_caching, vocab):
    alloc = BlockAllocator(24, PAGE, prefix_caching)
    free0 = alloc.num_free_blocks
    live: list[Sequence] = []
    next_id = 0
    for op, which, n in ops:
        if op == "add":
            # Small vocabularies make identical prefixes (and so cache hits) likely.
            tokens = [(next_id * 7 + j) % vocab if which % 2 else j % vocab for j in range(n)]
            seq = new_seq(next_id, tokens)
            next_id += 1
            cached, _ = alloc.match_prefix(seq)
            assert cached % PAGE == 0 and cached < len(tokens)
            seq.num_computed_tokens = cached
            if alloc.can_allocate(seq, seq.num_tokens):
                alloc.allocate(seq, seq.num_tokens)
                live.append(seq)
            else:
                alloc.free(seq)
        elif live:
            seq = live[which % len(live)]
            if op == "grow":
                want = seq.num_tokens + n
                if alloc.can_allocate(seq, want):
                    alloc.allocate(seq, want)
                    seq.token_ids.extend([(n + j) % vocab for j in range(n)])
                else:
                    with pytest.raises(NoFreeBlocksError):
                        alloc.allocate(seq, want)
            elif op == "compute":
                seq.num_computed_tokens = min(seq.num_tokens - 1, len(seq.block_table) * PAGE)
                seq.num_draft_computed_tokens = seq.num_computed_tokens // 2
                alloc.cache_computed_blocks(seq)
            elif op == "truncate":
                keep = max(seq.num_computed_tokens + 1, seq.num_tokens - n)
                del seq.token_ids[keep:]
                alloc.truncate(seq, seq.num_tokens)
            elif op in ("free", "preempt"):
                alloc.free(seq)
                live.remove(seq)
        check_invariants(alloc, live)
    for seq in live:
        alloc.free(seq)
    check_invariants(alloc, [])
    assert alloc.num_free_blocks == free0


def test_prefix_hit_reuses_blocks_and_evicts_lru_last():
    alloc = BlockAllocator(8, PAGE, True)
    a = new_seq(0, list(range(13)))  # 3 full blocks + 1 token
    alloc.allocate(a, 13)
    a.num_computed_tokens = 12
    a.num_draft_computed_tokens = 8
    alloc.cache_computed_blocks(a)
    blocks_a = list(a.block_table)
    alloc.free(a)
    b = new_seq(1, list(range(12)) + [99])
    cached, draft_cached = alloc.match_prefix(b)
    assert cached == 12 and draft_cached == 8
    assert b.block_table == blocks_a[:3]
    # A sequence that differs inside block 2 hits only blocks 0 and 1.
    c = new_seq(2, list(range(8)) + [50, 51, 52, 53, 54])
    assert alloc.match_prefix(c)[0] == 8
    assert c.block_table == blocks_a[:2]


def test_hash_collision_is_not_served():
    alloc = BlockAllocator(4, PAGE, True)
    a = new_seq(0, [1, 2, 3, 4, 5])
    alloc.allocate(a, 5)
    a.num_computed_tokens = 4
    alloc.cache_computed_blocks(a)
    block = alloc.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a different block that hashed the same
    b = new_seq(1, [1, 2, 3, 4, 5])
    assert alloc.match_prefix(b)[0] == 0


def test_cached_blocks_are_evicted_only_when_needed():
    alloc = BlockAllocator(4, PAGE, True)
    a = new_seq(0, list(range(9)))
    alloc.allocate(a, 9)
    a.num_computed_tokens = 8
    alloc.cache_computed_blocks(a)
    alloc.free(a)
    assert alloc.num_free_blocks == 4
    # One fresh block: comes from the uncached ones first, the cached prefix survives.
    b = new_seq(1, [7])
    alloc.allocate(b, 1)
    c = new_seq(2, list(range(8)) + [1])
    assert alloc.match_prefix(c)[0] == 8
