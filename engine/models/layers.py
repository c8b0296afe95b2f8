"""Building blocks shared by the model families: linear, RMSNorm, rotary embedding, SwiGLU.

RMSNorm, RotaryEmbedding and SwiGLU hold an ``ops`` slot: None runs the torch code below (the
reference, and the CPU path); an `ElementwiseOps` (`specdec.engine.models.fused_ops.FusedOps`, FlashInfer's
fused kernels) runs instead (`DecoderLM.use_fused_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ElementwiseOps(Protocol):
    """The fused kernels a layer may hand its element-wise work to."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope_(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> None: ...


def onednn_available(dtype: torch.dtype) -> bool:
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class OneDNNPacked:
    """A weight reordered once into oneDNN's blocked layout for this machine's kernels.

    On CPU the default (MKL) GEMM gets several times slower from 1 to 2..16 rows, which makes
    verifying k draft tokens cost far more than decoding one; the packed path costs nearly the same
    for 1..16 rows. Measured on this project's CPUs it computes each row identically for every
    row count from 2 (fp32: to 300 rows tried; bf16 with AMX: to 32 rows, beyond which it switches
    to a kernel whose rows depend on the row count), so one-row inputs are padded to two rows: a
    token's logits then do not depend on how many other rows share a forward of up to 32 rows,
    and greedy speculative output equals greedy plain output bit for bit within that envelope
    (docs/formats.md).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.nbytes = weight.numel() * weight.element_size()

    def dense(self) -> torch.Tensor:
        return self.packed.to_dense()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 1:
            y = torch.ops.mkldnn._linear_pointwise(
                x.expand(2, -1), self.packed, bias, "none", [], ""
            )
            return y[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight moves into a `kernel` (a oneDNN-packed copy, or an int8
    format from `specdec.engine.models.quant`) that replaces the plain tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel: LinearKernel | None = None

    def pack_for_cpu(self) -> bool:
        """Reorder the weight for oneDNN (fp32, or bf16 where oneDNN supports it) and drop the
        plain copy. True if packed."""
        w = self.weight
        if self.kernel is not None or w.device.type != "cpu" or not onednn_available(w.dtype):
            return False
        self.set_kernel(OneDNNPacked(w))
        return True

    def row_subset(self, rows: torch.Tensor) -> Linear:
        """A Linear computing only output features ``rows`` ([n] int64) of this one, in the same
        format (a kernel is built again over the gathered rows): the n rows are gathered once."""
        weight = self.weight if self.kernel is None else self.kernel.dense()
        idx = rows.to(device=weight.device, dtype=torch.int64)
        with torch.device(weight.device):
            sub = Linear(self.in_features, len(idx), bias=self.bias is not None)
        sub.weight = nn.Parameter(
            weight.detach().index_select(0, idx).to(self.weight.dtype), requires_grad=False
        )
        if self.bias is not None:
            sub.bias = nn.Parameter(self.bias.detach().index_select(0, idx), requires_grad=False)
        if self.kernel is not None:
            sub.set_kernel(type(self.kernel)(sub.weight))
        return sub

    def set_kernel(self, kernel: LinearKernel) -> None:
        """Compute through `kernel` from now on; the plain weight is released."""
        self.kernel = kernel
        # Keep an empty placeholder so the parameter still names the layer in state-dict listings
        # without holding its memory twice.
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes the layer's weight occupies in whatever form it is kept."""
        if self.kernel is not None:
            return self.kernel.nbytes
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        bias = self.bias.detach() if self.bias is not None else None
        return self.kernel(x, bias)


class LinearKernel(Protocol):
    """A weight held in a computing format: y = x W^T + b in x's dtype."""

    nbytes: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def dense(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (dequantized where it is quantized)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops: ElementwiseOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 as the reference implementations do, whatever the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The fused kernel overwrites x and residual."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x frequency-dependent RoPE scaling: long wavelengths stretched by `factor`."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


SUPPORTED_ROPE_SCALING = ("default", "llama3", "linear")


# (q [T, Hq, D], k [T, Hkv, D]) -> the same, rotated to their positions
Rotation = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout used by both Qwen2 and Llama checkpoints)."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        # float32 throughout, as the reference checkpoints' own code computes it, so that positions
        # far into a long context round exactly as they do there.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponent)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif kind == "linear":
            inv_freq = inv_freq / float((scaling or {})["factor"])
        elif kind != "default":
            raise ValueError(f"rope scaling {kind!r} is not supported ({SUPPORTED_ROPE_SCALING})")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.ops: ElementwiseOps | None = None
        self._cos_sin: torch.Tensor | None = None

    def cos_sin_cache(self) -> torch.Tensor:  # [max_positions, D] float32
        """cos and sin side by side, the table layout the fused kernel reads (built once)."""
        if self._cos_sin is None or self._cos_sin.device != self.cos.device:
            self._cos_sin = torch.cat((self.cos, self.sin), dim=-1).float().contiguous()
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, Hq, D]; k [T, Hkv, D]
        return self.at(positions)(q, k)

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of q and k at ``positions`` ([T]), for every layer of one forward: the
        angles are gathered once, and q and k turn as one tensor (element-wise work, so the same
        bits, in half the kernel calls a small model's CPU decode step is mostly made of)."""
        if self.ops is not None:  # rotates q and k where they are
            ops, table = self.ops, self.cos_sin_cache()

            def fused(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                ops.rope_(positions, q, k, table)
                return q, k

            return fused
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)

        def rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qk = _rotate(torch.cat((q, k), dim=1), cos, sin)  # [T, Hq + Hkv, D]
            return qk[:, : q.shape[1]], qk[:, q.shape[1] :]

        return rotate


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix product."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.ops: ElementwiseOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
