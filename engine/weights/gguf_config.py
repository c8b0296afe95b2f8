"""Turn GGUF metadata into a Hugging Face ``config.json`` dict for the Qwen2 and Llama families.

GGUF keeps hyper-parameters as ``<arch>.<key>`` metadata; the Hugging Face config names them
differently and also needs a few values that GGUF only implies (tied embeddings, head_dim, the
Llama 3 RoPE scaling that llama.cpp stores as a ``rope_freqs`` tensor instead of metadata).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from specdec.engine.errors import ModelNotFoundError

# Looks up one metadata value by its full key; returns the default when the key is absent.
MetadataGetter = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto a transformers model class."""

    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders the rows of Q/K for `llama` files (rotate-half -> interleaved
    # RoPE layout); `qwen2` files are written unpermuted.
    permute_qk: bool
    extra_fields: Callable[[MetadataGetter, Mapping[str, tuple[int, ...]], int], dict[str, Any]]


def _qwen2_extra(
    meta: MetadataGetter, shapes: Mapping[str, tuple[int, ...]], num_layers: int
) -> dict[str, Any]:
    # GGUF has no sliding-window information; the Qwen2.5 models we target do not use it.
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers}


def _llama_extra(
    meta: MetadataGetter, shapes: Mapping[str, tuple[int, ...]], num_layers: int
) -> dict[str, Any]:
    return {
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in shapes,
        "pretraining_tp": 1,
    }


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", permute_qk=False, extra_fields=_qwen2_extra),
    "llama": ArchSpec("LlamaForCausalLM", "llama", permute_qk=True, extra_fields=_llama_extra),
}

# (low_freq_factor, high_freq_factor, original_max_position_embeddings) used by the released
# Llama 3.x models; a rope_freqs tensor is matched against these to recover the HF parameters.
_LLAMA3_ROPE_CANDIDATES: tuple[tuple[float, float, int], ...] = ((1.0, 4.0, 8192),)


def arch_spec(architecture: str) -> ArchSpec:
    """The spec of a supported GGUF architecture, or a ModelNotFoundError naming the supported."""
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ModelNotFoundError(
            f"GGUF architecture {architecture!r} is not supported; supported architectures: "
            f"{sorted(ARCHITECTURES)} (Qwen2/Qwen2.5 and Llama-family models)."
        )
    return spec


def clean_float(value: float) -> float:
    """GGUF stores floats as float32; give back the shortest decimal (1e-6, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _single_int(value: Any, key: str) -> int:
    # Some GGUF files store per-layer arrays; we accept them only when every layer agrees.
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelNotFoundError(f"per-layer values for {key} are not supported ({value}).")
        value = value[0]
    return int(value)


def llama3_freq_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original_ctx: int
) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling.

    For frequency f_i = theta^(-2i/d) with wavelength w_i = 2*pi/f_i: high frequencies
    (w_i < original_ctx/high) are kept (divisor 1), low frequencies (w_i > original_ctx/low) are
    divided by ``factor``, and in between the divisor is 1 / ((1 - s)/factor + s) with
    s = (original_ctx/w_i - low) / (high - low), a smooth blend of the two.
    """
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2.0 * math.pi / freqs
    smooth = (original_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original_ctx / high, 1.0, blended)
    return np.where(wavelen > original_ctx / low, factor, divisors)


def _rope_scaling_from_freqs(
    freq_factors: np.ndarray, theta: float, head_dim: int, meta_original_ctx: int | None
) -> dict[str, Any] | None:
    factors = freq_factors.astype(np.float64).ravel()
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    candidates = list(_LLAMA3_ROPE_CANDIDATES)
    if meta_original_ctx:
        candidates.insert(0, (1.0, 4.0, int(meta_original_ctx)))
    for low, high, original_ctx in candidates:
        expected = llama3_freq_factors(theta, head_dim, factor, low, high, original_ctx)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": clean_float(factor),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original_ctx,
            }
    raise ModelNotFoundError(
        "the GGUF file has a rope_freqs tensor that matches no known Llama 3 RoPE scaling; "
        "this model's RoPE variant is not supported."
    )


def _rope_scaling_from_metadata(meta: MetadataGetter, arch: str) -> dict[str, Any] | None:
    kind = meta(f"{arch}.rope.scaling.type", None)
    factor = meta(f"{arch}.rope.scaling.factor", None)
    legacy_linear = meta(f"{arch}.rope.scale_linear", None)
    if kind is None and legacy_linear is not None and clean_float(legacy_linear) != 1.0:
        return {"rope_type": "linear", "factor": clean_float(legacy_linear)}
    if kind is None or kind == "none":
        return None
    if factor is None:
        raise ModelNotFoundError(f"RoPE scaling {kind!r} without {arch}.rope.scaling.factor.")
    if kind == "linear":
        return {"rope_type": "linear", "factor": clean_float(factor)}
    if kind == "yarn":
        original_ctx = meta(f"{arch}.rope.scaling.original_context_length", None)
        if original_ctx is None:
            raise ModelNotFoundError("YaRN RoPE scaling without original_context_length.")
        return {
            "rope_type": "yarn",
            "factor": clean_float(factor),
            "original_max_position_embeddings": int(original_ctx),
        }
    raise ModelNotFoundError(f"RoPE scaling type {kind!r} is not supported.")


def build_hf_config(
    meta: MetadataGetter,
    shapes: Mapping[str, tuple[int, ...]],
    load_small_tensor: Callable[[str], np.ndarray],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Hugging Face config dict from GGUF metadata.

    ``shapes`` maps GGUF tensor names to their PyTorch-order shapes; ``load_small_tensor`` reads
    a (small) tensor as float32, used only for ``rope_freqs``.
    """
    arch = meta("general.architecture", None)
    if arch is None:
        raise ModelNotFoundError("the GGUF file has no general.architecture metadata.")
    spec = arch_spec(arch)

    def required(key: str) -> Any:
        value = meta(f"{arch}.{key}", None)
        if value is None:
            raise ModelNotFoundError(f"the GGUF file lacks the {arch}.{key} metadata.")
        return value

    if "token_embd.weight" not in shapes:
        raise ModelNotFoundError("the GGUF file has no token_embd.weight tensor.")
    vocab_size, hidden_size = shapes["token_embd.weight"]
    num_layers = int(required("block_count"))
    num_heads = _single_int(required("attention.head_count"), "head_count")
    num_kv_heads = _single_int(meta(f"{arch}.attention.head_count_kv", num_heads), "head_count_kv")
    head_dim = int(meta(f"{arch}.attention.key_length", hidden_size // num_heads))
    theta = clean_float(meta(f"{arch}.rope.freq_base", 10000.0))

    rope_scaling = _rope_scaling_from_metadata(meta, arch)
    if "rope_freqs.weight" in shapes:
        original_ctx = meta(f"{arch}.rope.scaling.original_context_length", None)
        freq_scaling = _rope_scaling_from_freqs(
            load_small_tensor("rope_freqs.weight"), theta, head_dim, original_ctx
        )
        rope_scaling = freq_scaling or rope_scaling

    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size),
        "intermediate_size": _single_int(required("feed_forward_length"), "feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": clean_float(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": meta("tokenizer.ggml.padding_token_id", None),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # transformers 4.x reads torch_dtype, 5.x reads dtype.
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }
    config.update(spec.extra_fields(meta, shapes, num_layers))
    return config
