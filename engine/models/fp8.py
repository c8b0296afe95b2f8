"""FP8 weights for `Linear` on GPUs with FP8 tensor cores (H100, H200; compute capability 8.9+).

``FP8RowScaled`` (scheme "fp8", target or draft) holds the weight as float8 e4m3 with one float32
scale per output channel (its largest magnitude over 448, e4m3's largest finite value), half the
bytes of bf16. Each call rounds every activation row to e4m3 with its own scale (the row's
largest magnitude over 448) and multiplies with ``torch._scaled_mm`` in its row-wise scaling mode:
on CUDA the tensor cores' FP8 product with float32 sums and a bf16 result, each output scaled by
its row's and its channel's scale. A row's codes and scale come from that row alone; its sums,
as with bf16 weights on CUDA, follow the GEMM's tiling, which depends on the batch, so greedy
speculative output is not guaranteed to equal plain output (docs/gpu.md says which formats keep
it).

On CPU the same call runs torch's reference product: correct to float8 rounding but far slower
than bf16 and not row-independent, so the engine offers fp8 on CUDA only; CPU runs it in tests.
"""

from __future__ import annotations

import torch
from specdec.engine.errors import ConfigError

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# A scale never reaches 0: an all-zero row or channel divides by this and stays all zeros.
_TINY_SCALE = 1e-12
# torch._scaled_mm takes inner and output widths in multiples of 16 (the tensor cores' tile).
FP8_ALIGN = 16


def check_fp8_device(device: torch.device) -> None:
    """ConfigError unless ``device`` multiplies FP8 (a CUDA GPU of compute capability 8.9+)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"fp8 weights need FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of a [rows, width] tensor and each row's float32 scale ([rows, 1])."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_min(_TINY_SCALE)
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


class FP8RowScaled:
    """y = x W^T (+ b) with W in e4m3 per output channel and x in e4m3 per row (module
    docstring); x and y in the model's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        if in_features % FP8_ALIGN or out_features % FP8_ALIGN:
            raise ValueError(
                f"fp8 weights need both widths in multiples of {FP8_ALIGN}, got "
                f"[{out_features}, {in_features}]"
            )
        codes, scale = quantize_rows_fp8(weight)
        self.codes = codes.contiguous()  # [out, in]: its transpose is the column-major operand
        self.scale = scale.reshape(1, out_features).contiguous()  # [1, out]
        self.nbytes = self.codes.numel() + 4 * out_features

    def dense(self) -> torch.Tensor:
        return self.codes.float() * self.scale.reshape(-1, 1)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        codes, scale = quantize_rows_fp8(x.reshape(-1, shape[-1]))
        y = torch._scaled_mm(
            codes,
            self.codes.t(),
            scale_a=scale,
            scale_b=self.scale,
            bias=None,
            out_dtype=torch.bfloat16 if x.is_cuda else torch.float32,
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], -1)
