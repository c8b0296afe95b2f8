"""Decoder-only model families (Qwen2, Llama) over a flat ragged batch and a paged KV cache."""

from specdec.engine.models.registry import ModelArch, build_model, model_arch_from_hf_config

__all__ = ["ModelArch", "build_model", "model_arch_from_hf_config"]
