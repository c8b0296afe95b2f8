"""Attention backends: one contract (paged KV, ragged batch, bottom-right causal), several kernels."""

from specdec.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    build_attention_metadata,
)
from specdec.engine.attention.registry import available_backends, create_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_backends",
    "build_attention_metadata",
    "create_backend",
]
