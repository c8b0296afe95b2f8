"""Weight formats (fp32, bf16, int8): row-independent kernels keep greedy speculative output equal
to greedy plain output of the same format; the dtype 'auto' choice; bad format requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from specdec.engine.config import EngineConfig
from specdec.engine.cpu_features import (
    has_fast_bf16,
    has_fast_int4_draft,
    parse_cpu_flags,
    vector_flags_summary,
)
from specdec.engine.errors import ConfigError
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.loader import resolve_draft_quantization, resolve_dtype
from specdec.engine.models import native
from specdec.engine.models.layers import Linear, OneDNNPacked, onednn_available
from specdec.engine.models.quant import (
    INT4_MAX_ROWS,
    Int4Draft,
    Int8Dynamic,
    Int8RowScaled,
    full_range_activations,
    many_rows_engine,
    onednn_rows_match_fbgemm,
    quantize_model,
)
from specdec.engine.sampling_params import SamplingParams
from test_engine_greedy import prompts, run_staggered
from tiny_models import loaded_from_hf, make_engine, noisy_copy

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BF16_PACKED = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _linear(dtype: torch.dtype, out_features: int = 96, in_features: int = 64) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, in_features**-0.5)
        layer.bias.normal_(0, 0.1)
    return layer


def _rows_alone_equal_rows_in_batch(layer: Linear, dtype: torch.dtype) -> bool:
    x = torch.randn(16, layer.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    batch = layer(x)
    return all(torch.equal(layer(x[i : i + 1])[0], batch[i]) for i in range(16))


@pytest.mark.parametrize(
    "dtype, scheme",
    [
        (torch.float32, "packed"),
        pytest.param(
            torch.bfloat16,
            "packed",
            marks=pytest.mark.skipif(not BF16_PACKED, reason="oneDNN has no bf16 on this CPU"),
        ),
        (torch.float32, "int8"),
        (torch.bfloat16, "int8"),
    ],
)
def test_row_exact_formats_compute_a_row_alone_as_in_a_batch_of_16(dtype, scheme):
    layer = _linear(dtype)
    if scheme == "packed":
        assert layer.pack_for_cpu()
    else:
        layer.set_kernel(Int8RowScaled(layer.weight))
    assert _rows_alone_equal_rows_in_batch(layer, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_keep_their_bits_at_every_row_count_and_kernel(dtype):
    # A long input (as a down projection's) and every row count from 1 to 16: fbgemm computes the
    # first rows, oneDNN (where its sums match) the rest, and a row's bits never move.
    layer = _linear(torch.float32, out_features=64, in_features=8960)
    layer.set_kernel(Int8RowScaled(layer.weight))
    x = (torch.randn(16, 8960, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    assert all(torch.equal(layer(x[:m]), alone[:m]) for m in range(1, 17))
    assert layer.kernel.onednn is not None or not onednn_rows_match_fbgemm()
    want = torch.nn.functional.linear(x.float(), layer.kernel.dense(), layer.bias)
    assert float((alone.float() - want).norm() / want.norm()) < 0.02


def test_dynamic_int8_rows_depend_on_their_batch_mates():
    # One activation scale per call: a batch-mate with a larger magnitude changes a row's result.
    # That is why this scheme is offered for drafts only.
    layer = _linear(torch.float32)
    layer.set_kernel(Int8Dynamic(layer.weight))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    x[1] *= 50
    assert not torch.equal(layer(x[:1])[0], layer(x)[0])


@pytest.mark.parametrize("kernel", [Int8RowScaled, Int8Dynamic])
def test_int8_kernels_stay_close_to_the_float_product(kernel):
    layer = _linear(torch.float32, out_features=40, in_features=24)  # shapes off the 8 grid
    want = layer(torch.ones(1, 24))  # plain weights still
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.set_kernel(kernel(layer.weight))
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 0.03
    # int8 values (twice where the row-scaled kernel also holds oneDNN's copy), one fp32 scale a row
    copies = 2 if kernel is Int8RowScaled and onednn_rows_match_fbgemm() else 1
    assert layer.weight_bytes == copies * 40 * 24 + 40 * 4


@pytest.mark.parametrize(("dtype", "max_rows"), [(torch.float32, 300), (torch.bfloat16, 32)])
def test_onednn_rows_keep_their_bits_up_to_the_documented_row_count(dtype, max_rows):
    # What greedy speculative == greedy plain rests on: a row's product does not depend on how
    # many rows share the call, within the envelope docs/formats.md states per dtype.
    if not onednn_available(dtype):
        pytest.skip(f"oneDNN has no {dtype} kernel here")
    gen = torch.Generator().manual_seed(6)
    kernel = OneDNNPacked((torch.randn(2048, 1536, generator=gen) * 0.02).to(dtype))
    x = torch.randn(max_rows, 1536, generator=gen).to(dtype)
    alone = torch.cat([kernel(x[j : j + 1], None) for j in range(max_rows)])
    for rows in sorted({2, 7, 16, 32, max_rows}):
        assert torch.equal(kernel(x[:rows], None), alone[:rows]), rows
        assert torch.equal(kernel(x[max_rows - rows :], None), alone[max_rows - rows :]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_draft_kernel_stays_close_to_the_float_product_at_every_row_count(dtype):
    # 40 outputs: off the kernels' 16-channel blocks, so the padding is exercised too.
    layer = _linear(torch.float32, out_features=40, in_features=128)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(4))
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    kernel = Int4Draft(layer.weight.to(dtype))
    few_rows = kernel.max_rows
    assert few_rows >= INT4_MAX_ROWS
    layer.set_kernel(kernel)
    layer.bias.data = layer.bias.data.to(dtype)
    for rows in (1, few_rows, few_rows + 1, 16):  # int4, then int8
        got = layer(x[:rows].to(dtype))
        assert got.dtype == dtype and got.shape == (rows, 40)
        # 4-bit codes in groups of 32: under a tenth of each weight's spread is rounding.
        assert float((got.float() - want[:rows]).norm() / want[:rows].norm()) < 0.15
    # The few-row path is int4, not the int8 copy: its error is the larger one.
    few = layer(x[:1].to(dtype)).float()
    many = layer(torch.cat([x[:1]] * (few_rows + 1)).to(dtype))[:1].float()
    assert not torch.equal(few, many)
    # Half a byte, a scale and offset per 32 weights, and the int8 copy's byte: under 2 a weight.
    assert layer.weight_bytes < 40 * 128 * 2


def test_int4_draft_prompt_sized_products_stay_close_to_fbgemms_int8():
    # A catch-up over a prompt multiplies tens to hundreds of rows through the many-row copy,
    # on oneDNN where it runs int8 at full range: the same int8 weight as fbgemm's, so the
    # products differ by activation rounding only.
    layer = _linear(torch.float32, out_features=40, in_features=128)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    kernel = Int4Draft(layer.weight)
    got, fbgemm = kernel(x, None), Int8Dynamic(layer.weight)(x, None)
    assert float((got - fbgemm).norm() / fbgemm.norm()) < 0.02
    engine = many_rows_engine()
    assert engine in (None, "onednn")
    assert torch.equal(got, Int8Dynamic(layer.weight, engine)(x, None))


def test_int4_needs_whole_groups_of_input_features():
    layer = _linear(torch.float32, out_features=32, in_features=48)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Draft(layer.weight)


def test_quantize_model_converts_every_linear_and_shrinks_the_weights(target):
    plain = loaded_from_hf(target).model
    quantized = loaded_from_hf(target, quantization="int8").model
    linears = [m for m in quantized.modules() if isinstance(m, Linear)]
    assert quantized.quantization == "int8"
    assert all(isinstance(m.kernel, Int8RowScaled) for m in linears)
    bytes_of = lambda model: sum(m.weight_bytes for m in model.modules() if isinstance(m, Linear))  # noqa: E731
    copies = 2 if onednn_rows_match_fbgemm() else 1  # oneDNN's copy for many-row products
    assert bytes_of(quantized) < (0.05 + 0.25 * copies) * bytes_of(plain)
    # What a forward computes with: every fp32 parameter of the checkpoint but the embeddings.
    want = sum(p.numel() * 4 for n, p in target.named_parameters() if "embed_tokens" not in n)
    assert plain.weight_bytes() == want
    # int8 matrices; biases, norms as they were
    assert quantized.weight_bytes() < (0.05 + 0.25 * copies) * want + 4096
    with pytest.raises(ValueError, match="plain CPU weights"):
        quantize_model(quantized, "int8")  # already converted: no plain weights left
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(loaded_from_hf(target).model, "int3")


FORMATS = [
    ("float32", "none", "none"),
    ("bfloat16", "none", "none"),
    ("float32", "int8", "none"),
    ("bfloat16", "int8", "int8"),
    ("float32", "none", "int8-dynamic"),
    ("bfloat16", "int8", "int8-dynamic"),
    ("float32", "none", "int4"),
    ("bfloat16", "none", "int4"),
    ("float32", "int4", "int4"),  # the native kernels only (skipped without them)
    ("bfloat16", "int4", "none"),
    ("float32", "q8_0", "int4"),  # the native kernels only (skipped without them)
    ("bfloat16", "q8_0", "q8_0"),
]


@pytest.mark.parametrize("dtype, quantization, draft_quantization", FORMATS)
def test_greedy_speculative_equals_greedy_plain_per_format(
    target, dtype, quantization, draft_quantization
):
    if dtype == "bfloat16" and not BF16_PACKED:
        pytest.skip("oneDNN has no bf16 on this CPU")
    native_only = quantization in ("int4", "q8_0") or draft_quantization == "q8_0"
    if native_only and native.library() is None:
        pytest.skip(f"{quantization} needs the native kernels (AVX-512 VNNI, a C compiler)")
    draft = noisy_copy(target, 0.03)
    formats = dict(dtype=dtype, quantization=quantization, draft_quantization=draft_quantization)
    ps = prompts(5)
    plain = make_engine(target, **formats)
    spec = make_engine(
        target, draft, num_speculative_tokens=4, speculative_policy="fixed", **formats
    )
    free0 = spec.allocator.num_free_blocks
    want = run_staggered(plain, ps, GREEDY)
    assert run_staggered(spec, ps, GREEDY, spec="on") == want
    # The draft is neither perfect nor useless here: acceptances, rejections and rollbacks.
    stats = spec.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[1] > 0  # some steps commit several drafted tokens
    assert spec.allocator.num_free_blocks == free0


def test_cpu_flags_choose_bf16_for_auto(monkeypatch):
    amx = parse_cpu_flags("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert has_fast_bf16(amx) and vector_flags_summary(amx) == "avx2 avx512f amx_tile amx_bf16"
    assert has_fast_bf16(frozenset({"avx512_bf16"}))
    assert not has_fast_bf16(parse_cpu_flags("flags : fpu avx2 fma\n"))
    assert not has_fast_bf16(parse_cpu_flags("no flags line here"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr("specdec.engine.loader.has_fast_bf16", lambda fast=fast: fast)
        assert resolve_dtype("auto", cpu) == want
        assert resolve_dtype("auto", cuda) == torch.bfloat16
        assert resolve_dtype("float32", cpu) == torch.float32


def test_draft_format_auto_is_int4_where_its_kernels_are_fast(monkeypatch):
    assert not has_fast_int4_draft(parse_cpu_flags("flags : fpu avx2 fma\n"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr("specdec.engine.loader.has_fast_int4_draft", lambda: True)
    assert resolve_draft_quantization("auto", cpu) == "int4"
    assert resolve_draft_quantization("auto", cuda) == "none"
    assert resolve_draft_quantization("int8-dynamic", cpu) == "int8-dynamic"
    monkeypatch.setattr("specdec.engine.loader.has_fast_int4_draft", lambda: False)  # AVX2 only
    assert resolve_draft_quantization("auto", cpu) == "none"
    assert EngineConfig(device="cuda").draft_quantization == "auto"  # resolved to none there


def test_a_prebuilt_draft_keeps_its_own_format_under_auto(target):
    for built in ("none", "int4"):
        engine = make_engine(target, target, draft_quantization=built)
        again = LLMEngine(
            dataclasses.replace(engine.config, draft_quantization="auto"),
            target=loaded_from_hf(target),
            draft=loaded_from_hf(target, quantization=built, role="draft"),
            progress=False,
        )
        assert again.config.draft_quantization == built


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"quantization": "int3"}, "quantization must be one of"),
        ({"draft_quantization": "int8-dynamic-please"}, "draft_quantization must be one of"),
        ({"quantization": "int8-dynamic"}, "quantization must be one of"),  # target: row-exact only
        ({"quantization": "int8-dynamic"}, "only with speculative_method none"),
    ],
)
def test_bad_format_settings_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_a_model_that_never_verifies_drafts_may_take_a_draft_format():
    for fmt in ("int4", "int8-dynamic"):
        assert EngineConfig(quantization=fmt, speculative_method="none").quantization == fmt
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="auto", speculative_method="none")


def test_a_prebuilt_model_in_another_format_is_refused(target):
    config = EngineConfig(
        model="tiny", draft_model=None, speculative_method="none", device="cpu", quantization="int8"
    )
    with pytest.raises(ConfigError, match="built with quantization 'none'"):
        LLMEngine(config, target=loaded_from_hf(target), progress=False)


def test_int8_activations_at_full_range_multiply_exactly_where_chosen():
    # The probe's worst case through the kernel the engine runs: rows of the largest activation
    # code times the largest weight. With 8-bit activations a saturated pair of products would
    # show; with 7 bits (where the probe found saturation) there is none to show.
    layer = _linear(torch.float32, out_features=16, in_features=512)
    layer.weight.data.fill_(0.5)
    layer.bias.data.zero_()
    layer.set_kernel(Int8RowScaled(layer.weight))
    x = torch.ones(3, 512)
    x[:, 0] = 0.0
    torch.testing.assert_close(layer(x), torch.full((3, 16), 0.5 * 511), rtol=1e-3, atol=0)
    assert isinstance(full_range_activations(), bool)
