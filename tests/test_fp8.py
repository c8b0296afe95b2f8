"""FP8 weights (`specdec.engine.models.fp8`): the arithmetic through torch's float8 product on
CPU, the formats' device rules, and on CUDA (skipped without one) the engine end to end."""

from __future__ import annotations

import pytest
import torch
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.models.fp8 import E4M3_MAX, FP8RowScaled, quantize_rows_fp8
from specdec.engine.models.layers import Linear
from specdec.engine.sampling_params import SamplingParams
from test_models import PagedModel, hf_logits
from tiny_models import loaded_from_hf, make_engine, tiny_hf_model


def _weight(out_features: int = 96, in_features: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * in_features**-0.5


def test_weights_round_to_e4m3_per_channel():
    w = _weight()
    w[3] *= 1000.0  # a channel's own scale keeps the others' resolution
    kernel = FP8RowScaled(w)
    assert kernel.codes.dtype == torch.float8_e4m3fn
    assert kernel.nbytes == w.numel() + 4 * w.shape[0]  # a byte a weight, a float a channel
    assert kernel.codes.float().abs().amax(dim=1).eq(E4M3_MAX).all()  # each channel's full range
    # e4m3 keeps 3 mantissa bits: a weight is within 2^-4 of itself, relative to its channel's max
    err = (kernel.dense() - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert err.max() <= 2**-4


def test_product_is_close_to_the_float_product_and_adds_the_bias():
    w, x = _weight(), torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96)
    y = FP8RowScaled(w)(x, bias)
    ref = x @ w.t() + bias
    assert y.shape == (5, 96) and y.dtype == x.dtype
    assert (y - ref).norm() / ref.norm() < 0.06  # two e4m3 roundings: a few percent
    assert FP8RowScaled(w)(x.to(torch.bfloat16), None).dtype == torch.bfloat16


def test_each_rows_codes_and_scale_come_from_that_row_alone():
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    x[4] *= 100.0
    codes, scale = quantize_rows_fp8(x)
    for i in range(9):
        alone_codes, alone_scale = quantize_rows_fp8(x[i : i + 1])
        assert torch.equal(alone_codes.view(torch.uint8), codes[i : i + 1].view(torch.uint8))
        assert torch.equal(alone_scale, scale[i : i + 1])


def test_zero_rows_and_channels_stay_zero():
    w = _weight()
    w[7] = 0.0
    x = torch.randn(3, 64)
    x[1] = 0.0
    y = FP8RowScaled(w)(x, None)
    assert torch.isfinite(y).all()
    assert y[1].eq(0).all() and y[:, 7].eq(0).all()


@pytest.mark.parametrize("shape", [(96, 60), (90, 64)])
def test_widths_off_the_tensor_core_tile_are_refused(shape):
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8RowScaled(_weight(*shape))


def test_an_fp8_model_tracks_the_float_model():
    hf = tiny_hf_model(seed=3)
    tokens = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    model = PagedModel(hf, quantization="fp8")
    linears = [m for m in model.lm.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.kernel, FP8RowScaled) for m in linears)
    ours, ref = model.feed(tokens), hf_logits(hf, tokens)
    # e4m3 keeps 3 mantissa bits: each product is a few percent off, compounding over a random
    # model's layers (this model: int8 0.05, q8_0 0.07, fp8 0.20, int4 0.43)
    assert (ours - ref).norm() / ref.norm() < 0.3
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"device": "cpu", "quantization": "fp8"}, "--quantization fp8: fp8 weights are a CUDA"),
        ({"device": "cpu", "draft_quantization": "fp8"}, "--draft-quantization fp8: fp8 weights"),
        ({"device": "cuda", "quantization": "int8"}, "--quantization int8: a CPU format"),
        ({"device": "cuda", "draft_quantization": "int4"}, "--draft-quantization int4: a CPU"),
    ],
)
def test_each_format_runs_on_its_device_only(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_cuda_takes_fp8_for_target_and_draft():
    config = EngineConfig(device="cuda", quantization="fp8", draft_quantization="fp8")
    assert (config.quantization, config.draft_quantization) == ("fp8", "fp8")


def test_an_engine_that_resolves_to_cpu_refuses_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hf = tiny_hf_model()
    config = EngineConfig(
        model="tiny", draft_model=None, speculative_method="none", device="auto",
        quantization="fp8",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="fp8 weights are a CUDA format"):
        LLMEngine(config, target=loaded_from_hf(hf), progress=False)


@pytest.mark.gpu
def test_fp8_engine_on_cuda_generates_close_to_bf16():
    target, draft = tiny_hf_model(seed=4, hidden=128), tiny_hf_model(seed=5, hidden=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 5, 7, 11], [13, 17, 19]]
    common = dict(device="cuda", dtype="bfloat16", speculative_mode="on")
    bf16 = make_engine(target, draft, **common).generate(prompts, params)
    fp8 = make_engine(
        target, draft, quantization="fp8", draft_quantization="fp8", **common
    ).generate(prompts, params)
    same = sum(
        a == b
        for x, y in zip(bf16, fp8, strict=True)
        for a, b in zip(x.output_token_ids, y.output_token_ids, strict=False)
    )
    assert all(len(o.output_token_ids) == 24 for o in fp8)
    assert same >= 12  # random weights: fp8 rounding may move a near-tie, not the whole text
