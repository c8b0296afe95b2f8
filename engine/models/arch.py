"""The architecture hyper-parameters a model needs, read from a Hugging Face config.json dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.engine.errors import ConfigError


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """K and V, every layer, for one token."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_size


# Architecture name in config.json -> whether q/k/v carry a bias by default.
FAMILY_DEFAULT_BIAS: dict[str, bool] = {
    "Qwen2ForCausalLM": True,
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
}


MODEL_TYPE_TO_ARCH = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in FAMILY_DEFAULT_BIAS), None)
    if name is None and not archs:  # configs built in memory may only name the model type
        name = MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""))
    if name is None:
        raise ConfigError(
            f"unsupported architecture {archs!r}; supported: {sorted(FAMILY_DEFAULT_BIAS)}"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    # Newer transformers nest theta (and scaling) under rope_parameters.
    params = cfg.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = params.get("rope_theta", 10000.0)
    if rope_scaling is None and params.get("rope_type", "default") != "default":
        rope_scaling = params
    return ModelArch(
        architecture=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", FAMILY_DEFAULT_BIAS[name])),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )
