"""A quantized model's norms, activation and rotary embedding on CPU through the native kernels
(``elementwise.c``, loaded by ``native``): one call each where the torch layers run several
kernels, which is most of a small draft's step beside its weight products and about a tenth of
an int8 target's decode step.

Each value is computed in float32 and rounded once, where the torch layers round between steps,
so a model using these computes slightly different numbers, each row on its own: `build_model`
gives them to quantized models (target or draft, where `fits` holds), whose numbers are the
quantized weights' rather than the checkpoint's reference ones; an unquantized target keeps the
torch layers.
"""

from __future__ import annotations

import ctypes

import torch

_MAX_HIDDEN = 16384  # elementwise.c's row buffer


def fits(hidden_size: int, dtype: torch.dtype) -> bool:
    """Whether a model of this width and dtype runs on the kernels."""
    return dtype in (torch.float32, torch.bfloat16) and hidden_size <= _MAX_HIDDEN


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


class NativeElementwiseOps:
    """`ElementwiseOps` (``specdec.engine.models.layers``) for float32 and bfloat16 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, n = x.shape
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.rms_norm(x.data_ptr(), weight.data_ptr(), rows, n, eps, _bf16(x), out.data_ptr())
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), computed in place in x and residual."""
        rows, n = x.shape
        x, residual = x.contiguous(), residual.contiguous()
        self.lib.add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), rows, n, eps, _bf16(x)
        )
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        half = width // 2
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(rows, half)
        self.lib.silu_and_mul(gate_up.data_ptr(), rows, half, _bf16(gate_up), out.data_ptr())
        return out

    def rope_(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> None:
        head_dim = q.shape[-1]
        if not all(t.stride(-1) == 1 and t.stride(-2) == head_dim for t in (q, k)):
            raise ValueError("rope_ needs each token's heads side by side in memory")
        positions = positions.to(torch.int64).contiguous()
        self.lib.rope(
            positions.data_ptr(),
            positions.numel(),
            q.data_ptr(),
            q.stride(0),
            q.shape[1],
            k.data_ptr(),
            k.stride(0),
            k.shape[1],
            head_dim,
            cos_sin.data_ptr(),
            _bf16(q),
        )
