"""The GPU path's CPU-checkable parts: FlashInfer index arrays, backend selection and fallback,
graph-batch padding, and the batched sampling path's semantics; FlashInfer parity when CUDA is there.

The index arrays are checked three ways against the torch reference backend's own plan for the
same metadata: page lists, slot positions of the new rows, and a paged attention computed from the
arrays alone (FlashInfer's documented semantics, in float64) against the reference's output.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from specdec.engine.attention import create_backend, selection
from specdec.engine.attention.base import build_attention_metadata
from specdec.engine.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    build_flashinfer_indices,
)
from specdec.engine.attention.torch_backend import TorchAttentionBackend
from specdec.engine.cuda_graphs import batch_buckets, graph_bucket, pad_graph_batch
from specdec.engine.errors import ConfigError
from specdec.engine.gpu_sampling import (
    TorchKernels,
    flashinfer_sampling_kernels,
    probs_for_rows,
    sample_from_probs,
    verify_drafts,
    warp_probs,
)
from specdec.engine.sampling import RowContext, compute_probs
from specdec.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
# (page_size, q_lens, kv_lens): prompt chunks (first and mid-prompt), decodes, k+1-row verifies,
# keys ending exactly on a page boundary or one past it, page size 1.
CASES = [
    (4, [5, 1, 3, 1], [5, 9, 12, 4]),
    (16, [1, 1, 1, 1], [1, 16, 17, 33]),
    (1, [2, 1], [3, 1]),
    (16, [37, 1, 5, 16], [37, 70, 21, 32]),
    (8, [9, 3, 1, 20, 5], [9, 40, 8, 60, 16]),
]


def random_tables(kv_lens: list[int], page_size: int, seed: int, spare: int = 2) -> list[list[int]]:
    """Scattered block ids, each table `spare` pages longer than its keys need."""
    need = [-(-kv // page_size) + spare for kv in kv_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    return tables


def attend_from_indices(q, k_cache, v_cache, ix, page_size: int, scale: float) -> torch.Tensor:
    """Paged attention from FlashInfer's arrays alone, bottom-right causal, float64."""
    heads, hkv = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    qo, kvp, pages, last = (
        ix["qo_indptr"].tolist(),
        ix["paged_kv_indptr"].tolist(),
        ix["paged_kv_indices"].tolist(),
        ix["paged_kv_last_page_len"].tolist(),
    )
    for i in range(len(qo) - 1):
        own = pages[kvp[i] : kvp[i + 1]]
        kv_len = (len(own) - 1) * page_size + last[i]
        keys = k_cache[own].flatten(0, 1)[:kv_len].double().repeat_interleave(heads // hkv, 1)
        values = v_cache[own].flatten(0, 1)[:kv_len].double().repeat_interleave(heads // hkv, 1)
        qs = q[qo[i] : qo[i + 1]].double()  # [q_len, H, D]
        q_len = qs.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        allowed = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def check_indices(page_size: int, q_lens: list[int], kv_lens: list[int], seed: int) -> None:
    tables = random_tables(kv_lens, page_size, seed)
    meta = build_attention_metadata(q_lens, kv_lens, tables, page_size, CPU)
    ix = build_flashinfer_indices(meta)
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert ix[name].dtype == torch.int32 and ix[name].device.type == "cpu", name
    assert ix["is_pure_decode"] == all(q == 1 for q in q_lens)
    assert torch.equal(ix["qo_indptr"], meta.qo_indptr)
    ref = TorchAttentionBackend(4, 2, 8, CPU)
    ref.plan(meta)
    kvp, last = ix["paged_kv_indptr"].tolist(), ix["paged_kv_last_page_len"].tolist()
    slots = []
    for i, sp in enumerate(meta.plan.seqs):
        assert ix["qo_indptr"][i] == sp.q_start
        pages = ix["paged_kv_indices"][kvp[i] : kvp[i + 1]].tolist()
        assert pages == sp.pages.tolist()
        assert 1 <= last[i] <= page_size
        assert (len(pages) - 1) * page_size + last[i] == sp.kv_len == kv_lens[i]
        for pos in range(kv_lens[i] - q_lens[i], kv_lens[i]):  # where the new rows' keys go
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    assert slots == meta.slot_mapping.tolist()
    # The arrays carry everything attention needs: recompute it from them alone.
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(max(t) for t in tables) + 1
    k_cache = torch.randn(num_blocks, page_size, 2, 8, generator=gen)
    v_cache = torch.randn(num_blocks, page_size, 2, 8, generator=gen)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, 8, generator=gen) for h in (4, 2, 2))
    got = ref.forward(q, k, v, k_cache, v_cache, meta)  # writes k/v into the pool first
    want = attend_from_indices(q, k_cache, v_cache, ix, page_size, ref.scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("page_size", "q_lens", "kv_lens"), CASES)
def test_indices_match_torch_backend(page_size, q_lens, kv_lens) -> None:
    check_indices(page_size, q_lens, kv_lens, seed=sum(kv_lens))


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    seqs=st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 40)), min_size=1, max_size=6
    ),  # (q_len, keys before the new rows)
    seed=st.integers(0, 1000),
)
def test_indices_property(page_size, seqs, seed) -> None:
    check_indices(page_size, [q for q, _ in seqs], [q + c for q, c in seqs], seed)


def test_indices_reject_broken_metadata() -> None:
    meta = build_attention_metadata([2], [5], [[0, 1]], 4, CPU)
    meta.kv_lens = [1]  # fewer keys than query rows
    with pytest.raises(ValueError, match="q_len"):
        build_flashinfer_indices(meta)
    meta.kv_lens = [9]  # needs three pages, table has two
    with pytest.raises(ValueError, match="block table"):
        build_flashinfer_indices(meta)


# ---------------------------------------------------------------- selection and fallback
@pytest.fixture
def fresh_selection():
    selection.reset_cache()
    yield
    selection.reset_cache()


def test_cpu_selects_torch_and_flashinfer_refuses(fresh_selection) -> None:
    assert create_backend("auto", 4, 2, 16, CPU).name == "torch"
    assert selection.flashinfer_status(CPU) == (False, "no CUDA device")
    with pytest.raises(ConfigError, match="CUDA"):
        FlashInferAttentionBackend(4, 2, 16, CPU)
    with pytest.raises((ConfigError, ValueError)):
        create_backend("flashinfer", 4, 2, 16, CPU)


def test_broken_flashinfer_falls_back_with_one_log_line(
    fresh_selection, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # "installed" but fails to import
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="specdec.engine.attention.selection"):
        backend = create_backend("auto", 4, 2, 16, cuda)
        create_backend("auto", 4, 2, 16, cuda)  # cached: no second self-test, no second line
    assert backend.name == "torch"
    ok, reason = selection.flashinfer_status(cuda)
    assert not ok and "ConfigError" in reason and "flashinfer" in reason
    lines = [r for r in caplog.records if "FlashInfer attention unavailable" in r.message]
    assert len(lines) == 1


def test_failed_self_test_falls_back(fresh_selection, monkeypatch) -> None:
    from specdec.engine.attention import flashinfer_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flashinfer_backend, "self_test", lambda device: False)
    assert selection.flashinfer_status(torch.device("cuda")) == (
        False,
        "self-test output differs from the torch reference",
    )


def test_engine_on_cpu_runs_with_auto_backend() -> None:
    from tiny_models import make_engine, tiny_hf_model

    engine = make_engine(tiny_hf_model(seed=3), attention_backend="auto")
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].output_token_ids) == 4
    assert engine.target_runner.backend.name == "torch"


# ---------------------------------------------------------------- CUDA-graph padding
def test_pad_graph_batch_keeps_padding_in_scratch_blocks() -> None:
    page, q_len, scratch = 4, 3, [90]
    tables = [[7, 3, 5], [2, 8]]
    padded = pad_graph_batch([[1, 2, 3], [4, 5, 6]], [6, 2], tables, 4, q_len, page, scratch)
    real = build_attention_metadata([3, 3], [9, 5], tables, page, CPU)
    assert padded.slot_mapping[:6] == real.slot_mapping.tolist()
    assert all(s // page in scratch for s in padded.slot_mapping[6:])
    assert padded.positions == [6, 7, 8, 2, 3, 4, 0, 1, 2, 0, 1, 2]
    assert padded.kv_lens == [9, 5, 3, 3] and padded.q_lens == [3] * 4
    assert padded.block_tables[2:] == [scratch, scratch]
    with pytest.raises(ValueError, match="bucket"):
        pad_graph_batch([[1]] * 3, [0] * 3, [[0]] * 3, 2, 1, page, scratch)
    with pytest.raises(ValueError, match="scratch"):
        pad_graph_batch([], [], [], 2, 5, page, scratch)


def _entry(num_tokens: int, start: int, num_logits: int | None = None) -> SimpleNamespace:
    logits = num_tokens if num_logits is None else num_logits
    return SimpleNamespace(token_ids=[1] * num_tokens, start_pos=start, num_logits=logits)


def test_graph_bucket_picks_the_smallest_captured_bucket_or_runs_eagerly() -> None:
    captured = [(b, q) for b in (1, 2, 4, 8) for q in (1, 5)]
    decode3 = [_entry(1, s) for s in (10, 20, 30)]
    assert graph_bucket(decode3, captured, 64) == 4
    assert graph_bucket([_entry(5, 7)] * 8, captured, 64) == 8  # uniform k = 4 verifies
    assert graph_bucket([_entry(1, 0)] * 9, captured, 64) is None  # larger than every bucket
    assert graph_bucket([_entry(5, 7), _entry(3, 7)], captured, 64) is None  # mixed k
    assert graph_bucket([_entry(2, 7)], captured, 64) is None  # q_len never captured
    assert graph_bucket([_entry(5, 7, num_logits=0)], captured, 64) is None  # prompt chunk
    assert graph_bucket([_entry(1, 63)], captured, 64) == 1
    assert graph_bucket([_entry(1, 64)], captured, 64) is None  # past the page budget
    assert graph_bucket([], captured, 64) is None
    assert batch_buckets(12) == [1, 2, 4, 8] and batch_buckets(256)[-1] == 64


# ---------------------------------------------------------------- batched sampling path
MIXED_PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.02),  # nucleus of one token
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("vocab", [50, 1000])
def test_warp_probs_matches_reference(vocab: int) -> None:
    logits = torch.randn(len(MIXED_PARAMS), vocab, generator=torch.Generator().manual_seed(vocab))
    logits *= 3
    want = compute_probs(logits, [RowContext(p, (), ()) for p in MIXED_PARAMS])
    assert torch.equal(warp_probs(logits, MIXED_PARAMS), want)
    got = warp_probs(logits, MIXED_PARAMS, TorchKernels())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_probs_for_rows_applies_penalties_before_the_kernels_warp() -> None:
    vocab = 200
    params = [
        SamplingParams(temperature=0.8, repetition_penalty=1.3, top_k=40),
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=1.0, frequency_penalty=0.4, top_p=0.9),
    ]
    rows = [RowContext(p, [1, 2, 3, 4], [5, 5, 6 + i]) for i, p in enumerate(params)]
    logits = 3 * torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    want = compute_probs(logits, rows)
    assert torch.equal(probs_for_rows(logits, rows), want)
    torch.testing.assert_close(probs_for_rows(logits, rows, TorchKernels()), want)
    assert torch.equal(logits, before)  # the caller's logits are left as they were
    with pytest.raises(ValueError, match="row contexts"):
        probs_for_rows(logits, rows[:2], TorchKernels())


def test_seeded_rows_do_not_depend_on_position() -> None:
    vocab, kernels = 300, TorchKernels()
    probs = torch.softmax(torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)), -1)

    def draws(row: int) -> list[int]:
        seeds: list[int | None] = [None, 3, None, 4, None]
        seeds[row] = 42
        order = list(range(5))
        order[0], order[row] = order[row], order[0]  # put row 0's distribution at `row`
        batch = probs[order]
        out = []
        for pos in range(6):
            positions = [pos + 10 * b for b in range(5)]
            positions[row] = pos
            out.append(int(sample_from_probs(batch, [False] * 5, seeds, positions, kernels)[row]))
        return out

    assert draws(0) == draws(3) == draws(4)
    assert len(set(draws(0))) > 1  # positions really change the draw
    greedy = sample_from_probs(probs, [True] * 5, [None, 1, None, 2, None], [0] * 5, kernels)
    assert torch.equal(greedy, probs.argmax(-1))


def test_reference_draws_no_noise_for_greedy_rows() -> None:
    """Without kernels, greedy rows are picked by argmax and leave the default generator as it
    was; a seeded row beside them draws what it draws alone."""
    vocab = 300
    probs = torch.softmax(torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)), -1)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    greedy = sample_from_probs(probs, [True] * 4, [None] * 4, [0] * 4)
    assert torch.equal(greedy, probs.argmax(-1))
    assert torch.equal(torch.get_rng_state(), before)  # no exponential draw over the vocabulary
    mixed = sample_from_probs(probs, [True, False, True, False], [None, 7, None, 9], [0, 3, 0, 4])
    alone = [sample_from_probs(probs[b : b + 1], [False], [s], [p])[0] for b, s, p in
             ((1, 7, 3), (3, 9, 4))]  # fmt: skip
    assert mixed[0] == probs[0].argmax() and mixed[2] == probs[2].argmax()
    assert [mixed[1], mixed[3]] == alone


def _verify_inputs(batch: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, -1)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(batch, k)
    return target, drafts, q


@pytest.mark.parametrize("one_hot_q", [False, True])
def test_verify_rows_equal_single_row_calls(one_hot_q: bool) -> None:
    """Seeded rows: each equals a lone call with the same seed and position; greedy and seeded
    rows equal the reference exactly; layout: -1 after the final token."""
    batch, k, vocab = 7, 4, 40
    target, drafts, q = _verify_inputs(batch, k, vocab, seed=1)
    n = [2, 0, 2, 4, 1, 3, 2]  # rows 0, 2, 6: two seeded and one unseeded with two drafts
    greedy = [False, False, False, True, False, True, False]
    target[3] = torch.nn.functional.one_hot(target[3].argmax(-1), vocab).float()
    target[5] = torch.nn.functional.one_hot(target[5].argmax(-1), vocab).float()
    drafts[3, :2] = target[3, :2].argmax(-1)  # greedy row accepting two drafts, then a reject
    seeds = [11, 12, None, None, 15, None, 17]
    positions = [40 + 3 * b for b in range(batch)]
    q_in = None if one_hot_q else q
    res = verify_drafts(target, drafts, q_in, n, greedy, seeds, positions, TorchKernels())
    ref = verify_drafts(target, drafts, q_in, n, greedy, seeds, positions)  # reference path
    for b in range(batch):
        acc = int(res.num_accepted[b])
        assert 0 <= acc <= n[b]
        row = res.output_token_ids[b].tolist()
        assert row[:acc] == drafts[b, :acc].tolist() and all(t == -1 for t in row[acc + 1 :])
        if greedy[b] or seeds[b] is not None:  # picked rows: no randomness but the seed's
            assert row == ref.output_token_ids[b].tolist()
        if seeds[b] is not None:
            alone = verify_drafts(
                target[b : b + 1],
                drafts[b : b + 1],
                None if q_in is None else q_in[b : b + 1],
                [n[b]],
                [False],
                [seeds[b]],
                [positions[b]],
                TorchKernels(),
            )
            assert row == alone.output_token_ids[0].tolist()
    assert res.output_token_ids[3, :3].tolist() == [*drafts[3, :2].tolist(), target[3, 2].argmax()]


def first_token_p_values(verify, seed: int) -> list[float]:
    """Two interleaved classes of rows with different (p, q), random draft counts 0..3 and NaN
    padding; chi-square of each class's first emitted token against its target row 0."""
    rows, k, vocab = 6000, 3, 6
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(2, k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, k, vocab, generator=gen) * 1.5, -1)
    cls = torch.arange(rows) % 2
    target, draft_probs = p[cls].clone(), q[cls].clone()
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(rows, k)
    n = torch.randint(0, k + 1, (rows,), generator=gen)
    pad = torch.arange(k)[None, :] >= n[:, None]
    draft_probs[pad] = float("nan")
    target[torch.cat([torch.zeros(rows, 1, dtype=torch.bool), pad], 1)] = float("nan")
    drafts[pad] = -1
    first = verify(target, drafts, draft_probs, n.tolist())[:, 0]
    out = []
    for c in range(2):
        observed = torch.bincount(first[cls == c], minlength=vocab).double()
        expected = p[c, 0].double() * observed.sum()
        out.append(float(stats.chisquare(observed, expected / expected.sum() * observed.sum())[1]))
    return out


def test_batched_verify_follows_target_distribution() -> None:
    def batched(target, drafts, q, n):
        free = [None] * len(n)
        res = verify_drafts(
            target, drafts, q, n, [False] * len(n), free, [0] * len(n), TorchKernels()
        )
        return res.output_token_ids

    def misrouted(target, drafts, q, n):  # wrong: results land one row off
        return batched(target, drafts, q, n).roll(1, dims=0)

    assert min(first_token_p_values(batched, seed=3)) > 1e-4
    assert min(first_token_p_values(misrouted, seed=3)) < 1e-6


def test_no_flashinfer_kernels_on_cpu() -> None:
    assert flashinfer_sampling_kernels(CPU) is None


# ---------------------------------------------------------------- real FlashInfer (CUDA only)
@pytest.mark.gpu
@pytest.mark.parametrize(("page_size", "q_lens", "kv_lens"), CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_matches_torch_backend(page_size, q_lens, kv_lens, head_dim) -> None:
    pytest.importorskip("flashinfer")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    tables = random_tables(kv_lens, page_size, seed=1)
    num_blocks = max(max(t) for t in tables) + 1
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(num_blocks, page_size, 2, head_dim, generator=gen) for _ in range(2)]
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen).to(dev, dtype) for h in (8, 2, 2))
    outs = []
    for backend in (
        FlashInferAttentionBackend(8, 2, head_dim, dev),
        TorchAttentionBackend(8, 2, head_dim, dev),
    ):
        meta = build_attention_metadata(q_lens, kv_lens, tables, page_size, dev)
        backend.plan(meta)
        kc, vc = (p.to(dev, dtype) for p in pools)
        outs.append(backend.forward(q, k, v, kc, vc, meta).float())
    err = (outs[0] - outs[1]).norm() / outs[1].norm()
    assert err < 1e-2


@pytest.mark.gpu
def test_flashinfer_sampling_matches_torch_kernels() -> None:
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    kernels = flashinfer_sampling_kernels(dev)
    assert kernels is not None
    logits = torch.randn(len(MIXED_PARAMS), 151936, device=dev) * 3
    want = warp_probs(logits, MIXED_PARAMS, TorchKernels())
    got = warp_probs(logits, MIXED_PARAMS, kernels)
    assert (got - want).abs().max() < 1e-4

    def batched(target, drafts, q, n):
        free, rows = [None] * len(n), len(n)
        res = verify_drafts(
            target.to(dev), drafts.to(dev), q.to(dev), n, [False] * rows, free, [0] * rows, kernels
        )
        return res.output_token_ids.cpu()

    assert min(first_token_p_values(batched, seed=4)) > 1e-4


@pytest.mark.gpu
def test_graph_replay_matches_eager_torch_backend() -> None:
    pytest.importorskip("flashinfer")
    from specdec.engine.cuda_graphs import GraphedForward
    from specdec.engine.kv_cache import allocate_model_kv
    from tiny_models import loaded_from_hf, tiny_hf_model

    dev, dtype, page = torch.device("cuda"), torch.bfloat16, 4
    loaded = loaded_from_hf(tiny_hf_model(seed=5, hidden=256, heads=4, kv_heads=2), dtype, "cuda")
    arch, model = loaded.arch, loaded.model
    num_blocks = 40  # block 39 is the scratch block, never in a table
    graph_kv = allocate_model_kv(arch, num_blocks, page, dtype, dev)
    eager_kv = allocate_model_kv(arch, num_blocks, page, dtype, dev)
    for (gk, gv), (ek, ev) in zip(graph_kv.layers, eager_kv.layers, strict=True):
        for g, e in ((gk, ek), (gv, ev)):
            g.copy_(torch.randn_like(g))
            e.copy_(g)
    backend = FlashInferAttentionBackend(arch.num_attention_heads, 2, arch.head_dim, dev)
    graphed = GraphedForward(model, graph_kv.layers, backend, page, 8, [39], dtype)
    graphed.capture([4], [1, 3])
    tables = [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
    eager = TorchAttentionBackend(arch.num_attention_heads, 2, arch.head_dim, dev)
    for q_len, starts in ((1, [9, 13, 20]), (3, [5, 11, 17])):  # not the capture's lengths
        toks = [[7 + i + j for j in range(q_len)] for i in range(3)]
        got = graphed.run(toks, starts, tables).clone()
        meta = build_attention_metadata([q_len] * 3, [s + q_len for s in starts], tables, page, dev)
        ids = torch.tensor([t for row in toks for t in row], device=dev)
        pos = torch.tensor([s + j for s in starts for j in range(q_len)], device=dev)
        rows = torch.arange(3 * q_len, device=dev)
        want = model(ids, pos, eager_kv.layers, eager, meta, rows)
        assert (got - want).norm() / want.norm() < 3e-2
    untouched = [b for b in range(39) if all(b not in t for t in tables)]
    for (gk, _), (ek, _) in zip(graph_kv.layers, eager_kv.layers, strict=True):
        assert torch.equal(gk[untouched], ek[untouched])  # padding wrote only to block 39
    # Both graphs wrote their logits into one buffer sized for the larger capture.
    outputs = [graphed.replay(4, q_len) for q_len in (1, 3)]
    assert len({o.untyped_storage().data_ptr() for o in outputs}) == 1
    assert outputs[1].shape == (12, arch.vocab_size)


@pytest.mark.gpu
def test_engine_with_cuda_graphs_matches_eager_engine_and_frees_every_block() -> None:
    pytest.importorskip("flashinfer")
    from tiny_models import make_engine, tiny_hf_model

    # head_dim 64 for both (a size FlashInfer compiles); different weights, so drafts get rejected.
    target = tiny_hf_model(seed=11, hidden=256, heads=4, kv_heads=2)
    draft = tiny_hf_model(seed=12, hidden=128, heads=2, kv_heads=1)
    prompts = [[3 + i, 9, 4 + 2 * i, 17] * (2 + i) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        engine = make_engine(
            target,
            draft,
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            enforce_eager=eager,
        )
        free = engine.allocator.num_free_blocks
        outs[eager] = [
            [o.output_token_ids for o in engine.generate(prompts, params, speculative=mode)]
            for mode in ("off", "on")
        ]
        assert engine.allocator.num_free_blocks == free
        assert type(engine.sampling_kernels).__name__ == "FlashInferKernels"
        runs = engine.target_runner.num_graph_runs + engine.proposer.runner.num_graph_runs
        assert (runs == 0) if eager else (runs > 0)
    # bf16 kernels round differently across shapes, so compare each mode's texts token-wise
    # with a tolerance of near-ties: on these tiny random models nearly all must agree.
    for mode in (0, 1):
        same = sum(a == b for a, b in zip(outs[True][mode], outs[False][mode], strict=True))
        assert same >= 4, (mode, outs[True][mode], outs[False][mode])


def test_fused_ops_are_off_on_cpu() -> None:
    from specdec.engine.models.fused_ops import probe_fused_ops

    assert probe_fused_ops(CPU, torch.bfloat16) is None


@pytest.mark.gpu
def test_fused_ops_probe_passes_and_the_engine_uses_them() -> None:
    pytest.importorskip("flashinfer")
    from specdec.engine.models.fused_ops import probe_fused_ops
    from tiny_models import make_engine, tiny_hf_model

    assert probe_fused_ops(torch.device("cuda"), torch.bfloat16) is not None
    engine = make_engine(
        tiny_hf_model(seed=3, hidden=256, heads=4, kv_heads=2),
        device="cuda",
        dtype="bfloat16",
        attention_backend="flashinfer",
    )
    assert engine.target_runner.model.layers[0].mlp.ops is not None
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].output_token_ids) == 4


# ---------------------------------------------------------------- the device check's CPU side
def _smoke(tmp_path, *extra: str) -> dict:
    import json

    from specdec.evals.gpu_check.check import main

    assert main([str(tmp_path), "--cpu-smoke", *extra]) == 0
    (path,) = tmp_path.glob("gpu_check_*_cpu.json")
    return json.loads(path.read_text())


def test_gpu_check_cpu_smoke_writes_results(tmp_path, capsys) -> None:
    results = _smoke(tmp_path, "--only", "attention_parity,sampling_parity,model_parity")
    stages = results["stages"]
    assert stages["jit"]["status"] == "skipped"  # nothing to compile without CUDA
    for name in ("environment", "attention_parity", "sampling_parity", "model_parity"):
        assert stages[name]["status"] == "ok", stages[name]
        assert name == "environment" or stages[name]["pass"] is True
    assert "step_timing" not in stages
    table = (tmp_path / "gpu_check_table.txt").read_text()
    assert "attention parity worst rel err" in table
    assert capsys.readouterr().out.rstrip().endswith(table.rstrip().splitlines()[-1])


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_cpu_stage(tmp_path) -> None:
    stages = _smoke(tmp_path)["stages"]
    assert stages["graph_parity"]["status"] == "skipped"  # CUDA only
    failed = {n: s for n, s in stages.items() if s["status"] == "failed"}
    assert not failed, failed
    assert {r["k"] for r in stages["e2e"]["rows"]} == {0, 1, 2}
    assert stages["engine_greedy"]["pass"]


def test_gpu_check_cpu_smoke_runs_the_fp8_weights_stage(tmp_path) -> None:
    stages = _smoke(tmp_path, "--only", "bandwidth,fp8_weights")["stages"]
    fp8 = stages["fp8_weights"]
    assert fp8["status"] == "ok" and fp8["pass"], fp8
    assert fp8["fp8_weight_bytes"] < 0.6 * fp8["bf16_weight_bytes"]  # a byte a weight, not two
    assert [r["batch"] for r in fp8["rows"]] and all(r["fp8_decode_ms"] > 0 for r in fp8["rows"])
    table = (tmp_path / "gpu_check_table.txt").read_text()
    assert "fp8 weights: logits rel err / top-1 vs bf16" in table


def test_gpu_check_tree_entries_are_trees_of_the_asked_size_and_depth() -> None:
    from specdec.engine.attention.base import tree_mask_from_parents
    from specdec.evals.gpu_check.trees import tree_entry_parents

    for nodes, depth in ((8, 4), (16, 4), (5, 4), (3, 4), (64, 4)):
        parents = tree_entry_parents(nodes, depth)
        assert len(parents) == nodes + 1 and parents[0] == -1
        mask = tree_mask_from_parents(parents)  # raises unless each parent precedes its child
        # A row sees itself and its ancestors: the deepest row sees depth + 1 rows (the root too).
        assert int(mask.sum(1).max()) == min(depth, nodes) + 1
    with pytest.raises(ValueError):
        tree_entry_parents(0, 4)


def test_gpu_check_cpu_smoke_times_tree_verifies(tmp_path) -> None:
    stages = _smoke(tmp_path, "--only", "tree_timing")["stages"]
    trees = stages["tree_timing"]
    assert trees["status"] == "ok" and trees["pass"], trees
    assert [r["batch"] for r in trees["rows"]] == [1, 2]
    for row in trees["rows"]:
        assert set(row["trees"]) == {"4", "8"}  # JSON keys
        assert all(t["tree_ms"] > 0 and t["causal_same_rows_ms"] > 0 for t in row["trees"].values())
    table = (tmp_path / "gpu_check_table.txt").read_text()
    assert "tree 8 nodes verify / decode; / causal, batch 2" in table
