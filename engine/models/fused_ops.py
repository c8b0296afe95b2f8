"""Fused element-wise kernels for the decoder on CUDA: RMSNorm (with the residual add folded in),
SiLU-and-multiply and rotary embedding, from FlashInfer.

Why: at small batches a 7B decode step is a string of ~45 kernels per layer, most of them tiny
element-wise ops (the float32 RMSNorm alone is seven). Inside a CUDA graph each still costs a few
microseconds of GPU time, which on an H200 doubled the step over its weight-reading floor. Fused,
a layer is about a dozen kernels.

Semantics equal the torch layers up to bf16 rounding: the norm and the rotation run in float32
inside the kernel and round once at the end, where the torch path rounds the normalised value
before multiplying by the weight (as the Hugging Face reference does). `probe_fused_ops` checks
each kernel against the torch layer at start-up; anything but agreement within bf16 tolerance
keeps the torch path.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from specdec.engine.models.layers import RMSNorm, RotaryEmbedding

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = 2e-2  # relative L2 error; bf16 rounding lands near 4e-3


class FusedOps:
    """FlashInfer's norm, activation and rope kernels behind the calls the layers make."""

    def __init__(self) -> None:
        self._norm: Any = importlib.import_module("flashinfer.norm")
        self._act: Any = importlib.import_module("flashinfer.activation")
        self._rope: Any = importlib.import_module("flashinfer.rope")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rmsnorm(x, weight, eps, enable_pdl=False)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), computed in place in x and residual."""
        self._norm.fused_add_rmsnorm(x, residual, weight, eps, enable_pdl=False)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act.silu_and_mul(gate_up, enable_pdl=False)

    def rope_(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq, D], last dim contiguous
        k: torch.Tensor,  # [T, Hkv, D]
        cos_sin: torch.Tensor,  # [max_positions, D] float32: cos half, then sin half
    ) -> None:
        """Rotate-half RoPE applied to q and k in place."""
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, q.shape[-1], cos_sin, is_neox=True
        )


def probe_fused_ops(device: torch.device, dtype: torch.dtype) -> FusedOps | None:
    """FusedOps when every kernel runs on `device` and matches the torch layers, else None (with
    one log line). The first call JIT-compiles FlashInfer's modules."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        ops = FusedOps()
        worst = _compare_with_torch(ops, device, dtype)
    except Exception as exc:  # missing package, failed build, kernel error
        logger.info(
            "fused kernels unavailable (%s: %s); using torch layers", type(exc).__name__, exc
        )
        return None
    if worst > PROBE_TOLERANCE:
        logger.warning(
            "fused kernels disagree with torch (rel err %.3g); using torch layers", worst
        )
        return None
    return ops


def _compare_with_torch(ops: FusedOps, device: torch.device, dtype: torch.dtype) -> float:
    """Largest relative error of the fused kernels against the torch layers on random inputs."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        got, want = got.float(), want.float()
        if not torch.isfinite(got).all():
            return float("inf")
        return float((got - want).norm() / want.norm().clamp_min(1e-12))

    tokens, hidden, heads, kv_heads, head_dim = 5, 256, 4, 2, 64
    with torch.device(device):
        norm = RMSNorm(hidden, 1e-6).to(dtype)
        rope = RotaryEmbedding(head_dim, 4096, 1e6, None)
    norm.weight.copy_(1 + 0.1 * randn(hidden))
    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    errors = [rel(ops.rms_norm(x, norm.weight, norm.eps), norm(x))]
    want_h, want_r = norm(x + residual), x + residual
    got_h, got_r = ops.add_rms_norm(x.clone(), residual.clone(), norm.weight, norm.eps)
    errors += [rel(got_h, want_h), rel(got_r, want_r)]
    gate_up = randn(tokens, 256)
    gate, up = gate_up.split(128, dim=-1)
    errors.append(rel(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up))
    positions = torch.tensor([0, 1, 17, 300, 4000], device=device)
    q, k = randn(tokens, heads, head_dim), randn(tokens, kv_heads, head_dim)
    want_q, want_k = rope(positions, q, k)
    ops.rope_(positions, q, k, rope.cos_sin_cache())
    errors += [rel(q, want_q), rel(k, want_k)]
    return max(errors)
