"""Name -> lazy factory of a backend class: a backend's module (and its kernels' package) is
imported only when that backend is asked for, and no backend module imports the registry."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
from specdec.engine.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


def _lazy(module: str, name: str) -> Callable[[], type[AttentionBackend]]:
    return lambda: getattr(importlib.import_module(module), name)


_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": _lazy("specdec.engine.attention.torch_backend", "TorchAttentionBackend"),
    "flashinfer": _lazy(
        "specdec.engine.attention.flashinfer_backend", "FlashInferAttentionBackend"
    ),
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> AttentionBackend:
    """Instantiate backend `name`; 'auto' means FlashInfer on CUDA when it works, else torch."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            from specdec.engine.attention.selection import flashinfer_usable

            if flashinfer_usable(device):
                name = "flashinfer"
    if name not in _BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available here: {available_backends()}"
        )
    return _BACKENDS[name]()(num_heads, num_kv_heads, head_dim, device)
