"""A tiny random target/draft pair whose draft agrees with the target often, for smoke runs.

The target's layers after the first barely change the residual stream (their output projections
are scaled down), so a one-layer draft sharing the target's embeddings, first layer, final norm
and head - an early exit of the target - predicts its tokens much of the time, and costs a
fraction of a target forward. Random weights, no tokenizer: prompts are token ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from specdec.engine.loader import LoadedModel
from specdec.engine.models import build_model, model_arch_from_hf_config

# Output projections of the target's later layers are scaled by this: smaller = higher acceptance
# (0.05 gives roughly 0.7 greedy and 0.75 sampled acceptance with the sizes below).
LATER_LAYER_SCALE = 0.05


def _loaded(cfg, state: dict[str, torch.Tensor]) -> LoadedModel:
    arch = model_arch_from_hf_config(cfg.to_dict())
    model = build_model(arch, iter(state.items()), torch.float32, torch.device("cpu"))
    return LoadedModel(Path("."), arch, model, None, 0.0)


def tiny_pair(
    seed: int = 0, vocab: int = 512, hidden: int = 256, layers: int = 6
) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft) as LoadedModels for LLMEngine(target=..., draft=...)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    target_cfg = Qwen2Config(num_hidden_layers=layers, **common)
    model = Qwen2ForCausalLM(target_cfg).eval()
    with torch.no_grad():  # transformers' init is tiny: widen it so logits are not near-uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 2.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.3)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in state:
        later = k.startswith("model.layers.") and int(k.split(".")[2]) >= 1
        if later and k.endswith(("o_proj.weight", "down_proj.weight")):
            state[k] *= LATER_LAYER_SCALE
    draft_cfg = Qwen2Config(num_hidden_layers=1, **common)
    draft_state = {
        k: v
        for k, v in state.items()
        if not k.startswith("model.layers.") or k.split(".")[2] == "0"
    }
    return _loaded(target_cfg, state), _loaded(draft_cfg, draft_state)
