"""Token-tree forwards: the attention contract's tree mask (torch backend, FlashInfer's custom-mask
layout), explicit positions in `RunEntry`, and moving an accepted path's KV into place.

A tree's nodes run after the sequence's committed context in breadth-first order: node j's KV
goes to slot position ``context + j``, its rotary position is ``context + depth(j)``, and it sees
the context plus its own ancestors. The oracle everywhere is the node's root path run as an
ordinary chain after the same context.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from specdec.engine.attention import create_backend
from specdec.engine.attention.base import (
    build_attention_metadata,
    sequence_mask,
    slots_for_positions,
    tree_mask_from_parents,
)
from specdec.engine.attention.flashinfer_backend import (
    build_flashinfer_custom_mask,
    build_flashinfer_indices,
)
from specdec.engine.attention.torch_backend import TorchAttentionBackend
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.cuda_graphs import graph_bucket
from specdec.engine.kv_cache import ModelKV, allocate_model_kv, copy_kv_slots
from specdec.engine.model_runner import ModelRunner, RunEntry
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence
from tiny_models import loaded_from_hf, tiny_hf_model

CPU = torch.device("cpu")
PAGE = 4
NUM_BLOCKS = 48

# A tree of 8 nodes in breadth-first order: node 0 is the root (the sequence's next input token),
# parents[j] < j. Depths 0, 1, 1, 2, 2, 2, 3, 3.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]
TREE_TOKENS = [11, 23, 37, 41, 5, 60, 72, 9]


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def root_path(parents: list[int], j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


# ---------------------------------------------------------------- fixtures
class Pair:
    """A model (fp32, torch backend) with its own KV pool, block ids shared through `alloc`."""

    def __init__(self, hf, alloc: BlockAllocator) -> None:
        lm = loaded_from_hf(hf)
        arch = lm.arch
        self.kv = allocate_model_kv(arch, NUM_BLOCKS, PAGE, torch.float32, CPU)
        backend = create_backend(
            "torch", arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, CPU
        )
        self.runner = ModelRunner(lm.model, self.kv, backend, PAGE)


@pytest.fixture(scope="module")
def models():
    return tiny_hf_model("qwen2", seed=3), tiny_hf_model("llama", seed=4, layers=3, kv_heads=1)


@pytest.fixture
def alloc():
    allocator = BlockAllocator(NUM_BLOCKS, PAGE, enable_prefix_caching=False)
    start = allocator.num_free_blocks
    yield allocator
    assert allocator.num_free_blocks == start  # every test frees what it took


def new_seq(alloc: BlockAllocator, seq_id: int, tokens: list[int], capacity: int) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams(), "off")
    alloc.allocate(seq, capacity)
    return seq


def chain_logits(runner: ModelRunner, alloc: BlockAllocator, tokens: list[int]) -> torch.Tensor:
    """Logits of every row when `tokens` run as one ordinary chunk on a fresh sequence."""
    seq = new_seq(alloc, 900, tokens, len(tokens))
    try:
        return runner.run([RunEntry(seq, tokens, 0, len(tokens))])
    finally:
        alloc.free(seq)


def tree_entry(seq: Sequence, context: int) -> RunEntry:
    return RunEntry(
        seq,
        TREE_TOKENS,
        context,
        len(TREE_TOKENS),
        positions=[context + d for d in depths(PARENTS)],
        tree_mask=tree_mask_from_parents(PARENTS),
    )


# ---------------------------------------------------------------- model-level tests
def test_tree_nodes_match_their_root_paths_in_a_mixed_batch(models, alloc) -> None:
    pair = Pair(models[0], alloc)
    runner = pair.runner
    prompt_a = [3, 8, 15, 2, 9, 30]  # tree after 6 committed tokens: nodes cross a page
    prompt_b = [4, 4, 7, 19, 1]  # plain decode after 5
    prompt_c = [6, 13, 21, 34, 55, 89, 14, 2, 77]  # a prompt whose second chunk joins the batch
    a = new_seq(alloc, 0, prompt_a, len(prompt_a) + len(TREE_TOKENS))
    b = new_seq(alloc, 1, prompt_b, len(prompt_b) + 1)
    c = new_seq(alloc, 2, prompt_c, len(prompt_c))
    try:
        runner.run([RunEntry(a, prompt_a, 0, 1), RunEntry(b, prompt_b, 0, 1)])
        runner.run([RunEntry(c, prompt_c[:4], 0, 1)])
        mixed = [
            RunEntry(b, [50], len(prompt_b), 1),
            tree_entry(a, len(prompt_a)),
            RunEntry(c, prompt_c[4:], 4, 2),
        ]
        logits = runner.run(mixed)
        assert logits.shape[0] == 1 + len(TREE_TOKENS) + 2
        tree_rows = logits[1 : 1 + len(TREE_TOKENS)]
        for j in range(len(TREE_TOKENS)):
            path = [TREE_TOKENS[i] for i in root_path(PARENTS, j)]
            want = chain_logits(runner, alloc, prompt_a + path)[-1]
            torch.testing.assert_close(tree_rows[j], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            logits[0], chain_logits(runner, alloc, prompt_b + [50])[-1], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            logits[-2:], chain_logits(runner, alloc, prompt_c)[-2:], rtol=1e-5, atol=1e-5
        )
        # Negative control: the same nodes run as a plain causal chunk see their siblings and
        # get other logits, so the comparison above depends on the mask and the positions.
        causal = runner.run([RunEntry(a, TREE_TOKENS, len(prompt_a), len(TREE_TOKENS))])
        assert not torch.allclose(causal[2:], tree_rows[2:], rtol=1e-3, atol=1e-3)
    finally:
        for s in (a, b, c):
            alloc.free(s)


def test_no_tree_keeps_todays_path_bit_for_bit(models, alloc) -> None:
    """Entries without positions or masks, or with consecutive positions and the causal mask,
    build metadata without tree masks and give the same logits, bit for bit, as the model called
    the way the runner called it before trees existed."""
    pair = Pair(models[0], alloc)
    prompt = [3, 8, 15, 2, 9, 30, 4]
    seq = new_seq(alloc, 0, prompt, len(prompt) + 3)
    try:
        pair.runner.run([RunEntry(seq, prompt, 0, 1)])
        snapshot = [(k.clone(), v.clone()) for k, v in pair.kv.layers]
        start, toks = len(prompt), [5, 6, 7]
        plain = pair.runner.run([RunEntry(seq, toks, start, 3)])
        for (k, v), (k0, v0) in zip(pair.kv.layers, snapshot, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        explicit = pair.runner.run(
            [
                RunEntry(
                    seq,
                    toks,
                    start,
                    3,
                    positions=list(range(start, start + 3)),
                    tree_mask=torch.ones(3, 3, dtype=torch.bool).tril(),
                )
            ]
        )
        meta = build_attention_metadata([3], [start + 3], [seq.block_table], PAGE, CPU)
        assert meta.tree_masks is None
        before = pair.runner.model(
            torch.tensor(toks),
            torch.arange(start, start + 3),
            pair.kv.layers,
            pair.runner.backend,
            meta,
            torch.arange(3),
        )
        assert torch.equal(plain, explicit) and torch.equal(plain, before)
    finally:
        alloc.free(seq)


def test_accepted_path_moved_into_place_continues_like_a_chain(models, alloc) -> None:
    """Target and draft (different shapes, one block table): after the tree forward, copy the
    accepted path's KV to context + depth; the next ordinary decode equals the chain's."""
    pairs = [Pair(hf, alloc) for hf in models]
    prompt = [3, 8, 15, 2, 9, 30]
    context = len(prompt)
    seq = new_seq(alloc, 0, prompt, context + len(TREE_TOKENS))
    accepted = root_path(PARENTS, 7)  # [0, 2, 5, 7]: destinations overlap later sources
    assert accepted == [0, 2, 5, 7]
    path_tokens = [TREE_TOKENS[j] for j in accepted]
    src = slots_for_positions(seq.block_table, [context + j for j in accepted], PAGE)
    dst = slots_for_positions(seq.block_table, [context + d for d in range(len(accepted))], PAGE)
    try:
        for pair in pairs:
            pair.runner.run([RunEntry(seq, prompt, 0, 1)])
            pair.runner.run([tree_entry(seq, context)])
            copy_kv_slots(pair.kv, src, dst)
        # The scratch slots past the accepted path are simply overwritten by the next step.
        alloc.truncate(seq, context + len(accepted) + 1)
        for pair in pairs:
            nxt = pair.runner.run([RunEntry(seq, [42], context + len(accepted), 1)])
            want = chain_logits(pair.runner, alloc, prompt + path_tokens + [42])[-1]
            torch.testing.assert_close(nxt[0], want, rtol=1e-5, atol=1e-5)
    finally:
        alloc.free(seq)


def test_tree_entries_never_replay_graphs() -> None:
    captured = [(b, q) for b in (1, 2, 4) for q in (1, 3, 8)]
    seq = SimpleNamespace(block_table=list(range(8)))
    plain = [RunEntry(seq, [1] * 8, 4, 8)]
    tree = [tree_entry(seq, 4)]
    positions_only = [RunEntry(seq, [1, 2, 3], 4, 3, positions=[4, 5, 5])]
    assert graph_bucket(plain, captured, 64) == 1
    assert graph_bucket(tree, captured, 64) is None
    assert graph_bucket(positions_only, captured, 64) is None
    assert graph_bucket(plain + tree, captured, 64) is None


def test_a_tree_grown_level_by_level_sees_only_its_ancestors(models, alloc) -> None:
    """Each level's forward runs that level's nodes with a mask over every node written so far
    (``[q_len, m]``, m > q_len): the logits equal the one-pass tree forward's, as a draft that
    grows a tree level by level needs."""
    runner = Pair(models[0], alloc).runner
    prompt = [3, 8, 15, 2, 9, 30]
    full = tree_mask_from_parents(PARENTS)
    levels = depths(PARENTS)
    one = new_seq(alloc, 0, prompt, len(prompt) + len(TREE_TOKENS))
    grown = new_seq(alloc, 1, prompt, len(prompt) + len(TREE_TOKENS))
    try:
        runner.run([RunEntry(one, prompt, 0, 1), RunEntry(grown, prompt, 0, 1)])
        expected = runner.run([tree_entry(one, len(prompt))])
        rows = []
        for level in range(max(levels) + 1):
            nodes = [j for j, d in enumerate(levels) if d == level]
            first, written = nodes[0], nodes[-1] + 1
            entry = RunEntry(
                grown,
                [TREE_TOKENS[j] for j in nodes],
                len(prompt) + first,
                len(nodes),
                positions=[len(prompt) + level] * len(nodes),
                tree_mask=full[first:written, :written],
            )
            rows.append(runner.run([entry]))
        torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-4, atol=1e-4)
    finally:
        alloc.free(one)
        alloc.free(grown)


# ---------------------------------------------------------------- bad input
def test_bad_tree_input_raises_clear_errors() -> None:
    seq = SimpleNamespace(block_table=[0, 1, 2, 3])
    ok = tree_mask_from_parents(PARENTS[:4])

    def meta(mask, q: int = 4):
        return build_attention_metadata([q], [q + 5], [seq.block_table], PAGE, CPU, [mask])

    with pytest.raises(ValueError, match=r"must be \[4, m\] with 4 <= m <= 9 .*got \[4, 3\]"):
        meta(ok[:, :3])
    with pytest.raises(ValueError, match=r"got \[4, 10\]"):  # more keys than the sequence has
        meta(torch.ones(4, 10, dtype=torch.bool).tril(6))
    with pytest.raises(ValueError, match="bool"):
        meta(ok.float())
    blind = ok.clone()
    blind[2, 2] = False
    with pytest.raises(ValueError, match="sequence 0: tree mask row 2 does not see itself"):
        meta(blind)
    peeking = ok.clone()
    peeking[1, 3] = True
    with pytest.raises(ValueError, match="row 1 sees the later key 3"):
        meta(peeking)
    with pytest.raises(ValueError, match="2 tree masks for 1 sequences"):
        build_attention_metadata([4], [9], [seq.block_table], PAGE, CPU, [ok, None])
    with pytest.raises(ValueError, match="3 positions for 4 tokens"):
        RunEntry(seq, [1, 2, 3, 4], 5, 4, positions=[5, 6, 6])
    with pytest.raises(ValueError, match=">= 0"):
        RunEntry(seq, [1], 0, 1, positions=[-1])


def test_runner_refuses_a_bad_tree_before_touching_kv(models, alloc) -> None:
    pair = Pair(models[0], alloc)
    seq = new_seq(alloc, 0, [1, 2, 3], 3 + len(TREE_TOKENS))
    try:
        before = [(k.clone(), v.clone()) for k, v in pair.kv.layers]
        bad = tree_entry(seq, 3)
        bad.tree_mask = (
            tree_mask_from_parents(PARENTS).t().contiguous()
        )  # every node sees its subtree
        with pytest.raises(ValueError, match="sequence 1: tree mask row 0 sees the later key 1"):
            pair.runner.run([RunEntry(seq, [1, 2, 3], 0, 1), bad])
        for (k, v), (k0, v0) in zip(pair.kv.layers, before, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    finally:
        alloc.free(seq)


def test_tree_mask_from_parents() -> None:
    mask = tree_mask_from_parents(PARENTS)
    for j in range(len(PARENTS)):
        assert mask[j].nonzero().flatten().tolist() == root_path(PARENTS, j)
    assert torch.equal(
        tree_mask_from_parents([-1, 0, 1]), torch.ones(3, 3, dtype=torch.bool).tril()
    )
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        tree_mask_from_parents([-1, 0, 2])
    with pytest.raises(ValueError, match="node 1 has parent -2"):
        tree_mask_from_parents([-1, -2])


def test_copy_kv_slots_overlap_and_bad_input() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(3, 4, 2, 5, generator=gen), torch.randn(3, 4, 2, 5, generator=gen))]
    kv = ModelKV(layers)
    before = [(k.clone(), v.clone()) for k, v in layers]

    def slot(t: torch.Tensor, s: int) -> torch.Tensor:
        return t.view(-1, 2, 5)[s]

    # In-order path move: depth d takes BFS index j >= d; slot 5 is both a destination and the
    # source of a later entry, slot 2 is left as it is.
    copy_kv_slots(kv, [2, 5, 9], [2, 3, 5])
    for (k, v), (k0, v0) in zip(layers, before, strict=True):
        for t, t0 in ((k, k0), (v, v0)):
            for s, d in ((2, 2), (5, 3), (9, 5)):
                assert torch.equal(slot(t, d), slot(t0, s))
            assert torch.equal(slot(t, 9), slot(t0, 9)) and torch.equal(slot(t, 4), slot(t0, 4))
    # Sources are read before any write, so even a swap is safe.
    mid = [(k.clone(), v.clone()) for k, v in layers]
    copy_kv_slots(kv, [0, 1], [1, 0])
    assert torch.equal(slot(layers[0][0], 0), slot(mid[0][0], 1))
    assert torch.equal(slot(layers[0][1], 1), slot(mid[0][1], 0))
    state = [(k.clone(), v.clone()) for k, v in layers]
    for src, dst, match in (
        ([1, 2], [3], "2 source slots for 1 destinations"),
        ([1, 2], [3, 3], "distinct"),
        ([1, 12], [3, 4], r"slots \[12\] are outside the pool of 12 slots"),
        ([-1], [4], "outside"),
    ):
        with pytest.raises(ValueError, match=match):
            copy_kv_slots(kv, src, dst)
    for (k, v), (k0, v0) in zip(layers, state, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # nothing changed


# ---------------------------------------------------------------- attention level, both layouts
TREE_BATCH = dict(  # a prompt chunk, a decode, a tree, a verify chain, a one-node "tree"
    q_lens=[7, 1, 8, 3, 1],
    kv_lens=[7, 12, 14, 21, 5],
    tree_masks=[
        None,
        None,
        tree_mask_from_parents(PARENTS),
        None,
        torch.ones(1, 1, dtype=torch.bool),
    ],
)


def random_pool(kv_lens: list[int], page: int, seed: int, head_dim: int = 8):
    need = [-(-kv // page) + 1 for kv in kv_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    gen = torch.Generator().manual_seed(seed + 1)
    k_pool = torch.randn(len(perm), page, 2, head_dim, generator=gen)
    v_pool = torch.randn(len(perm), page, 2, head_dim, generator=gen)
    t = sum(TREE_BATCH["q_lens"])
    q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (4, 2, 2))
    return tables, k_pool, v_pool, q, k, v


def packed_segments(flat: torch.Tensor, q_lens, kv_lens) -> tuple[list[int], list[int]]:
    """FlashInfer's packing of the flattened mask: per sequence, bits in "little" order padded to
    whole bytes; returns (bytes, byte offset of each sequence)."""
    out: list[int] = []
    offsets, at = [], 0
    for q, kv in zip(q_lens, kv_lens, strict=True):
        bits = flat[at : at + q * kv].tolist()
        at += q * kv
        offsets.append(len(out))
        for b in range(0, len(bits), 8):
            out.append(sum(int(x) << i for i, x in enumerate(bits[b : b + 8])))
    assert at == flat.numel()
    return out, offsets


def test_flashinfer_custom_mask_layout_matches_the_torch_backend() -> None:
    """The flattened mask, read the way FlashInfer's kernel reads it (byte offset of the
    sequence, bit r * kv_len + c), gives the torch backend's output when attention is recomputed
    from FlashInfer's index arrays and that mask alone (float64)."""
    q_lens, kv_lens = TREE_BATCH["q_lens"], TREE_BATCH["kv_lens"]
    tables, k_pool, v_pool, q, k, v = random_pool(kv_lens, PAGE, seed=7)
    meta = build_attention_metadata(q_lens, kv_lens, tables, PAGE, CPU, TREE_BATCH["tree_masks"])
    assert meta.tree_masks is not None and meta.tree_mask(4) is None  # 1x1 is causal: dropped
    flat = build_flashinfer_custom_mask(meta)
    assert flat is not None and flat.dtype == torch.bool
    assert flat.numel() == sum(a * b for a, b in zip(q_lens, kv_lens, strict=True))
    packed, offsets = packed_segments(flat, q_lens, kv_lens)
    ref = TorchAttentionBackend(4, 2, 8, CPU)
    ref.plan(meta)
    got = ref.forward(q, k, v, k_pool, v_pool, meta)  # writes the new rows' k/v first

    ix = build_flashinfer_indices(meta)
    qo, kvp, pages = (
        ix["qo_indptr"].tolist(),
        ix["paged_kv_indptr"].tolist(),
        ix["paged_kv_indices"],
    )
    want = torch.empty(q.shape, dtype=torch.float64)
    for i, (ql, kvl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        own = pages[kvp[i] : kvp[i + 1]].tolist()
        keys = k_pool[own].flatten(0, 1)[:kvl].double().repeat_interleave(2, 1)
        values = v_pool[own].flatten(0, 1)[:kvl].double().repeat_interleave(2, 1)
        allowed = torch.tensor(
            [
                [
                    (packed[offsets[i] + (r * kvl + c) // 8] >> ((r * kvl + c) % 8)) & 1
                    for c in range(kvl)
                ]
                for r in range(ql)
            ],
            dtype=torch.bool,
        )
        assert torch.equal(allowed, sequence_mask(ql, kvl, meta.tree_mask(i)))
        scores = torch.einsum("qhd,khd->hqk", q[qo[i] : qo[i + 1]].double(), keys) * ref.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        want[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # The tree's rows really differ from what a causal mask gives them.
    causal = build_attention_metadata(q_lens, kv_lens, tables, PAGE, CPU)
    assert build_flashinfer_custom_mask(causal) is None
    ref.plan(causal)
    assert not torch.allclose(ref.forward(q, k, v, k_pool, v_pool, causal)[8:16], got[8:16])


class _FakeWrapper:
    """Records FlashInfer wrapper construction and plan calls (the kernels need CUDA)."""

    def __init__(self, workspace, layout, backend="auto", use_cuda_graph=False, **kwargs) -> None:
        self.backend = backend
        self.is_cuda_graph_enabled = use_cuda_graph
        self.plans: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs) -> None:
        self.plans.append((args, kwargs))


class _FakeDecode(_FakeWrapper):
    pass


class _FakeEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def routing_backend(monkeypatch):
    """A FlashInfer backend wired to recording wrappers, so its routing runs on the CPU."""
    from specdec.engine.attention.base import AttentionBackend
    from specdec.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    fake = SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
        BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
    )
    backend = object.__new__(FlashInferAttentionBackend)
    AttentionBackend.__init__(backend, 4, 2, 8, CPU)
    backend._flashinfer = fake
    backend.prefill_kernel = "auto"
    backend.workspace = torch.zeros(1, dtype=torch.uint8)
    backend._prefill = _FakeWrapper(backend.workspace, "NHD", backend="auto")
    backend._decode = _FakeDecode(backend.workspace, "NHD")
    backend._tree_prefill = None
    backend.dtype = torch.bfloat16
    backend.kv_dtype = None
    backend._planned = {}
    return backend


def test_flashinfer_routes_only_tree_batches_to_an_fa2_custom_mask_plan(routing_backend) -> None:
    fi = routing_backend
    q_lens, kv_lens = TREE_BATCH["q_lens"], TREE_BATCH["kv_lens"]
    tables = random_pool(kv_lens, PAGE, seed=3)[0]
    plain = build_attention_metadata(q_lens, kv_lens, tables, PAGE, CPU)
    fi.plan(plain)
    ((args, kwargs),) = fi._prefill.plans
    assert plain.plan.wrapper is fi._prefill and fi._tree_prefill is None
    assert kwargs["causal"] is True and "custom_mask" not in kwargs

    tree = build_attention_metadata(q_lens, kv_lens, tables, PAGE, CPU, TREE_BATCH["tree_masks"])
    fi.plan(tree)
    wrapper = tree.plan.wrapper
    assert wrapper is fi._tree_prefill and wrapper is not fi._prefill
    assert wrapper.backend == "fa2" and not wrapper.is_cuda_graph_enabled
    ((args, kwargs),) = wrapper.plans
    assert torch.equal(kwargs["custom_mask"], build_flashinfer_custom_mask(tree))
    assert kwargs["causal"] is False
    ix = build_flashinfer_indices(tree)
    for at, name in ((0, "qo_indptr"), (1, "paged_kv_indptr"), (3, "paged_kv_last_page_len")):
        assert torch.equal(args[at].cpu(), ix[name])
    assert kwargs["q_data_type"] == torch.bfloat16 and kwargs["sm_scale"] == fi.scale

    fi.plan(plain)  # back to the causal wrapper; the tree wrapper is kept for the next tree
    assert plain.plan.wrapper is fi._prefill and len(fi._prefill.plans) == 2
    decodes = build_attention_metadata(
        [1, 1], [5, 9], tables[:2], PAGE, CPU, [torch.ones(1, 1, dtype=torch.bool), None]
    )
    fi.plan(decodes)  # one-node trees are causal: the decode wrapper still serves them
    assert decodes.plan.wrapper is fi._decode
    graph = _FakeWrapper(fi.workspace, "NHD", backend="fa2", use_cuda_graph=True)
    for refused in (fi._decode, graph):
        with pytest.raises(ValueError, match="eager prefill wrapper only"):
            fi.plan_wrapper(tree.plan, refused, torch.bfloat16)


def test_flashinfer_plans_fp8_pages_as_their_own_kv_type(routing_backend) -> None:
    """--kv-cache-dtype fp8: q stays in the model dtype, the pages are planned as float8."""
    fi = routing_backend
    fi.kv_dtype = torch.float8_e4m3fn
    tables = random_pool([5, 9], PAGE, seed=4)[0]
    fi.plan(build_attention_metadata([1, 1], [5, 9], tables, PAGE, CPU))
    ((_, kwargs),) = fi._decode.plans
    assert kwargs["q_data_type"] == torch.bfloat16
    assert kwargs["kv_data_type"] == torch.float8_e4m3fn


# ---------------------------------------------------------------- real FlashInfer (CUDA only)
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_tree_batch_matches_torch_backend(head_dim: int) -> None:
    pytest.importorskip("flashinfer")
    from specdec.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    dev, dtype, page = torch.device("cuda"), torch.bfloat16, 16
    q_lens, kv_lens = TREE_BATCH["q_lens"], [37, 70, 21, 32, 9]
    kv_lens = [max(kv, q) for kv, q in zip(kv_lens, q_lens, strict=True)]
    tables, k_pool, v_pool, q, k, v = random_pool(kv_lens, page, seed=2, head_dim=head_dim)
    q, k, v = (t.to(dev, dtype) for t in (q, k, v))
    fi = FlashInferAttentionBackend(4, 2, head_dim, dev)
    outs, metas = [], []
    for backend in (fi, TorchAttentionBackend(4, 2, head_dim, dev)):
        meta = build_attention_metadata(
            q_lens, kv_lens, tables, page, dev, TREE_BATCH["tree_masks"]
        )
        backend.plan(meta)
        kc, vc = k_pool.to(dev, dtype), v_pool.to(dev, dtype)
        outs.append(backend.forward(q, k, v, kc, vc, meta).float())
        metas.append(meta)
    err = (outs[0] - outs[1]).norm() / outs[1].norm()
    assert err < 1e-2
    # The tree went through the FA2 custom-mask wrapper, not the causal prefill wrapper;
    # a batch without a tree goes back to the causal wrapper.
    step = metas[0].plan
    assert step.custom_mask is not None and step.wrapper is fi._tree_prefill
    assert fi._tree_prefill is not fi._prefill
    plain = build_attention_metadata(q_lens, kv_lens, tables, page, dev)
    fi.plan(plain)
    fi.forward(q, k, v, k_pool.to(dev, dtype), v_pool.to(dev, dtype), plain)
    assert plain.plan.wrapper is fi._prefill and plain.plan.custom_mask is None


@pytest.mark.parametrize("seed", range(12))
def test_tree_rows_are_bitwise_the_decode_of_their_path_in_bf16(seed: int) -> None:
    """The torch backend computes each tree row as plain decode computes that position (its
    visible keys as one contiguous run): bit for bit, where a masked call over the tree's
    scattered slots rounds differently in bf16 after a long context."""
    heads, kv_heads, dim, page = 4, 2, 64, 16
    backend = TorchAttentionBackend(heads, kv_heads, dim, CPU)
    context, parents = 700, PARENTS
    n = len(parents)
    g = torch.Generator().manual_seed(seed)
    pool = 2 * (-(-(context + n) // page))

    def rand(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    k_cache, v_cache = rand(pool, page, kv_heads, dim), rand(pool, page, kv_heads, dim)
    tree_table = list(range(pool // 2))
    q = rand(n, heads, dim)
    k_new, v_new = rand(n, kv_heads, dim), rand(n, kv_heads, dim)
    meta = build_attention_metadata(
        [n], [context + n], [tree_table], page, CPU, [tree_mask_from_parents(parents)]
    )
    backend.plan(meta)
    tree_out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta)
    # Each node again as a decode: its path's keys copied in order after the same context.
    path_table = list(range(pool // 2, pool))
    flat_k = k_cache.view(-1, kv_heads, dim)
    flat_v = v_cache.view(-1, kv_heads, dim)
    src = slots_for_positions(tree_table, range(context), page)
    dst = slots_for_positions(path_table, range(context), page)
    flat_k[dst], flat_v[dst] = flat_k[src], flat_v[src]
    for j in range(n):
        path = root_path(parents, j)
        if len(path) > 1:
            anc = slots_for_positions(tree_table, [context + a for a in path[:-1]], page)
            into = slots_for_positions(path_table, range(context, context + len(path) - 1), page)
            flat_k[into], flat_v[into] = flat_k[anc], flat_v[anc]
        kv_len = context + len(path)
        decode = build_attention_metadata([1], [kv_len], [path_table], page, CPU)
        backend.plan(decode)
        row = backend.forward(
            q[j : j + 1], k_new[j : j + 1], v_new[j : j + 1], k_cache, v_cache, decode
        )
        assert torch.equal(row[0], tree_out[j]), j


def _verify_and_decodes(dtype: torch.dtype, context: int, q_len: int, seed: int = 0):
    """A verify of ``q_len`` rows after ``context`` keys, and each of its rows again as the plain
    decode of its position (the same pool and pages): (verify rows, decode rows)."""
    heads, kv_heads, dim, page = 14, 2, 64, 16  # the default draft's GQA group of 7
    backend = TorchAttentionBackend(heads, kv_heads, dim, CPU)
    g = torch.Generator().manual_seed(seed)
    pool = -(-(context + q_len) // page)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_cache, v_cache = rand(pool, page, kv_heads, dim), rand(pool, page, kv_heads, dim)
    table = list(range(pool))
    q, k_new, v_new = (
        rand(q_len, heads, dim),
        rand(q_len, kv_heads, dim),
        rand(q_len, kv_heads, dim),
    )
    meta = build_attention_metadata([q_len], [context + q_len], [table], page, CPU)
    backend.plan(meta)
    verify = backend.forward(q, k_new, v_new, k_cache, v_cache, meta)
    decodes = []
    for r in range(q_len):
        one = build_attention_metadata([1], [context + r + 1], [table], page, CPU)
        backend.plan(one)
        rows = slice(r, r + 1)
        decodes.append(backend.forward(q[rows], k_new[rows], v_new[rows], k_cache, v_cache, one))
    return verify, torch.cat(decodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [1, 40, 495, 509, 700])
def test_verify_rows_are_bitwise_the_decode_of_their_position(dtype, context) -> None:
    """Greedy speculative output equals plain output only if a verified row's logits are plain
    decode's bit for bit: each row is computed over exactly its own keys."""
    for q_len in (2, 7, 17):
        verify, decodes = _verify_and_decodes(dtype, context, q_len)
        assert torch.equal(verify, decodes), (q_len, context)


def test_one_masked_call_for_a_verify_would_round_differently(monkeypatch) -> None:
    # The negative control: over more keys than a row sees (masked), the sums are blocked
    # differently and the last bits move, which is why verify rows go one by one.
    monkeypatch.setattr("specdec.engine.attention.torch_backend.ROW_BY_ROW_MAX", 1)
    differs = [
        not torch.equal(*_verify_and_decodes(dtype, context, 7))
        for dtype in (torch.float32, torch.bfloat16)
        for context in (1, 40, 495, 700)
    ]
    assert any(differs)
