"""The estimate of what a CUDA engine allocates beyond weights and KV, and its use in the engine."""

from __future__ import annotations

import pytest
import torch
from specdec.engine.attention.flashinfer_backend import WORKSPACE_BYTES
from specdec.engine.cuda_graphs import batch_buckets
from specdec.engine.device_memory import (
    FLASHINFER_INT_WORKSPACE_BYTES,
    RuntimeShapes,
    activation_bytes,
    logits_bytes,
    runtime_bytes,
)
from specdec.engine.kv_cache import GIB, bytes_per_block
from specdec.engine.llm_engine import DRAFT_Q_LENS, LLMEngine
from specdec.evals.gpu_check.models import arch_for
from tiny_models import make_engine, tiny_hf_model

MIB = 1024 * 1024
QWEN_7B = arch_for("7b")  # hidden 3584, 28 q / 4 kv heads of 128, intermediate 18944


def test_per_row_bytes_of_a_7b_layer_and_its_logits() -> None:
    # 4 x hidden + (28 + 2 x 4) x 128 (fused qkv) + 3 x intermediate, two bytes each in bf16.
    assert activation_bytes(QWEN_7B, 1, torch.bfloat16) == (4 * 3584 + 36 * 128 + 3 * 18944) * 2
    assert activation_bytes(QWEN_7B, 10, torch.float32) == 10 * 75776 * 4
    # bf16 lm_head output, then logits, probabilities and the two verify grids in float32.
    assert logits_bytes(QWEN_7B, 3, torch.bfloat16) == 3 * QWEN_7B.vocab_size * (2 + 4 * 4)


def test_graphs_cost_one_shared_logits_buffer_plus_one_capture_of_transients() -> None:
    eager = RuntimeShapes(max_batched_tokens=512, max_sampled_rows=320)
    graphed = RuntimeShapes(
        max_batched_tokens=512,
        max_sampled_rows=320,
        graph_batch_sizes=batch_buckets(64),
        graph_q_lens=range(1, 6),
    )
    bf16 = torch.bfloat16
    extra = runtime_bytes(QWEN_7B, bf16, graphed) - runtime_bytes(QWEN_7B, bf16, eager)
    vocab, rows = QWEN_7B.vocab_size, 64 * 5
    assert extra == (
        rows * vocab * 4  # the shared float32 logits
        + activation_bytes(QWEN_7B, rows, bf16)
        + rows * vocab * 2  # the largest capture's bf16 lm_head output, in the graph pool
        + 7 * 5 * FLASHINFER_INT_WORKSPACE_BYTES  # one wrapper per (bucket, q_len)
    )
    # One buffer per graph would hold every capture's rows: (1 + 2 + ... + 64) x (1 + ... + 5).
    per_graph = sum(batch_buckets(64)) * 15 * vocab * 4
    assert per_graph > 1.1e9 and rows * vocab * 4 < 0.2e9


def test_workspaces_count_only_with_a_flashinfer_workspace() -> None:
    shapes = RuntimeShapes(max_batched_tokens=64, max_sampled_rows=4)
    bare = runtime_bytes(QWEN_7B, torch.bfloat16, shapes)
    assert bare == activation_bytes(QWEN_7B, 64, torch.bfloat16) + logits_bytes(
        QWEN_7B, 4, torch.bfloat16
    )
    flashinfer = RuntimeShapes(
        max_batched_tokens=64, max_sampled_rows=4, float_workspace_bytes=256 * MIB
    )
    with_ws = runtime_bytes(QWEN_7B, torch.bfloat16, flashinfer)
    assert with_ws - bare == 256 * MIB + 2 * FLASHINFER_INT_WORKSPACE_BYTES


def test_cpu_engine_sets_nothing_aside_and_sizes_kv_from_kv_cache_memory() -> None:
    hf = tiny_hf_model("qwen2")
    engine = make_engine(
        hf, tiny_hf_model("qwen2", seed=1), num_kv_blocks=None, kv_cache_memory=0.01
    )
    assert engine.runtime_reserve_bytes == 0
    per_block = bytes_per_block([engine.target.arch, engine.draft.arch], 4, torch.float32)
    assert engine.allocator.num_blocks == int(0.01 * GIB) // per_block


def test_engine_reserve_covers_both_models_with_their_graph_shapes(monkeypatch) -> None:
    """The reserve the engine computes on CUDA: target graphs at q_len 1..k_max + 1, draft graphs
    at 1 and 2, buckets up to max_num_seqs, FlashInfer workspaces for both runners."""
    engine = make_engine(
        tiny_hf_model("qwen2"),
        tiny_hf_model("qwen2", seed=1),
        max_num_seqs=8,
        max_num_batched_tokens=96,
        num_speculative_tokens=3,
    )
    monkeypatch.setattr(LLMEngine, "_uses_graphs", property(lambda self: True))
    t_arch, d_arch, dt = engine.target.arch, engine.draft.arch, engine.dtype

    def shapes(q_lens) -> RuntimeShapes:
        return RuntimeShapes(96, 8 * 4, batch_buckets(8), q_lens, WORKSPACE_BYTES)

    want = runtime_bytes(t_arch, dt, shapes(range(1, 5))) + runtime_bytes(
        d_arch, dt, shapes(DRAFT_Q_LENS)
    )
    assert engine._runtime_reserve([1, 2, 3, 4]) == want
    monkeypatch.setattr(LLMEngine, "_uses_graphs", property(lambda self: False))
    no_graphs = engine._runtime_reserve([1, 2, 3, 4])
    assert no_graphs < want


@pytest.mark.parametrize("rows", [1, 3])
def test_logits_into_a_float32_buffer_equal_the_returned_logits(rows: int) -> None:
    from tiny_models import loaded_from_hf

    model = loaded_from_hf(tiny_hf_model("qwen2", seed=2), torch.bfloat16).model
    h = torch.randn(rows, model.arch.hidden_size, dtype=torch.bfloat16)
    residual = torch.randn_like(h)
    want = model.logits(h, residual)
    buffer = torch.full((4, model.arch.vocab_size), float("nan"))
    got = model.logits(h, residual, out=buffer[:rows])
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(got, want) and torch.isnan(buffer[rows:]).all()
