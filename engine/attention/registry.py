"""Name -> backend class. FlashInfer registers itself only when it imports."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    _BACKENDS[name] = cls


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> AttentionBackend:
    """Instantiate backend `name`; 'auto' means FlashInfer on CUDA when it works, else torch."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            from engine.attention.selection import flashinfer_usable

            if flashinfer_usable(device):
                name = "flashinfer"
    if name not in _BACKENDS and name == "flashinfer":
        from engine.attention.selection import flashinfer_usable

        flashinfer_usable(device)
    if name not in _BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available here: {available_backends()}"
        )
    return _BACKENDS[name](num_heads, num_kv_heads, head_dim, device)
