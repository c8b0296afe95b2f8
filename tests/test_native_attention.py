"""The torch backend's native path for rows computed one by one (``paged_attention.c``): the same
attention as the torch calls, within rounding, for decodes, verifies and tree rows beside a
prompt chunk; pools it cannot read go through the torch calls. That verified and tree rows equal
plain decode's bit for bit is checked in test_tree_attention.py, on whichever path runs here."""

from __future__ import annotations

import pytest
import torch
from specdec.engine.attention.base import build_attention_metadata, tree_mask_from_parents
from specdec.engine.attention.kv_format import encode, row_width
from specdec.engine.attention.torch_backend import TorchAttentionBackend
from specdec.engine.models import native

CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(
    native.library() is None, reason="no AVX-512 VNNI CPU or no C compiler here"
)


def _backends(heads: int, kv_heads: int, dim: int):
    with native.switched_off():
        reference = TorchAttentionBackend(heads, kv_heads, dim, CPU)
    return TorchAttentionBackend(heads, kv_heads, dim, CPU), reference


def _step(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int = 0):
    """A mixed step: a decode, a verify of 5 rows, a tree of 4 nodes and a 24-row prompt chunk,
    over random pools; (q, k, v, k_cache, v_cache, metadata inputs)."""
    page, g = 16, torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [1, 5, 4, 24], [300, 41, 77, 40]
    tables, next_block = [], 0
    for kv_len in kv_lens:
        blocks = -(-kv_len // page)
        tables.append(list(range(next_block + blocks - 1, next_block - 1, -1)))  # out of order
        next_block += blocks

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    tokens = sum(q_lens)
    pools = (rand(next_block, page, kv_heads, dim), rand(next_block, page, kv_heads, dim))
    trees = [None, None, tree_mask_from_parents([-1, 0, 0, 1]), None]
    inputs = (q_lens, kv_lens, tables, page, CPU, trees)
    return (
        rand(tokens, heads, dim),
        rand(tokens, kv_heads, dim),
        rand(tokens, kv_heads, dim),
        *pools,
        inputs,
    )


def _run(backend, q, k, v, k_cache, v_cache, inputs):
    meta = build_attention_metadata(*inputs)
    backend.plan(meta)
    return backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)


@needs_native
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 2, 128), (14, 2, 64), (4, 4, 16)])
def test_native_rows_compute_the_torch_calls_attention(dtype, tol, heads, kv_heads, dim):
    backend, reference = _backends(heads, kv_heads, dim)
    assert backend.native is not None and reference.native is None
    q, k, v, k_cache, v_cache, inputs = _step(dtype, heads, kv_heads, dim)
    got = _run(backend, q, k, v, k_cache, v_cache, inputs)
    want = _run(reference, q, k, v, k_cache, v_cache, inputs)
    assert got.dtype == dtype and got.shape == want.shape
    # float32 sums in another order (and bf16's one rounding of the output): rounding only.
    assert float((got.float() - want.float()).abs().max()) < tol * float(want.abs().max())
    # The prompt chunk (more rows than ROW_BY_ROW_MAX) takes the masked torch call either way.
    prompt = slice(sum(inputs[0][:3]), None)
    assert torch.equal(got[prompt], want[prompt])


@needs_native
def test_a_row_does_not_depend_on_the_other_rows_of_its_call():
    backend, _ = _backends(12, 2, 128)
    q, k, v, k_cache, v_cache, inputs = _step(torch.bfloat16, 12, 2, 128, seed=1)
    together = _run(backend, q, k, v, k_cache, v_cache, inputs)
    q_lens, kv_lens, tables, page, device, trees = inputs
    # The decode alone (sequence 0's row is row 0 of the step).
    alone = _run(backend, q[:1], k[:1], v[:1], k_cache, v_cache,
                 ([1], kv_lens[:1], tables[:1], page, device, [None]))  # fmt: skip
    assert torch.equal(alone[0], together[0])


@needs_native
def test_a_pool_in_a_one_byte_format_goes_through_the_torch_calls():
    backend, reference = _backends(12, 2, 128)
    q, k, v, k_cache, v_cache, inputs = _step(torch.bfloat16, 12, 2, 128, seed=2)
    width = row_width(128, torch.int8)
    k_int8 = encode(k_cache.float(), torch.int8).view(*k_cache.shape[:3], width)
    v_int8 = encode(v_cache.float(), torch.int8).view(*v_cache.shape[:3], width)
    got = _run(backend, q, k, v, k_int8, v_int8, inputs)
    want = _run(reference, q, k, v, k_int8, v_int8, inputs)
    assert torch.equal(got, want)


def test_the_ab_program_switches_off_native_rows_in_both_runners_and_writes_a_table():
    from specdec.evals.kernels.attention_ab import markdown, switch_off_native_attention
    from tiny_models import make_engine, noisy_copy, tiny_hf_model

    target = tiny_hf_model(seed=0)
    engine = make_engine(target, noisy_copy(target, 0.05))
    switch_off_native_attention(engine)
    assert engine.target_runner.backend.native is None
    assert engine.proposer.runner.backend.native is None
    run = {"id": "p", "group": "code", "native spec_equals_plain": True}
    rates = {"torch plain": 10.0, "native plain": 11.0, "torch adaptive": 20.0}
    run.update(rates, **{"native adaptive": 25.0, "torch spec_equals_plain": True})
    result = {"command": "c", "commit": "x", "environment": {"cpu": "cpu"}, "cpu_flags": "f",
              "threads": 2, "arm": "auto:none/int4", "max_tokens": 8, "runs": [run],
              "summary": {"code": {k: v for k, v in run.items() if isinstance(v, float)}}}  # fmt: skip
    text = markdown(result)
    assert "| code | 10.00 | 11.00 (1.10x) | 20.00 | 25.00 (1.25x) |" in text
    assert "every prompt: True" in text
