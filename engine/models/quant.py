"""Quantized weight formats for `Linear` on CPU (int8 and int4, each as a target or a draft takes
it) and on GPU (fp8, `specdec.engine.models.fp8`), and applying one to a whole model.

The two int8 schemes hold symmetric int8 weights with one scale per output channel, prepacked
for fbgemm's dynamic int8 linear (VNNI / AVX2 int8 dot products, int32 sums), which reads a
quarter of the bytes of fp32 and measured fastest of the int8 paths torch offers on CPU for a
row or two (docs/formats.md).

- ``Int8Dynamic`` (scheme "int8-dynamic"): fbgemm as it is. It picks one activation scale and
  zero point per call from the whole batch's range, so a row's result depends on its batch-mates;
  offered for the draft only (a draft may be lossy: the rejection rule verifies every token).
- ``Int8RowScaled`` (scheme "int8"): each activation row is mapped affinely onto integer codes
  from 0 (its minimum) to exactly 255 or 127 (its maximum), so every call's range is the same:
  fbgemm's activation scale (1) and zero point (0) are then constants whatever the batch, each
  row's products are exact integer sums, and undoing the row's map gives a row whose value never
  depends on the other rows. Greedy speculative output stays equal to greedy plain output of the same int8
  model (tests/test_formats.py checks this on the machine). Activations use all 8 bits where the
  kernel's products sum without saturating (``full_range_activations``), 7 bits elsewhere. From
  three rows on, oneDNN's int8 product takes over where it returns fbgemm's bits for the same
  codes (``onednn_rows_match_fbgemm``): its cost stays flat with the rows.
- ``Int4Draft`` (scheme "int4", drafts only): 4-bit weights in groups along the input with a
  scale and offset per group. A product of a few rows runs the native kernel
  (``group_native``: 4-bit codes times 8-bit activation codes with AVX-512 VNNI, built on first use)
  or, on CPUs without VNNI or without a C compiler, torch's CPU int4 weight-only kernel (bf16
  activations, whatever the model's dtype). Both read an eighth of fp32's bytes, and their cost
  grows with the rows, so from a handful of rows on (8 native, 4 torch) a dynamic int8 copy of
  the same weight takes over (catch-up reads, prompt prefill, large batches), multiplied by
  oneDNN where it runs int8 at full range (``many_rows_engine``). Which copy runs depends on the
  batch, so rows depend on their batch-mates: acceptable for a draft only.
- ``Int4Exact`` (scheme "int4" for a target): the same 4-bit weights through the native kernel
  at every row count, each row computed on its own, so greedy speculative output equals greedy
  plain output of the int4 model. Prompts cost more than in the other formats: the kernel runs
  8 rows per pass over the weights.
- ``Q8_0Exact`` (scheme "q8_0"): GGUF's Q8_0, signed 8-bit weights with an fp16 scale per 32
  inputs, through the native kernel at every row count, with one activation scale per 32 inputs
  of a row (as llama.cpp multiplies Q8_0): per-row ranges over the whole width round a row's
  small entries coarsely where a few are large, local ranges do not, so this format stays
  several times closer to the float model than "int8" (docs/formats.md). Exact like ``Int4Exact``
  and with its prompt cost; an int4 target runs it for the layers a file stores in more bits.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import warnings
from collections.abc import Callable

import torch
from specdec.engine.models import group_native, native
from specdec.engine.models.decoder import checkpoint_sources
from specdec.engine.models.fp8 import FP8RowScaled
from specdec.engine.models.layers import Linear
from specdec.engine.weights.gguf_blocks import StoredGroups
from torch import nn

logger = logging.getLogger(__name__)

# Groups of 32 weights: codes [out, in], scale and base [out, in / 32], w = scale * code + base.
Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Checkpoint weight name -> the groups a checkpoint stores it in (a GGUF file's blocks), or None.
Stored = Callable[[str], StoredGroups | None]

_CHUNK_ROWS = 16384  # weight rows converted at a time, so a 150k-row lm_head needs no fp32 copy


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8, scale [out] float32), w ~ q * scale."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], _CHUNK_ROWS):
        w = weight[start : start + _CHUNK_ROWS].detach().float()
        s = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q[start : start + _CHUNK_ROWS] = torch.round(w / s[:, None]).clamp(-127, 127)
        scale[start : start + _CHUNK_ROWS] = s
    return q, scale


def _pack_int8(
    q: torch.Tensor, scale: torch.Tensor, engine: str | None = None
) -> tuple[torch.Tensor, int]:
    """The prepacked weight for ``quantized.linear_dynamic`` (fbgemm's, or the ``engine``'s: the
    op runs whichever kernel packed its weight), and the bytes it stands for."""
    zero_points = torch.zeros(scale.numel(), dtype=torch.int64)
    with warnings.catch_warnings():
        # torch flags its quantized tensor type as deprecated; the fbgemm ops it feeds remain.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
    current = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = engine or current
        packed = torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = current
    return packed, q.numel() + 4 * scale.numel()


@functools.cache
def full_range_activations() -> bool:
    """Whether fbgemm's int8 products sum exactly here with 8-bit activations. With AVX-512 VNNI
    each product goes straight into an int32 sum; AVX2 adds pairs of products in 16 bits, which
    saturate once activations use all 8 bits, so there activations get 7 (``reduce_range``), at
    twice the rounding step. Probed on the kernel itself: rows of the largest activation times the
    largest weight, where a saturated pair would show."""
    k = 256
    packed, _ = _pack_int8(torch.full((16, k), 127, dtype=torch.int8), torch.full((16,), 1 / 127))
    x = torch.ones(16, k)
    x[:, 0] = 0.0  # the range starts at 0: the other entries quantize to 255
    y = torch.ops.quantized.linear_dynamic(x, packed, False)
    return bool(torch.allclose(y, torch.full_like(y, k - 1.0), rtol=1e-3))


def _fbgemm_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, packed, not full_range_activations())


def _int8_dense(packed: torch.Tensor) -> torch.Tensor:
    """The dequantized float32 weight of a prepacked one (fbgemm's or oneDNN's)."""
    return torch.ops.quantized.linear_unpack(packed)[0].dequantize()


class Int8Dynamic:
    """Dynamic int8 linear: one activation scale per call (rows depend on each other), through
    fbgemm or, with ``engine="onednn"``, oneDNN's int8 product."""

    def __init__(self, weight: torch.Tensor, engine: str | None = None) -> None:
        self.packed, self.nbytes = _pack_int8(*quantize_weight_int8(weight), engine)

    def dense(self) -> torch.Tensor:
        return _int8_dense(self.packed)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = _fbgemm_linear(x.float(), self.packed)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def _activation_levels() -> int:
    """The largest activation code: 255 with 8-bit activations, 127 with 7."""
    return 255 if full_range_activations() else 127


def _onednn_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(q, [1, q.shape[1]])


def _onednn_linear(
    codes: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """oneDNN's int8 product of uint8 activation codes (scale 1, zero point 0) and the
    per-channel int8 weight (``zero_points`` all 0): float32 [T, out]."""
    return torch.ops.onednn.qlinear_pointwise(
        codes.to(torch.uint8), 1.0, 0, packed, scale, zero_points,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip


@functools.cache
def onednn_rows_match_fbgemm() -> bool:
    """Whether oneDNN's int8 linear runs here and returns fbgemm's bits for the same activation
    codes (each an exact integer sum times the channel's scale) at every row count tried, so that
    which kernel a row goes through never changes it. Needs 8-bit activations (oneDNN is given
    codes to 255)."""
    if not full_range_activations():
        return False
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (48, 4096), generator=gen, dtype=torch.int8)
    scale = torch.rand(48, generator=gen) / 100 + 1e-4
    codes = torch.randint(0, 256, (16, 4096), generator=gen).float()
    codes[:, :2] = torch.tensor([0.0, 255.0])  # each row spans the whole range
    zero_points = torch.zeros(48, dtype=torch.int64)
    try:
        packed = _onednn_pack(q)
        rows = [
            _onednn_linear(codes[:m], packed, scale, zero_points)
            for m in (1, INT8_ONEDNN_MIN_ROWS, 7, 16)
        ]
    except (RuntimeError, AttributeError):  # no oneDNN int8 in this torch build
        return False
    fbgemm = _fbgemm_linear(codes, _pack_int8(q, scale)[0])
    return all(torch.equal(r, fbgemm[: len(r)]) for r in rows)


# From this many rows on the int8 target multiplies through oneDNN (AMX or VNNI int8), whose cost
# stays flat with the rows where fbgemm's grows: on the 1.5B target's layers (2-core Xeon, AMX)
# 58 / 68 / 65 / 76 / 110 ms at 1 / 2 / 3 / 5 / 16 rows through fbgemm, 80 / 81 / 64 / 60 / 68
# through oneDNN.
INT8_ONEDNN_MIN_ROWS = 3


class Int8RowScaled:
    """int8 with per-row activation ranges (row-independent results; module docstring): fbgemm for
    a row or two, oneDNN from ``INT8_ONEDNN_MIN_ROWS`` rows where it gives fbgemm's bits. The
    rows' map onto codes and its undoing run natively (``int8_rows.c``) where the library builds,
    in torch elsewhere: the same arithmetic, row by row."""

    def __init__(self, weight: torch.Tensor) -> None:
        q, self.scale = quantize_weight_int8(weight)
        self.packed, self.nbytes = _pack_int8(q, self.scale)
        self.row_sums = q.float().sum(dim=1) * self.scale  # W @ 1: what a row's offset adds
        self.levels = _activation_levels()
        self.onednn = None  # (packed weight, zero points) where oneDNN takes many-row products
        if onednn_rows_match_fbgemm():
            self.onednn = (_onednn_pack(q), torch.zeros(q.shape[0], dtype=torch.int64))
            self.nbytes += q.numel()  # a second copy of the int8 weight, in oneDNN's layout
        self.native = native.library()

    def dense(self) -> torch.Tensor:
        return _int8_dense(self.packed)

    def _product(self, codes: torch.Tensor) -> torch.Tensor:
        """W codes, float32 [T, out]: exact integer sums times each channel's scale."""
        if self.onednn is not None and codes.shape[0] >= INT8_ONEDNN_MIN_ROWS:
            packed, zero_points = self.onednn
            return _onednn_linear(codes, packed, self.scale, zero_points)
        return _fbgemm_linear(codes, self.packed)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.native is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self._native_call(x.contiguous(), bias)
        xf = x.float()
        lo, hi = xf.aminmax(dim=1, keepdim=True)  # [T, 1] each
        step = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny) / self.levels
        # Each row's codes run from 0 (its minimum) to exactly `levels` (its maximum), so fbgemm
        # picks scale 1 and zero point 0 whatever the batch and multiplies the codes themselves,
        # as oneDNN is told to: x ~ lo + step * codes, W x ~ step * (W codes) + lo * (W 1).
        w_codes = self._product(torch.round((xf - lo) / step))
        offset = (
            lo * self.row_sums if bias is None else torch.addcmul(bias.float(), lo, self.row_sums)
        )
        return torch.addcmul(offset, w_codes, step).to(x.dtype)

    def _native_call(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, k = x.shape
        bf16 = int(x.dtype == torch.bfloat16)
        codes, lo, step = torch.empty(rows, k), torch.empty(rows), torch.empty(rows)
        self.native.int8_row_codes(
            x.data_ptr(), rows, k, bf16, float(self.levels),
            codes.data_ptr(), lo.data_ptr(), step.data_ptr(),
        )  # fmt: skip
        w_codes = self._product(codes).contiguous()
        y = torch.empty(rows, w_codes.shape[1], dtype=x.dtype)
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        self.native.int8_row_output(
            w_codes.data_ptr(), rows, w_codes.shape[1], lo.data_ptr(), step.data_ptr(),
            self.row_sums.data_ptr(), None if bias is None else bias.data_ptr(), bf16, y.data_ptr(),
        )  # fmt: skip
        return y


# int4 group length along the input features: one scale and offset per this many weights (as
# llama.cpp's 4-bit blocks). On the default pair's greedy outputs a 32-weight group agrees with
# the target as often as the int8 draft does, 64 about 1% less often, for ~4% more kernel time.
INT4_GROUP = 32
Q8_0_GROUP = 32  # GGUF's Q8_0 block
# Up to this many rows an int4 product beats the int8 copy on the default draft's layers (2-core
# Xeon, AMX, all 97 products of one draft forward streamed from memory): torch's kernel 12 vs 18
# ms at one row, 23 vs 25 at four, int8 from six rows on; the native kernel 12 / 15 / 20 ms at 1 /
# 4 / 8 rows against 24-31 for int8 (which wins from about 12 rows).
INT4_MAX_ROWS = 4
NATIVE_INT4_MAX_ROWS = 8


@functools.cache
def many_rows_engine() -> str | None:
    """The quantized engine of an int4 draft's many-row products: oneDNN where it is built in and
    int8 products sum in int32 (VNNI or AMX), else fbgemm (None). fbgemm's cost grows with the
    rows until a prompt-sized catch-up is compute-bound; oneDNN's stays nearly flat to 16 rows and
    reaches AMX speed beyond (the default draft's linear layers on a 2-core Xeon with AMX: 23 / 29 /
    530 ms through fbgemm at 8 / 16 / 512 rows, 22 / 23 / 154 through oneDNN)."""
    if "onednn" in torch.backends.quantized.supported_engines and full_range_activations():
        return "onednn"
    return None


def quantize_weight_int4(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group` inputs: (q [out, in] int32 in 0..15, scale and
    offset [out, in / group] float32), w ~ (q - 8) * scale + offset (the kernel's convention)."""
    out_features, in_features = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int32)
    scale = torch.empty(out_features, in_features // group)
    offset = torch.empty(out_features, in_features // group)
    for start in range(0, out_features, _CHUNK_ROWS):
        w = weight[start : start + _CHUNK_ROWS].detach().float()
        w = w.view(w.shape[0], -1, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        s = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round((w - low[..., None]) / s[..., None]).clamp(0, 15)
        q[start : start + _CHUNK_ROWS] = codes.view(w.shape[0], in_features).int()
        scale[start : start + _CHUNK_ROWS] = s
        offset[start : start + _CHUNK_ROWS] = low + 8 * s
    return q, scale, offset


def _int4_group(in_features: int) -> int:
    if in_features % INT4_GROUP:
        raise ValueError(f"int4 needs input features divisible by {INT4_GROUP}, got {in_features}")
    return INT4_GROUP


class _PackedGroups:
    """Weights packed in groups for the native kernel (``group_native``), which computes every
    row on its own; subclasses pack them (``packed``, ``out_features``, ``native``)."""

    native: ctypes.CDLL
    packed: torch.Tensor
    out_features: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = group_native.linear(self.native, self.packed, self.out_features, x, bias)
        return y.to(x.dtype)


class Int4Exact(_PackedGroups):
    """int4 weights for any row count through the native kernel (``group_native``): each row is
    computed on its own, so a target in this format keeps greedy speculative output equal to its
    plain output. Needs the native kernels (an x86 CPU with AVX-512 VNNI, a C compiler)."""

    def __init__(self, weight: torch.Tensor, stored: Groups | None = None) -> None:
        self.native = _native_library("int4")
        self.out_features = weight.shape[0]
        if stored is None:
            q, scale, offset = quantize_weight_int4(weight.detach(), _int4_group(weight.shape[1]))
            stored = (q, scale, offset - 8 * scale)  # w = scale * q + base
        self.packed = group_native.pack(*(torch.as_tensor(a) for a in stored))
        self.nbytes = self.packed.numel()

    def dense(self) -> torch.Tensor:
        return group_native.unpack(self.packed, self.out_features)


def _native_library(scheme: str) -> ctypes.CDLL:
    lib = native.library()
    if lib is None:
        raise ValueError(
            f"{scheme} weights need the native kernels: an x86 CPU with AVX-512 VNNI and a C "
            "compiler (docs/formats.md)"
        )
    return lib


def quantize_weight_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of 32 inputs, as GGUF's Q8_0: (codes [out, in] int8 in
    -127..127, scale [out, in / 32] float32 holding fp16 values), w ~ code * scale."""
    out_features, in_features = weight.shape
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(out_features, in_features // Q8_0_GROUP)
    for start in range(0, out_features, _CHUNK_ROWS):
        w = weight[start : start + _CHUNK_ROWS].detach().float()
        w = w.view(w.shape[0], -1, Q8_0_GROUP)
        s = (w.abs().amax(dim=-1) / 127).half().float()  # the kernel stores fp16 scales
        q = torch.round(w / s.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
        codes[start : start + _CHUNK_ROWS] = q.clamp(-127, 127).view(w.shape[0], in_features)
        scale[start : start + _CHUNK_ROWS] = s
    return codes, scale


class Q8_0Exact(_PackedGroups):
    """GGUF Q8_0 weights for any row count through the native kernel (``group_native``), each
    row computed on its own (module docstring)."""

    def __init__(self, weight: torch.Tensor, stored: Groups | None = None) -> None:
        self.native = _native_library("q8_0")
        self.out_features = weight.shape[0]
        if weight.shape[1] % Q8_0_GROUP:
            raise ValueError(
                f"q8_0 needs input features divisible by {Q8_0_GROUP}, got {weight.shape[1]}"
            )
        codes, scale = quantize_weight_q8_0(weight) if stored is None else stored[:2]
        self.packed = group_native.pack_q8_0(torch.as_tensor(codes), torch.as_tensor(scale))
        self.nbytes = self.packed.numel()

    def dense(self) -> torch.Tensor:
        return group_native.unpack_q8_0(self.packed, self.out_features)


class _TorchInt4:
    """torch's CPU int4 weight-only kernel, for a few rows (bf16 activations: its fp32 path ran
    ~30x slower)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.group = weight.shape[0], _int4_group(weight.shape[1])
        # The kernel takes output channels in blocks of 16: zero rows pad the last one.
        w, padded = weight.detach(), -self.out_features % 16
        w = torch.cat((w, w.new_zeros(padded, w.shape[1]))) if padded else w
        q, scale, offset = quantize_weight_int4(w, self.group)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        # [in / group, out, 2]: the kernel's layout of (scale, offset) per group and channel, in
        # the dtype of the activations it is given.
        self.scales_and_offsets = (
            torch.stack((scale.t(), offset.t()), dim=-1).to(torch.bfloat16).contiguous()
        )
        self.nbytes = self.packed.numel() + self.scales_and_offsets.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group, self.scales_and_offsets
        )
        y = y[:, : self.out_features].to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)


class Int4Draft:
    """int4 weight-only for a few rows (the native kernel, else torch's), int8-dynamic beyond
    (module docstring)."""

    def __init__(self, weight: torch.Tensor, stored: Groups | None = None) -> None:
        _int4_group(weight.shape[1])
        self.native = native.library()
        if self.native is not None:
            self.few_rows: Int4Exact | _TorchInt4 = Int4Exact(weight, stored)
        else:
            self.few_rows = _TorchInt4(weight)
        self.max_rows = INT4_MAX_ROWS if self.native is None else NATIVE_INT4_MAX_ROWS
        self.many_rows = Int8Dynamic(weight, many_rows_engine())
        self.nbytes = self.few_rows.nbytes + self.many_rows.nbytes

    def dense(self) -> torch.Tensor:
        return self.many_rows.dense()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.many_rows(x, bias)
        return self.few_rows(x, bias)


KERNELS = {
    "int8": Int8RowScaled, "int8-dynamic": Int8Dynamic, "int4": Int4Draft, "q8_0": Q8_0Exact,
    "fp8": FP8RowScaled,
}  # fmt: skip
# Formats that quantize weights where they lie (the GPU's); the others take CPU weights.
ANY_DEVICE = ("fp8",)
# A target's int4 computes every row alone; a draft's switches to an int8 copy for many rows.
TARGET_KERNELS = {**KERNELS, "int4": Int4Exact}
# The code bits of the stored groups each scheme runs as they are.
STORED_BITS = {"int4": 4, "q8_0": 8}


def quantize_model(
    model: nn.Module,
    scheme: str,
    role: str = "target",
    stored: Stored | None = None,
) -> int:
    """Convert every `Linear` of `model` (CPU, plain weights) to `scheme` as the model's role
    ("target" or "draft") takes it; returns how many.

    For "int4" and "q8_0", ``stored`` gives the groups a checkpoint already holds (a GGUF file's
    blocks) by checkpoint weight name, and the model follows the file as llama.cpp does: a layer
    whose every source weight is stored in the scheme's code width keeps those codes rather than
    rounding its float weight onto a new grid. An int4 target runs a layer the file stores in
    more bits (Q6_K, Q8_0: a Q4_K_M file's lm_head, half its v and down projections) as q8_0,
    keeping Q8_0 codes; an int4 draft runs it as int4 all the same (its format only moves
    acceptance)."""
    if scheme == "none":
        return 0
    kernels = TARGET_KERNELS if role == "target" else KERNELS
    if scheme not in kernels:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {sorted(kernels)}")
    count, kept = 0, 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        where = "" if scheme in ANY_DEVICE else "CPU "
        if module.kernel is not None or (where and module.weight.device.type != "cpu"):
            raise ValueError(f"{scheme} needs plain {where}weights (quantize before packing)")
        kernel, found = kernels[scheme], None
        if stored is not None and scheme in STORED_BITS:
            found = _stored_groups(module.weight, checkpoint_sources(name), stored)
            if scheme == "int4" and role == "target" and (found is None or found[0] != 4):
                kernel = Q8_0Exact  # a layer the file holds in more bits than 4
        bits = 4 if kernel in (Int4Exact, Int4Draft) else 8
        groups = found[1] if found is not None and found[0] == bits else None
        module.set_kernel(
            kernel(module.weight, groups) if groups is not None else kernel(module.weight)
        )
        kept += groups is not None
        count += 1
    if stored is not None and scheme in STORED_BITS:
        logger.info("%s %s: %d of %d layers keep the file's codes", scheme, role, kept, count)
    return count


def _stored_groups(
    weight: torch.Tensor, sources: list[str], stored: Stored
) -> tuple[int, Groups] | None:
    """The code bits and stored groups of a (possibly fused) weight, rows stacked in checkpoint
    order; None where a source is not stored in groups, the sources differ in code width, or the
    groups do not give back the loaded weight (a checkpoint changed since its conversion)."""
    parts = [stored(source) for source in sources]
    if any(part is None for part in parts) or len({part.bits for part in parts}) != 1:
        return None
    codes, scale, base = (torch.cat([torch.as_tensor(p[i]) for p in parts]) for i in (1, 2, 3))
    if codes.shape != weight.shape:
        return None
    # The loaded weight is these groups expanded (in the model's dtype): check the first rows.
    rows = min(16, codes.shape[0])
    expanded = codes[:rows].float().view(rows, -1, INT4_GROUP) * scale[:rows, :, None]
    expanded = (expanded + base[:rows, :, None]).view(rows, -1).to(weight.dtype)
    if not torch.equal(expanded, weight[:rows]):
        logger.warning("stored groups of %s differ from the loaded weight; requantizing", sources)
        return None
    return parts[0].bits, (codes, scale, base)
