"""int8 weight formats for `Linear` on CPU, and applying one to a whole model.

Both schemes hold symmetric int8 weights with one scale per output channel, prepacked for fbgemm's
dynamic int8 linear (VNNI / AVX2 int8 dot products, int32 sums), which reads a quarter of the
bytes of fp32 and measured fastest of the int8 paths torch offers on CPU (docs/formats.md).

- ``Int8Dynamic`` (scheme "int8-dynamic"): fbgemm as it is. It picks one activation scale and
  zero point per call from the whole batch's range, so a row's result depends on its batch-mates;
  offered for the draft only (a draft may be lossy: the rejection rule verifies every token).
- ``Int8RowScaled`` (scheme "int8"): each activation row is divided by its own largest magnitude,
  and one extra row holding -1 and +1 joins the batch, so every call's range is exactly [-1, 1]:
  fbgemm's activation scale and zero point are then the same constants whatever the batch, each
  row's products are exact integer sums, and multiplying the row's magnitude back gives a row
  whose value never depends on the other rows. Greedy speculative output stays equal to greedy
  plain output of the same int8 model (tests/test_formats.py checks this on the machine).
"""

from __future__ import annotations

import warnings

import torch
from specdec.engine.models.layers import Linear
from torch import nn

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


def _fbgemm_pack(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fbgemm's prepacked form of the per-channel int8 weight, and the bytes it stands for."""
    q, scale = quantize_weight_int8(weight)
    zero_points = torch.zeros(scale.numel(), dtype=torch.int64)
    with warnings.catch_warnings():
        # torch flags its quantized tensor type as deprecated; the fbgemm ops it feeds remain.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(qweight, None), q.numel() + 4 * scale.numel()


def _fbgemm_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # reduce_range: 7-bit activations, so that AVX2's pairwise int8 products cannot saturate.
    return torch.ops.quantized.linear_dynamic(x, packed, True)


def _fbgemm_dense(packed: torch.Tensor) -> torch.Tensor:
    """The dequantized float32 weight of a prepacked one."""
    return torch.ops.quantized.linear_unpack(packed)[0].dequantize()


class Int8Dynamic:
    """fbgemm dynamic int8 linear: one activation scale per call (rows depend on each other)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed, self.nbytes = _fbgemm_pack(weight)

    def dense(self) -> torch.Tensor:
        return _fbgemm_dense(self.packed)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = _fbgemm_linear(x.float(), self.packed)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


class Int8RowScaled:
    """fbgemm int8 with per-row activation scales (row-independent results; module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed, self.nbytes = _fbgemm_pack(weight)
        self.range_row = torch.zeros(1, weight.shape[1])
        self.range_row[0, :2] = torch.tensor([-1.0, 1.0])

    def dense(self) -> torch.Tensor:
        return _fbgemm_dense(self.packed)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xf = x.float()
        magnitude = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [T, 1]
        y = _fbgemm_linear(torch.cat((xf / magnitude, self.range_row)), self.packed)[:-1]
        y = y * magnitude
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


KERNELS = {"int8": Int8RowScaled, "int8-dynamic": Int8Dynamic}


def quantize_model(model: nn.Module, scheme: str) -> int:
    """Convert every `Linear` of `model` (CPU, plain weights) to `scheme`; returns how many."""
    if scheme == "none":
        return 0
    if scheme not in KERNELS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {sorted(KERNELS)}")
    kernel = KERNELS[scheme]
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            if module.kernel is not None or module.weight.device.type != "cpu":
                raise ValueError("quantize_model needs plain CPU weights (quantize before packing)")
            module.set_kernel(kernel(module.weight))
            count += 1
    return count
