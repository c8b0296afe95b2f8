"""Property tests of the block allocator: no slot handed to two sequences, no block leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from specdec.engine.block_allocator import BlockAllocator, NoFreeBlocksError
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence

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
    run_ops(ops, prefix_caching, vocab)


def run_ops(ops, prefix_caching: bool, vocab: int) -> None:
    alloc = BlockAllocator(24, PAGE, prefix_caching)
    free0 = alloc.num_free_blocks
    live: list[Sequence] = []
    next_id = 0
    # block id -> the whole prefix (every token up to the block's end) it was computed after
    computed_after: dict[int, tuple[int, ...]] = {}
    for op, which, n in ops:
        if op == "add":
            # Small vocabularies make identical prefixes (and so cache hits) likely.
            tokens = [(next_id * 7 + j) % vocab if which % 2 else j % vocab for j in range(n)]
            seq = new_seq(next_id, tokens)
            next_id += 1
            cached, _ = alloc.match_prefix(seq)
            assert cached % PAGE == 0 and cached < len(tokens)
            # A hit serves only blocks computed after exactly this sequence's prefix.
            for j, b in enumerate(seq.block_table):
                assert computed_after[b] == tuple(tokens[: (j + 1) * PAGE]), "wrong prefix served"
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
                for j, b in enumerate(seq.block_table[: seq.num_computed_tokens // PAGE]):
                    if alloc.blocks[b].block_hash is not None:
                        computed_after[b] = tuple(seq.token_ids[: (j + 1) * PAGE])
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


def test_the_prefix_check_catches_a_key_that_ignores_the_parent(monkeypatch):
    """Negative control for the property above: with a key of the block's own tokens only, a
    block computed after another prefix is served, and the check says so."""
    import specdec.engine.block_allocator as ba

    # Vocabulary 3: sequence 0 is [0 1 2 0 | 2 0 1 2 | 0] once grown by 5 and computed;
    # sequence 1 is [1 2 0 1 | 2 0 1 2 | 0], sequence 2 starts [2 0 1 2 | ...]: the tokens of
    # sequence 0's second block, but with no block before them.
    ops = [("add", 0, 4), ("grow", 0, 5), ("compute", 0, 1), ("add", 1, 9), ("compute", 1, 1)]
    ops.append(("add", 1, 9))
    run_ops(ops, True, 3)
    real = ba.chain_hash
    monkeypatch.setattr(ba, "chain_hash", lambda prev, tokens: real(None, tokens))
    run_ops(ops[:-1], True, 3)
    with pytest.raises(AssertionError, match="wrong prefix served"):
        run_ops(ops, True, 3)


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


# ---- the prefix-cache key names the whole prefix --------------------------------------------
# CPython's tuple hash (xxHash-based, Objects/tupleobject.c) is a bijection of its last lane, so
# a block that makes a tuple hash to any chosen value can be solved for. Python's hash of an int
# is the int modulo 2**61 - 1: two parent hashes that differ by that modulus hash alike, and a
# key of hash((parent, tokens)) cannot tell the two parents apart.
_MASK = (1 << 64) - 1
_XX1, _XX2, _XX5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_MOD61 = (1 << 61) - 1


def _rotr31(x: int) -> int:
    return ((x >> 31) | (x << 33)) & _MASK


def _acc(lanes: list[int]) -> int:
    acc = _XX5
    for lane in lanes:
        acc = (acc + (lane & _MASK) * _XX2) & _MASK
        acc = (((acc << 31) | (acc >> 33)) & _MASK) * _XX1 & _MASK
    return acc


def _last_lane_for(lanes: list[int], want: int) -> int:
    """The hash the last item of a tuple of len(lanes) + 1 items must have for it to hash to
    ``want``, given its other items' hashes."""
    n = len(lanes) + 1
    acc = (want - (n ^ (_XX5 ^ 3527539))) & _MASK
    acc = _rotr31(acc * pow(_XX1, -1, 1 << 64) & _MASK)
    return (acc - _acc(lanes)) * pow(_XX2, -1, 1 << 64) & _MASK


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def colliding_first_blocks(page: int) -> tuple[list[int], list[int]]:
    """Two different first blocks whose keys under the old scheme, hash((None, tokens)), differ
    by 2**61 - 1: every block after them with the same tokens then gets the same old key."""
    a = list(range(1, page + 1))
    h_a = hash((None, tuple(a)))
    for other in range(1000, 2000):
        for want in (h_a + _MOD61, h_a - _MOD61):
            # An int hashes to its residue with its own sign: only a key of h_a's sign collides.
            if not -(1 << 63) <= want < 1 << 63 or (want < 0) != (h_a < 0):
                continue
            inner = _signed(_last_lane_for([hash(None)], want & _MASK))
            head = [other] + list(range(2, page))
            last = _signed(_last_lane_for([hash(t) for t in head], inner & _MASK))
            if 0 <= last < _MOD61:  # an int hashes to itself below the modulus
                b = head + [last]
                assert hash((None, tuple(b))) == want
                return a, b
    raise AssertionError("no colliding block found")


def test_a_prefix_hit_never_serves_a_block_computed_after_a_different_parent():
    a_first, b_first = colliding_first_blocks(PAGE)
    second = [7, 7, 7, 7]
    # The old key collides on the second block although the first blocks differ.
    old_a, old_b = hash((None, tuple(a_first))), hash((None, tuple(b_first)))
    assert old_a != old_b
    assert hash((old_a, tuple(second))) == hash((old_b, tuple(second)))

    alloc = BlockAllocator(8, PAGE, True)
    a = new_seq(0, a_first + second + [1])
    c = new_seq(1, b_first + [5, 5, 5, 5, 1])  # caches b's first block, not its second
    for s in (a, c):
        alloc.allocate(s, s.num_tokens)
        s.num_computed_tokens = 2 * PAGE
        alloc.cache_computed_blocks(s)
    b = new_seq(2, b_first + second + [1])
    cached, _ = alloc.match_prefix(b)
    # b may reuse c's first block (same tokens, same position); a's second block holds K/V
    # computed after a's first block, so serving it to b would be wrong.
    assert b.block_table[:1] == c.block_table[:1]
    assert a.block_table[1] not in b.block_table
    assert cached == PAGE
    for s in (a, b, c):
        alloc.free(s)
    assert alloc.num_free_blocks == 8
