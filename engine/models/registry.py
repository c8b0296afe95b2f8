"""config.json architecture name -> model class (all current families share DecoderLM)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from specdec.engine.models.arch import ModelArch, model_arch_from_hf_config
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.models.quant import quantize_model

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "Qwen2ForCausalLM": DecoderLM,
    "LlamaForCausalLM": DecoderLM,
    "MistralForCausalLM": DecoderLM,
}


def instantiate_model(arch: ModelArch, dtype: torch.dtype, device: torch.device) -> DecoderLM:
    """An uninitialised model built directly in dtype on device (never a second full copy)."""
    cls = MODEL_CLASSES[arch.architecture]
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(arch)
    finally:
        torch.set_default_dtype(previous_dtype)


def build_model(
    arch: ModelArch,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
) -> DecoderLM:
    """Instantiate, load weights tensor by tensor, and prepare kernels for the device: the linear
    layers in `quantization` (a scheme of `specdec.engine.models.quant`; CPU only), else packed
    for oneDNN on CPU."""
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on CPU only, not on {device.type}")
    model = instantiate_model(arch, dtype, device)
    model.load_weights(weights)
    model.rope.to(torch.float32)
    model.eval()
    model.quantization = quantization
    quantize_model(model, quantization)
    if device.type == "cpu":
        model.pack_linear_weights()
    return model


__all__ = ["ModelArch", "build_model", "model_arch_from_hf_config"]
