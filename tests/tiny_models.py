"""Tiny random-weight models shared by the tests (transformers reference + our engine on them)."""

from __future__ import annotations

from pathlib import Path

import torch
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.loader import LoadedModel
from specdec.engine.models import build_model, model_arch_from_hf_config
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_hf_model(
    family: str = "qwen2",
    seed: int = 0,
    vocab: int = 128,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict | None = None,
):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
    )
    if family == "qwen2":
        cfg = Qwen2Config(rope_theta=1_000_000.0, **common)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(rope_theta=500_000.0, rope_scaling=rope_scaling, **common)
        model = LlamaForCausalLM(cfg)
    model.eval()
    # Random init in transformers is small; scale up so logits are not nearly uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if p.dim() == 1 else 1.0 / p.shape[-1] ** 0.5 * 2)
    return model


def loaded_from_hf(
    hf_model, dtype=torch.float32, device="cpu", quantization: str = "none", role: str = "target"
) -> LoadedModel:
    cfg = hf_model.config.to_dict()
    arch = model_arch_from_hf_config(cfg)
    weights = ((n, t.detach().clone()) for n, t in hf_model.state_dict().items())
    model = build_model(arch, weights, dtype, torch.device(device), quantization, role)
    return LoadedModel(Path("."), arch, model, None, 0.0)


def make_engine(target_hf, draft_hf=None, **overrides) -> LLMEngine:
    defaults = dict(
        model="tiny",
        draft_model="tiny-draft" if draft_hf is not None else None,
        speculative_method="draft_model" if draft_hf is not None else "none",
        max_model_len=256,
        num_kv_blocks=128,
        page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cpu",
        dtype="float32",
        # Tests of the engine's logic pin the draft's format (a test asking for another says so).
        draft_quantization="none",
        controller_warmup=False,
    )
    defaults.update(overrides)
    if defaults["speculative_method"] != "draft_model":
        draft_hf = None
    cfg = EngineConfig(**defaults)
    # Weights on the engine's device, dtype and formats (CPU float32 unless a test asks).
    where = (getattr(torch, cfg.dtype), cfg.device)
    draft = None
    if draft_hf is not None:
        draft = loaded_from_hf(draft_hf, *where, quantization=cfg.draft_quantization, role="draft")
    target = loaded_from_hf(target_hf, *where, quantization=cfg.quantization)
    return LLMEngine(cfg, target=target, draft=draft, progress=False)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def noisy_copy(hf_model, scale: float, seed: int = 0):
    """A draft that agrees with hf_model most of the time: same weights plus Gaussian noise."""
    import copy

    draft = copy.deepcopy(hf_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft
