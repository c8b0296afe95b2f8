"""The native int4 draft kernel: its layout and arithmetic against a reference written out in
torch, row independence, the fallback to torch's kernel, and building it once per machine."""

from __future__ import annotations

import warnings

import pytest
import torch
from specdec.engine.models import int4_native
from specdec.engine.models.quant import INT4_MAX_ROWS, Int4Draft, quantize_weight_int4

NATIVE = int4_native.library() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no AVX-512 VNNI CPU or no C compiler here")


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * in_features**-0.5


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: activations rounded to int8 per group of 32 (scale
    max |x| / 127), weights as bf16 scale * code + bf16 base, each group's base times the exact
    sum of its activations."""
    q, scale, offset = quantize_weight_int4(weight, 32)
    scale_b = scale.to(torch.bfloat16).double()
    base_b = (offset - 8 * scale).to(torch.bfloat16).double()
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
    packed = int4_native.pack(q, scale, offset - 8 * scale)
    assert packed.shape == (-(-out_features // 16), 256 // 32, 320)
    lib = int4_native.library()
    for rows in (1, 3, 8, 11):  # 11: a second tile of rows over the same weights
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        for b in (None, bias.to(dtype)):
            got = int4_native.linear(lib, packed, out_features, x, b)
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
    with int4_native.switched_off():
        fallback = Int4Draft(weight)
    assert fallback.native is None and fallback.max_rows == INT4_MAX_ROWS
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    want = x @ weight.t()
    got = fallback(x, None)
    assert float((got - want).norm() / want.norm()) < 0.15
    if NATIVE:  # both read the same 4-bit codes; they differ by activation rounding only
        native = Int4Draft(weight)(x, None)
        assert float((native - got).norm() / got.norm()) < 0.03


def test_a_missing_compiler_or_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(int4_native, "_cpu_flags", lambda: int4_native._CPU_FLAGS)
    monkeypatch.setattr(int4_native, "_compiler", lambda: None)
    int4_native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C compiler"):
            assert int4_native.library() is None
        int4_native.library.cache_clear()
        monkeypatch.setattr(int4_native, "_compiler", lambda: "false")  # exits 1, builds nothing
        with pytest.warns(UserWarning, match="could not be built"):
            assert int4_native.library() is None
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        monkeypatch.undo()
        int4_native.library.cache_clear()


def test_a_cpu_without_vnni_never_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(int4_native, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    int4_native.library.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert int4_native.library() is None
        assert not (tmp_path / "kernels").exists()
    finally:
        monkeypatch.undo()
        int4_native.library.cache_clear()


@needs_native
def test_the_library_is_built_once_and_then_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    int4_native.library.cache_clear()
    try:
        assert int4_native.library() is not None
        (built,) = (tmp_path / "kernels").glob("int4_matmul-*.so")
        stamp = built.stat().st_mtime_ns
        int4_native.library.cache_clear()
        monkeypatch.setattr(int4_native, "_build", lambda *a: pytest.fail("built twice"))
        assert int4_native.library() is not None
        assert built.stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        int4_native.library.cache_clear()
