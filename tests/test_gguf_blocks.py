"""GGUF blocks read as groups of 32 weights, and int4 and q8_0 models that keep a GGUF file's own
codes."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from helpers_weights import tiny_model, write_gguf
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.loader import load_model
from specdec.engine.models import build_model, model_arch_from_hf_config, native
from specdec.engine.models.quant import Int4Draft, Int4Exact, Int8RowScaled, Q8_0Exact
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.weights import GGUFModel, converted_from
from specdec.engine.weights.gguf_blocks import read_groups
from test_engine_greedy import prompts, run_staggered
from tiny_models import loaded_from_hf, noisy_copy

needs_native = pytest.mark.skipif(
    native.library() is None, reason="int4 and q8_0 targets need the native kernels (AVX-512 VNNI)"
)


def _random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_K blocks (gguf-py cannot quantize to Q4_K): random codes and 6-bit scales and
    mins, with finite fp16 super-block scales."""
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    scales = gen.uniform(1e-3, 1e-2, size=(len(blocks), 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _expand(codes: np.ndarray, scale: np.ndarray, base: np.ndarray) -> np.ndarray:
    rows = codes.shape[0]
    grouped = codes.reshape(rows, -1, 32).astype(np.float32) * scale[..., None] + base[..., None]
    return grouped.reshape(codes.shape)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0])
def test_blocks_give_back_what_gguf_dequantizes(qtype):
    rows, cols = 6, 512
    if qtype == Q.Q4_K:
        raw = _random_q4_k(rows, cols)
    else:
        weights = np.random.default_rng(1).normal(size=(rows, cols)).astype(np.float32)
        raw = quantize(weights, qtype)
    bits, codes, scale, base = read_groups(raw.reshape(-1), qtype, (rows, cols))
    assert codes.shape == (rows, cols) and scale.shape == base.shape == (rows, cols // 32)
    if qtype == Q.Q8_0:
        assert bits == 8 and codes.dtype == np.int8 and not base.any()
    else:
        assert bits == 4 and codes.dtype == np.uint8 and codes.max() <= 15
    # Bit for bit: the groups hold exactly the file's weights.
    assert np.array_equal(_expand(codes, scale, base), dequantize(raw, qtype).reshape(rows, cols))


def test_blocks_refuse_other_types_and_wrong_sizes():
    raw = quantize(np.ones((2, 64), dtype=np.float32), Q.F16)
    with pytest.raises(ValueError, match="not a GGUF type with 32-weight groups"):
        read_groups(raw.reshape(-1).view(np.uint8), Q.F16, (2, 64))
    raw = quantize(np.ones((2, 64), dtype=np.float32), Q.Q4_0)
    with pytest.raises(ValueError, match="do not hold a \\[3, 64\\] tensor"):
        read_groups(raw.reshape(-1), Q.Q4_0, (3, 64))
    with pytest.raises(ValueError, match="do not hold"):
        read_groups(_random_q4_k(2, 256).reshape(-1), Q.Q4_K, (2, 128))  # 128: not whole blocks


# The tiny model's linear weights in 4-bit types, but layer 1's down projection in Q8_0 and its
# v projection and the lm_head left in float32, as a Q4_K_M file keeps some tensors in more bits.
FOUR_BIT = {
    **{f"blk.0.{p}.weight": Q.Q4_0 for p in ("attn_q", "attn_k", "attn_output", "ffn_gate")},
    **{f"blk.0.{p}.weight": Q.Q4_1 for p in ("attn_v", "ffn_up", "ffn_down")},
    **{f"blk.1.{p}.weight": Q.Q4_0 for p in ("attn_q", "attn_k", "attn_output")},
    **{f"blk.1.{p}.weight": Q.Q4_1 for p in ("ffn_gate", "ffn_up")},
    "blk.1.ffn_down.weight": Q.Q8_0,
}
_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Every linear weight in Q8_0 but the lm_head (float32), as a Q8_0 file with a kept output.
EIGHT_BIT = {f"blk.{i}.{p}.weight": Q.Q8_0 for i in (0, 1) for p in _LINEAR_PARTS}


@pytest.fixture
def four_bit_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    model = tiny_model("qwen2", tied=False)
    return model, write_gguf(model, tmp_path / "tiny-q4.gguf", quantize=FOUR_BIT)


@pytest.fixture
def eight_bit_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    model = tiny_model("qwen2", tied=False)
    return model, write_gguf(model, tmp_path / "tiny-q8_0.gguf", quantize=EIGHT_BIT)


def _loaded(path, quantization="int4", role="target"):
    return load_model(
        str(path), torch.float32, torch.device("cpu"), False, False, quantization, role
    )


def _load(path, quantization="int4", role="target"):
    return _loaded(path, quantization, role).model


@needs_native
def test_an_int4_target_from_a_gguf_file_keeps_its_codes(four_bit_gguf):
    _, path = four_bit_gguf
    model = _load(path)
    file = GGUFModel(path)
    layer0, layer1 = model.layers[0], model.layers[1]
    # Layers stored in 4 bits keep the file's codes: the kernel's weight is the file's weight
    # exactly (Q4_0 and Q4_1 scales and bases are fp16, as the kernel holds them).
    for layer, linear, names in (
        (0, layer0.self_attn.qkv_proj, ("attn_q", "attn_k", "attn_v")),
        (0, layer0.mlp.gate_up_proj, ("ffn_gate", "ffn_up")),
        (0, layer0.mlp.down_proj, ("ffn_down",)),
        (1, layer1.mlp.gate_up_proj, ("ffn_gate", "ffn_up")),
        (1, layer1.self_attn.o_proj, ("attn_output",)),
    ):
        assert isinstance(linear.kernel, Int4Exact)
        tensors = [file.read_small_tensor(f"blk.{layer}.{name}.weight") for name in names]
        assert torch.equal(linear.kernel.dense(), torch.from_numpy(np.concatenate(tensors)))
    # Layers the file keeps in more bits run as q8_0 (rows stay exact): layer 1's down
    # projection on the file's Q8_0 codes; its fused qkv (v is float32) and the lm_head rounded.
    for linear in (layer1.self_attn.qkv_proj, layer1.mlp.down_proj, model.lm_head):
        assert isinstance(linear.kernel, Q8_0Exact)
    down = torch.from_numpy(file.read_small_tensor("blk.1.ffn_down.weight"))
    assert torch.equal(layer1.mlp.down_proj.kernel.dense(), down)


@needs_native
def test_a_q8_0_target_from_a_gguf_file_keeps_its_codes(eight_bit_gguf):
    _, path = eight_bit_gguf
    model = _load(path, "q8_0")
    file = GGUFModel(path)
    for layer in (0, 1):
        for linear, names in (
            (model.layers[layer].self_attn.qkv_proj, ("attn_q", "attn_k", "attn_v")),
            (model.layers[layer].mlp.gate_up_proj, ("ffn_gate", "ffn_up")),
            (model.layers[layer].mlp.down_proj, ("ffn_down",)),
        ):
            assert isinstance(linear.kernel, Q8_0Exact)
            tensors = [file.read_small_tensor(f"blk.{layer}.{name}.weight") for name in names]
            assert torch.equal(linear.kernel.dense(), torch.from_numpy(np.concatenate(tensors)))
    # The float32 lm_head is rounded onto Q8_0's grid: close to, not equal to, the file's.
    head = torch.from_numpy(file.read_small_tensor("output.weight"))
    dense = model.lm_head.kernel.dense()
    assert not torch.equal(dense, head)
    assert (dense - head).abs().max() <= head.abs().max() / 127


@needs_native
def test_an_int4_draft_from_a_gguf_file_stays_int4_everywhere(four_bit_gguf):
    _, path = four_bit_gguf
    draft = _load(path, role="draft")
    linears = [draft.layers[1].self_attn.qkv_proj, draft.lm_head, draft.layers[0].mlp.down_proj]
    assert all(isinstance(linear.kernel, Int4Draft) for linear in linears)
    down = GGUFModel(path).read_small_tensor("blk.0.ffn_down.weight")  # stored in Q4_1
    assert torch.equal(
        draft.layers[0].mlp.down_proj.kernel.few_rows.dense(), torch.from_numpy(down)
    )


@needs_native
def test_other_formats_and_plain_checkpoints_read_no_codes(four_bit_gguf, monkeypatch):
    model, path = four_bit_gguf
    read = []
    monkeypatch.setattr(GGUFModel, "stored_groups", lambda self, name: read.append(name))
    assert isinstance(_load(path, "int8").layers[0].self_attn.qkv_proj.kernel, Int8RowScaled)
    assert read == []  # only int4 and q8_0 look at the file's blocks
    int4 = loaded_from_hf(model, quantization="int4")  # no GGUF behind it: requantized
    assert isinstance(int4.model.layers[1].self_attn.qkv_proj.kernel, Int4Exact)


def test_a_conversion_names_its_gguf_source_only_while_it_exists(four_bit_gguf, tmp_path):
    _, path = four_bit_gguf
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), False, False)
    assert converted_from(loaded.path) == path.resolve()
    path.rename(tmp_path / "moved.gguf")
    assert converted_from(loaded.path) is None
    assert converted_from(tmp_path) is None  # no marker at all


@needs_native
def test_stored_codes_that_no_longer_match_the_weights_are_requantized(four_bit_gguf, caplog):
    model, path = four_bit_gguf
    file = GGUFModel(path)

    def shifted(name):
        groups = file.stored_groups(name)
        return None if groups is None else groups._replace(codes=(groups.codes + 1) % 16)

    arch = model_arch_from_hf_config(model.config.to_dict())
    weights = ((name, t.detach().clone()) for name, t in model.state_dict().items())
    with caplog.at_level(logging.WARNING):
        built = build_model(
            arch, weights, torch.float32, torch.device("cpu"), "int4", "target", shifted
        )
    assert "differ from the loaded weight" in caplog.text
    qkv = built.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.kernel, Q8_0Exact)  # not the wrong codes


@needs_native
@pytest.mark.parametrize(
    "quantization, file", [("int4", "four_bit_gguf"), ("q8_0", "eight_bit_gguf")]
)
def test_greedy_speculative_equals_plain_for_a_target_from_a_gguf_file(quantization, file, request):
    model, path = request.getfixturevalue(file)
    draft = loaded_from_hf(noisy_copy(model, 0.03), role="draft")
    config = dict(
        model=str(path), max_model_len=256, num_kv_blocks=128, page_size=4, max_num_seqs=8,
        max_num_batched_tokens=64, device="cpu", dtype="float32", quantization=quantization,
        draft_quantization="none", controller_warmup=False,
    )  # fmt: skip
    plain = LLMEngine(
        EngineConfig(**config, speculative_method="none"),
        target=_loaded(path, quantization),
        progress=False,
    )
    spec = LLMEngine(
        EngineConfig(
            **config, draft_model="tiny-draft", speculative_method="draft_model",
            num_speculative_tokens=4, speculative_policy="fixed",
        ),
        target=_loaded(path, quantization), draft=draft, progress=False,
    )  # fmt: skip
    free0 = spec.allocator.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run_staggered(plain, prompts(4), params)
    assert run_staggered(spec, prompts(4), params, spec="on") == want
    assert 0 < spec.spec_stats.num_accepted_tokens < spec.spec_stats.num_draft_tokens
    assert spec.allocator.num_free_blocks == free0
