"""The native kernels: the int4 and q8_0 products' layouts and arithmetic against references
written out in torch, the element-wise ops against the torch layers, row independence, the fallback to
the torch kernels, and building the library once per machine."""

from __future__ import annotations

import warnings

import pytest
import torch
from specdec.engine.models import group_native, native
from specdec.engine.models.quant import INT4_MAX_ROWS, Int4Draft, quantize_weight_int4

NATIVE = native.library() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no AVX-512 VNNI CPU or no C compiler here")


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * in_features**-0.5


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: activations rounded to int8 per group of 32 (scale
    max |x| / 127), weights as fp16 scale * code + fp16 base, each group's base times the exact
    sum of its activations."""
    q, scale, offset = quantize_weight_int4(weight, 32)
    scale_b = scale.to(torch.float16).double()
    base_b = (offset - 8 * scale).to(torch.float16).double()
    rows, k = x.shape
    xg = x.double().view(rows, k // 32, 32)
    xscale = xg.abs().amax(-1) / 127
    xcodes = torch.round(xg / xscale.clamp_min(1e-300)[..., None]).clamp(-127, 127)
    dots = torch.einsum("rgi,ogi->rog", xcodes, q.double().view(-1, k // 32, 32))
    y = (dots * scale_b * xscale[:, None, :]).sum(-1) + (xg.sum(-1) @ base_b.t())
    return y if bias is None else y + bias.double()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [16, 40, 1000])
def test_native_kernel_computes_the_reference_arithmetic(dtype, out_features):
    # 40 and 1000 are off the 16-channel blocks: the last block's store is masked.
    weight = _weight(out_features, 256)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(1))
    q, scale, offset = quantize_weight_int4(weight, 32)
    packed = group_native.pack(q, scale, offset - 8 * scale)
    assert packed.shape == (-(-out_features // 16), 256 // 32, 320)
    lib = native.library()
    for rows in (1, 3, 8, 11):  # 11: a second tile of rows over the same weights
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        for b in (None, bias.to(dtype)):
            got = group_native.linear(lib, packed, out_features, x, b)
            want = _reference(x.float(), weight, None if b is None else b.float())
            assert got.dtype == dtype and got.shape == (rows, out_features)
            # float32 sums of integer dot products: rounding only (bf16 output: its own rounding).
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            err = float((got.double() - want).abs().max() / want.abs().max())
            assert err < tol, (rows, err)


@needs_native
def test_native_kernel_rows_do_not_depend_on_their_batch_mates():
    weight = _weight(200, 128)
    kernel = Int4Draft(weight)
    assert kernel.native is not None
    x = torch.randn(kernel.max_rows, 128, generator=torch.Generator().manual_seed(2))
    batch = kernel(x, None)
    for i in range(kernel.max_rows):
        assert torch.equal(kernel(x[i : i + 1], None)[0], batch[i])


@needs_native
def test_native_kernel_rejects_inputs_that_do_not_fit_its_weight():
    kernel = Int4Draft(_weight(32, 64))
    with pytest.raises(ValueError, match="64 input features"):
        kernel(torch.randn(1, 96), None)
    assert kernel(torch.randn(0, 64), None).shape == (0, 32)


def test_switched_off_the_draft_runs_torchs_kernel_with_the_same_codes():
    weight = _weight(48, 128)
    with native.switched_off():
        fallback = Int4Draft(weight)
    assert fallback.native is None and fallback.max_rows == INT4_MAX_ROWS
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    want = x @ weight.t()
    got = fallback(x, None)
    assert float((got - want).norm() / want.norm()) < 0.15
    if NATIVE:  # both read the same 4-bit codes; they differ by activation rounding only
        native_y = Int4Draft(weight)(x, None)
        assert float((native_y - got).norm() / got.norm()) < 0.03


def test_a_missing_compiler_or_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.delenv(native.SWITCH_ENV, raising=False)
    monkeypatch.setattr(native, "_cpu_flags", lambda: native._CPU_FLAGS)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C compiler"):
            assert native.library() is None
        native.library.cache_clear()
        monkeypatch.setattr(native, "_compiler", lambda: "false")  # exits 1, builds nothing
        with pytest.warns(UserWarning, match="could not be built"):
            assert native.library() is None
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_a_cpu_without_vnni_never_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    native.library.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.library() is None
        assert not (tmp_path / "kernels").exists()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_native
def test_the_library_is_built_once_and_then_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        (built,) = (tmp_path / "kernels").glob("specdec_kernels-*.so")
        stamp = built.stat().st_mtime_ns
        native.library.cache_clear()
        monkeypatch.setattr(native, "_build", lambda *a: pytest.fail("built twice"))
        assert native.library() is not None
        assert built.stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_elementwise_ops_match_the_torch_layers(dtype):
    from specdec.engine.models.layers import RMSNorm, RotaryEmbedding
    from specdec.engine.models.native_elementwise import NativeElementwiseOps

    ops = NativeElementwiseOps(native.library())
    gen = torch.Generator().manual_seed(7)
    # bf16: the torch layers round between steps, the kernels once.
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert float((got.float() - want.float()).norm() / want.float().norm()) < tol

    # Widths off the kernels' 16 lanes (100, 70) take the masked tails; 9 rows split over threads.
    norm = RMSNorm(100, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(100, generator=gen)).to(dtype)
    x = torch.randn(9, 100, generator=gen).to(dtype)
    residual = torch.randn(9, 100, generator=gen).to(dtype)
    close(ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    want_h, want_r = norm.add_and_norm(x, residual)
    xi, ri = x.clone(), residual.clone()
    got_h, got_r = ops.add_rms_norm(xi, ri, norm.weight, norm.eps)
    assert got_h.data_ptr() == xi.data_ptr() and got_r.data_ptr() == ri.data_ptr()  # in place
    close(got_h, want_h)
    close(got_r, want_r)

    gate_up = 4 * torch.randn(9, 2 * 70, generator=gen).to(dtype)  # silu's tails too
    gate, up = gate_up.split(70, dim=-1)
    close(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate.float()).to(dtype) * up)

    rope = RotaryEmbedding(64, 4096, 1e6, None)
    positions = torch.tensor([0, 1, 17, 300, 4000])
    # q and k as the decoder gets them: views into one fused projection, a token's heads side by side.
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen).to(dtype)
    q, k = qkv[:, : 4 * 64].view(5, 4, 64), qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    ops.rope_(positions, q, k, rope.cos_sin_cache())
    close(q, want_q)
    close(k, want_k)
    with pytest.raises(ValueError, match="side by side"):
        ops.rope_(
            positions, q.transpose(0, 1).contiguous().transpose(0, 1), k, rope.cos_sin_cache()
        )


@needs_native
@pytest.mark.parametrize("scheme", ["int8-dynamic", "int4"])
def test_a_quantized_draft_runs_the_native_ops_close_to_the_torch_layers(target, scheme):
    from specdec.engine.models.native_elementwise import NativeElementwiseOps
    from tiny_models import make_engine

    def draft_engine(draft_quantization: str = scheme):
        return make_engine(target, target, draft_quantization=draft_quantization)

    native_engine = draft_engine()
    with native.switched_off():
        torch_engine = draft_engine()
    assert isinstance(native_engine.draft.model.norm.ops, NativeElementwiseOps)
    assert torch_engine.draft.model.norm.ops is None
    # An unquantized target keeps the torch layers: its numbers are the checkpoint's own.
    assert native_engine.target.model.norm.ops is None
    ids = [3, 14, 15, 92]  # four rows: every int4 product on an int4 kernel in both
    exact = _draft_logits(draft_engine("none"), ids)

    def error(engine) -> float:
        return float((_draft_logits(engine, ids) - exact).norm() / exact.norm())

    # Quantization noise dominates (a tiny random model loses much to 4 bits); the native kernels
    # add none of their own.
    assert error(native_engine) < 1.1 * error(torch_engine) + 0.01


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_target_runs_the_native_ops_close_to_the_torch_layers(target, scheme):
    """Its numbers are the quantized weights' whichever layers run: the native ops round once
    where the torch layers round between steps, and add no error beyond that rounding."""
    from specdec.engine.models.native_elementwise import NativeElementwiseOps
    from tiny_models import make_engine

    engine = make_engine(target, quantization=scheme)
    model = engine.target.model
    ops = model.norm.ops
    assert isinstance(ops, NativeElementwiseOps)
    ids = [3, 14, 15, 92, 65, 35]
    exact = _logits(make_engine(target), None, ids)

    def error(logits: torch.Tensor) -> float:
        return float((logits - exact).norm() / exact.norm())

    got = _logits(engine, None, ids)
    model.use_fused_ops(None)  # the same quantized weights through the torch layers
    assert error(got) < 1.1 * error(_logits(engine, None, ids)) + 0.01
    model.use_fused_ops(ops)
    # Each row alone, as a decode step computes it, equals its row in the prompt's one pass.
    assert torch.equal(_logits(engine, None, ids[:4])[3], got[3])


def _draft_logits(engine, ids: list[int]) -> torch.Tensor:
    return _logits(engine, engine.proposer.runner, ids)


def _logits(engine, runner, ids: list[int]) -> torch.Tensor:
    """The logits of every row of ``ids`` as one prompt through ``runner`` (None: the target's),
    with the KV blocks handed back."""
    from specdec.engine.model_runner import RunEntry
    from specdec.engine.sampling_params import SamplingParams
    from specdec.engine.sequence import Sequence

    runner = runner or engine.target_runner
    seq = Sequence(-1, "probe", ids, SamplingParams(max_tokens=1), "off")
    free = engine.allocator.num_free_blocks
    engine.allocator.allocate(seq, seq.num_tokens)
    try:
        return runner.run([RunEntry(seq, ids, 0, len(ids))])
    finally:
        engine.allocator.free(seq)
        assert engine.allocator.num_free_blocks == free


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_target_rows_map_natively_as_in_torch_and_alone_as_in_a_batch(dtype):
    from specdec.engine.models.quant import Int8RowScaled

    weight = _weight(300, 256)
    bias = torch.randn(300, generator=torch.Generator().manual_seed(8)).to(dtype)
    kernel = Int8RowScaled(weight)
    with native.switched_off():
        reference = Int8RowScaled(weight)
    assert kernel.native is not None and reference.native is None
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    for b in (None, bias):
        batch = kernel(x, b)
        # The same operations as the torch path (bit for bit where torch fuses addcmul's
        # multiply-add, as on the AVX-512 CPUs measured).
        want = reference(x, b)
        assert batch.dtype == dtype
        assert float((batch.float() - want.float()).abs().max()) <= 1e-6 * float(want.abs().max())
        for i in (0, 3, 6):  # one row alone (fbgemm) equals itself among seven (oneDNN)
            assert torch.equal(kernel(x[i : i + 1], b)[0], batch[i])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int4_target_computes_each_row_alone_at_any_row_count(dtype):
    from specdec.engine.models.quant import Int4Exact

    weight = _weight(40, 128)  # 40: off the 16-channel blocks
    kernel = Int4Exact(weight)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(10)).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], None) for i in range(20)])
    for rows in (2, 8, 9, 20):  # 9 and 20: more than one tile of rows over the weights
        assert torch.equal(kernel(x[:rows], None), alone[:rows])
    # Its weight is the 4-bit one: the dense copy is the codes times the fp16 scales plus bases.
    q, scale, offset = quantize_weight_int4(weight, 32)
    scale_b, base_b = scale.to(torch.float16).float(), (offset - 8 * scale).to(torch.float16)
    want = (q.float().view(40, 4, 32) * scale_b[..., None] + base_b.float()[..., None]).view(
        40, 128
    )
    assert torch.equal(kernel.dense(), want)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"quantization": "int4", "speculative_method": "none"}, "--quantization int4"),
        ({"quantization": "q8_0", "speculative_method": "none"}, "--quantization q8_0"),
        ({"draft_quantization": "q8_0"}, "--draft-quantization q8_0"),
    ],
)
def test_a_native_only_format_without_the_native_kernels_is_a_config_error(
    monkeypatch, fields, named
):
    from specdec.engine.config import EngineConfig
    from specdec.engine.errors import ConfigError
    from specdec.engine.llm_engine import LLMEngine
    from specdec.engine.models.quant import Int4Exact, Q8_0Exact

    monkeypatch.setattr(native, "library", lambda: None)
    for kernel in (Int4Exact, Q8_0Exact):
        with pytest.raises(ValueError, match="native kernels"):
            kernel(_weight(16, 32))
    config = EngineConfig(model="tiny", **fields)
    with pytest.raises(ConfigError, match=f"{named} need the native CPU kernels"):
        LLMEngine(config, progress=False)


def _q8_0_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the q8_0 kernel computes, in float64: activations rounded to int8 per group of 32
    (scale max |x| / 127), each group's integer dot product times both scales."""
    rows, k = x.shape
    xg = x.double().view(rows, k // 32, 32)
    xscale = xg.abs().amax(-1) / 127
    xcodes = torch.round(xg / xscale.clamp_min(1e-300)[..., None]).clamp(-127, 127)
    dots = torch.einsum("rgi,ogi->rog", xcodes, codes.double().view(-1, k // 32, 32))
    return (dots * scale.double() * xscale[:, None, :]).sum(-1)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [16, 40, 1000])
def test_q8_0_kernel_computes_the_reference_arithmetic(dtype, out_features):
    from specdec.engine.models.quant import quantize_weight_q8_0

    codes, scale = quantize_weight_q8_0(_weight(out_features, 256))
    codes[0, :32] = -128  # GGUF's Q8_0 may hold -128, which our own rounding never makes
    packed = group_native.pack_q8_0(codes, scale)
    assert packed.shape == (-(-out_features // 16), 256 // 32, 544)
    dense = (codes.float().view(out_features, 8, 32) * scale[..., None]).view(out_features, 256)
    assert torch.equal(group_native.unpack_q8_0(packed, out_features), dense)
    lib = native.library()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(1))
    for rows in (1, 3, 8, 11):  # 11: a second tile of rows over the same weights
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        for b in (None, bias.to(dtype)):
            got = group_native.linear(lib, packed, out_features, x, b)
            want = _q8_0_reference(x.float(), codes, scale)
            want = want if b is None else want + b.double()
            assert got.dtype == dtype and got.shape == (rows, out_features)
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            err = float((got.double() - want).abs().max() / want.abs().max())
            assert err < tol, (rows, err)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_q8_0_target_computes_each_row_alone_and_stays_close_to_the_float_product(dtype):
    from specdec.engine.models.quant import Int8RowScaled, Q8_0Exact

    weight = _weight(40, 256)
    kernel = Q8_0Exact(weight)
    gen = torch.Generator().manual_seed(10)
    # Heavy-tailed rows, as a transformer's activations: a few entries far above the rest.
    x = (torch.randn(20, 256, generator=gen) * torch.randn(20, 256, generator=gen).exp()).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], None) for i in range(20)])
    for rows in (2, 8, 9, 20):
        assert torch.equal(kernel(x[:rows], None), alone[:rows])
    # Local activation ranges keep the small entries that one range per row rounds coarsely.
    want = x.double() @ weight.double().t()
    err_q8_0 = (alone.double() - want).norm() / want.norm()
    err_int8 = (Int8RowScaled(weight)(x, None).double() - want).norm() / want.norm()
    assert err_q8_0 < 0.8 * err_int8, (err_q8_0, err_int8)
