"""Shared state of one device-check run: options, deadline, results, and the chosen kernels."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from specdec.engine.attention.base import AttentionBackend
from specdec.engine.attention.torch_backend import TorchAttentionBackend
from specdec.engine.gpu_sampling import FlashInferKernels, SamplingKernels, TorchKernels
from specdec.engine.models import ModelArch
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.models.fused_ops import FusedOps, probe_fused_ops


@dataclass
class CheckContext:
    device: torch.device
    dtype: torch.dtype
    cpu_smoke: bool
    out_dir: Path
    parity_shapes: list[str]
    target_shape: str
    draft_shape: str
    batch_sizes: list[int]
    ks: list[int]
    accept_rates: list[float]
    context_len: int
    iters: int
    e2e_steps: int
    page_size: int
    engine_batch: int
    engine_tokens: int
    engine_rounds: int
    deadline: float  # time.monotonic() after which stages are skipped
    tree_batch_sizes: list[int] = field(default_factory=list)
    tree_nodes: list[int] = field(default_factory=list)  # nodes per tree in tree_timing
    engine_gc_freeze: bool = False
    started: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # models and graphs reused by stages

    @property
    def use_flashinfer(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {message}", flush=True)

    def attention_backend(self, arch: ModelArch) -> AttentionBackend:
        """FlashInfer on the GPU (no fallback: the check must fail loudly), torch otherwise."""
        heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        if self.use_flashinfer:
            from specdec.engine.attention.flashinfer_backend import FlashInferAttentionBackend

            backend = FlashInferAttentionBackend(heads, kv_heads, dim, self.device)
            backend.dtype = self.dtype
            return backend
        return TorchAttentionBackend(heads, kv_heads, dim, self.device)

    def torch_backend(self, arch: ModelArch) -> AttentionBackend:
        return TorchAttentionBackend(
            arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, self.device
        )

    def fused_ops(self) -> FusedOps | None:
        """FlashInfer's fused norm/activation/rope kernels on the GPU (probed once), else None."""
        if "fused_ops" not in self.cache:
            ops = probe_fused_ops(self.device, self.dtype) if self.use_flashinfer else None
            self.cache["fused_ops"] = ops
        return self.cache["fused_ops"]

    def fast_model(self, model: DecoderLM) -> DecoderLM:
        """`model` set up as the engine runs it here: fused kernels on the GPU, torch on the CPU."""
        model.use_fused_ops(self.fused_ops())
        return model

    def sampling_kernels(self) -> SamplingKernels:
        return FlashInferKernels() if self.use_flashinfer else TorchKernels()

    def free_memory(self) -> None:
        ops = self.cache.get("fused_ops")
        self.cache.clear()
        if ops is not None:  # a probe result, not memory
            self.cache["fused_ops"] = ops
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
