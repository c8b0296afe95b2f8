"""Resolve a model name/path, read its config, build it with weights, load its tokenizer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from specdec.engine.cpu_features import has_fast_bf16, has_fast_int4_draft
from specdec.engine.models import ModelArch, build_model, model_arch_from_hf_config
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.models.quant import STORED_BITS

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class LoadedModel:
    path: Path
    arch: ModelArch
    model: DecoderLM
    tokenizer: object | None  # specdec.engine.tokenizer.Tokenizer
    load_seconds: float


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from specdec.engine.errors import ConfigError

        raise ConfigError("device 'cuda' requested but CUDA is not available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on CUDA, and on CPUs with bf16 matrix units (AMX or AVX-512 BF16), where
    oneDNN's bf16 products read half the bytes of fp32 ones; fp32 on other CPUs, where bf16 is
    emulated and slower than fp32. Both keep greedy speculative output equal to plain output."""
    if name == "auto":
        if device.type == "cuda" or has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def resolve_draft_quantization(name: str, device: torch.device) -> str:
    """'auto': int4 on CPUs where its kernels are fast (AVX-512 and fbgemm: measured there to
    draft in half a bf16 draft's time at the same acceptance); 'none' on CUDA and on other CPUs,
    where it is not measured. A draft's format changes acceptance, never the output."""
    if name != "auto":
        return name
    if device.type == "cpu" and has_fast_int4_draft():
        return "int4"
    return "none"


def load_model(
    name_or_path: str,
    dtype: torch.dtype,
    device: torch.device,
    load_tokenizer: bool = True,
    progress: bool = True,
    quantization: str = "none",
    role: str = "target",
) -> LoadedModel:
    from specdec.engine.weights import (
        GGUFModel,
        converted_from,
        iter_safetensors_weights,
        load_hf_config,
        resolve_model,
    )

    start = time.perf_counter()
    path = resolve_model(name_or_path, progress=progress)
    arch = model_arch_from_hf_config(load_hf_config(path))
    # An int4 or q8_0 model converted from a GGUF file keeps the file's own codes where it has them.
    source = converted_from(path) if quantization in STORED_BITS else None
    stored = GGUFModel(source).stored_groups if source is not None else None
    model = build_model(
        arch, iter_safetensors_weights(path), dtype, device, quantization, role, stored
    )
    tokenizer = None
    if load_tokenizer and any((path / f).exists() for f in TOKENIZER_FILES):
        from specdec.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s) in %.1f s", path, arch.architecture, seconds)
    return LoadedModel(path, arch, model, tokenizer, seconds)


def check_quantization(loaded: LoadedModel, quantization: str, role: str) -> None:
    """A model handed to the engine already built must be in the format the config names."""
    if loaded.model.quantization != quantization:
        from specdec.engine.errors import ConfigError

        raise ConfigError(
            f"the {role} model was built with quantization {loaded.model.quantization!r} but "
            f"the config asks for {quantization!r}"
        )
