"""config.json architecture name -> model class (all current families share DecoderLM)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from specdec.engine.models import native
from specdec.engine.models.arch import ModelArch, model_arch_from_hf_config
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.models.native_elementwise import NativeElementwiseOps, fits
from specdec.engine.models.quant import ANY_DEVICE, Stored, quantize_model

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
    role: str = "target",
    stored: Stored | None = None,
) -> DecoderLM:
    """Instantiate, load weights tensor by tensor, and prepare kernels for the device: the linear
    layers in `quantization` (a scheme of `specdec.engine.models.quant`), else packed
    for oneDNN on CPU, as ``role`` ("target" or "draft") takes the scheme (fp8 on any device,
    every other scheme on CPU). A quantized model also
    runs its norms, activation and rope through the native kernels where they build
    (`native_elementwise`): its numbers are the quantized weights' anyway, never the checkpoint's
    reference ones, and the kernels compute each row alone. ``stored``: a checkpoint's own
    groups of codes, which int4 and q8_0 keep (`quant.quantize_model`)."""
    if quantization not in ("none", *ANY_DEVICE) and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on CPU only, not on {device.type}")
    model = instantiate_model(arch, dtype, device)
    model.load_weights(weights)
    model.rope.to(torch.float32)
    model.eval()
    model.quantization = quantization
    quantize_model(model, quantization, role, stored)
    if device.type == "cpu":
        model.pack_linear_weights()
        if quantization != "none":
            model.use_fused_ops(native_elementwise_ops(arch, dtype))
    return model


def native_elementwise_ops(arch: ModelArch, dtype: torch.dtype) -> NativeElementwiseOps | None:
    """The native norm, activation and rope kernels for a model of this shape, where they build
    and fit (None: the torch layers)."""
    lib = native.library()
    if lib is None or not fits(arch.hidden_size, dtype):
        return None
    return NativeElementwiseOps(lib)


__all__ = ["ModelArch", "build_model", "model_arch_from_hf_config"]
