"""Qwen2 / Llama decoder over a flat ragged batch with paged KV (both families share this code).

The families differ only in configuration: q/k/v bias (Qwen2), RoPE theta and scaling, tied or
untied output embeddings. The forward takes every token of the step at once and returns logits
only for the rows that need sampling (the lm_head over a 150k vocabulary is the costliest matrix).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from specdec.engine.attention.base import AttentionBackend, AttentionMetadata
from specdec.engine.models.arch import ModelArch
from specdec.engine.models.fused_ops import FusedOps
from specdec.engine.models.layers import Linear, RMSNorm, RotaryEmbedding, Rotation, SwiGLU
from torch import nn


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotate: Rotation,  # the rotary embedding at this forward's positions
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotate(q, k)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    """One pre-norm block. The residual stream travels beside the block's output, unadded, so
    that each add folds into the next norm (one fused kernel on CUDA):
    ``(h, r) -> (mlp(norm2(a + r')), r')`` with ``a = attn(norm1(h + r))``, ``r' = a + h + r``."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the previous block's output (the embeddings at layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before h; None at layer 0
        rotate: Rotation,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        a = self.self_attn(x, rotate, kv_cache, backend, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(a, residual)
        return self.mlp(x), residual


class DecoderLM(nn.Module):
    """Token ids -> logits of the selected rows; writes this step's K/V into the paged pool."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        # The vocabulary ids of lm_head's rows, in order; None: all of them (`with_output_rows`).
        self.output_token_ids: torch.Tensor | None = None
        # The linear layers' weight format (`specdec.engine.models.quant`), set by build_model.
        self.quantization = "none"

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) pages
        backend: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N] rows of the batch whose logits are wanted
    ) -> torch.Tensor:  # [N, lm_head rows] float32 (the vocabulary unless `with_output_rows`)
        backend.plan(meta)
        h, residual = self.run_layers(input_ids, positions, kv_caches, backend, meta)
        if logits_indices.numel() == 0:
            return h.new_empty((0, self.lm_head.out_features), dtype=torch.float32)
        return self.logits(h[logits_indices], residual[logits_indices])

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # last block's output and residual, [T, hidden]
        """Every decoder block, with attention planned already (`backend.plan(meta)`)."""
        h, residual = self.embed_tokens(input_ids), None
        rotate = self.rope.at(positions)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rotate, kv, backend, meta)
        assert residual is not None  # a model has at least one layer
        return h, residual

    def logits(
        self, h: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # float32
        """Final residual add, norm and lm_head for the given rows (into ``out`` if given: the
        float32 cast writes there directly, one kernel either way)."""
        x, _ = self.norm.add_and_norm(h, residual)
        if out is None:
            return self.lm_head(x).float()
        return out.copy_(self.lm_head(x))

    def with_output_rows(self, token_ids: torch.Tensor) -> DecoderLM:
        """This model with an lm_head over the vocabulary ids ``token_ids`` ([n] int64) only.

        Every other module is shared, not copied; the n head rows are gathered once, here, so a
        forward reads n rows instead of the vocabulary and returns [N, n] logits in
        ``token_ids`` order (`output_token_ids`). This model itself is left unchanged."""
        view = copy.copy(self)  # a new module object over the same submodule objects
        view._modules = {**self._modules, "lm_head": self.lm_head.row_subset(token_ids)}
        view.output_token_ids = token_ids.to(self.embed_tokens.weight.device, torch.int64)
        return view

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run norms, activations and rope through `ops` (None: the torch layers)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, SwiGLU, RotaryEmbedding)):
                m.ops = ops
        self.rope.ops = ops

    def weight_bytes(self) -> int:
        """Bytes held by the weights a forward computes with: every linear layer in the form it
        is kept (int4 drafts hold an int8 copy too, and count it), biases and norms; not the
        embedding table, of which a forward reads only its tokens' rows (the head is always a
        matrix of its own here, tied checkpoints included)."""
        linear = sum(m.weight_bytes for m in self.modules() if isinstance(m, Linear))
        rest = sum(
            p.numel() * p.element_size()
            for name, p in self.named_parameters()
            if not name.endswith("weight") or "norm" in name
        )
        return linear + rest

    def pack_linear_weights(self) -> int:
        """Pack every Linear for the CPU fast path; returns how many were packed."""
        return sum(m.pack_for_cpu() for m in self.modules() if isinstance(m, Linear))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            target, offset = _fused_target(name, self.arch)
            if target.startswith("model."):
                target = target[len("model.") :]
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} for {self.arch.architecture}")
            param = params[target]
            with torch.no_grad():
                if offset is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    rows = tensor.shape[0]
                    param[offset : offset + rows].copy_(tensor)
            loaded.add(f"{name}")
        if self.arch.tie_word_embeddings:
            with torch.no_grad():
                self.lm_head.weight.copy_(self.embed_tokens.weight)
        missing = _expected_names(self.arch) - loaded
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _fused_target(name: str, arch: ModelArch) -> tuple[str, int | None]:
    """Map a checkpoint name to (our parameter name, row offset inside a fused matrix or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _QKV:
            q_size = arch.num_attention_heads * arch.head_dim
            kv_size = arch.num_key_value_heads * arch.head_dim
            offset = (0, q_size, q_size + kv_size)[_QKV[part]]
            return ".".join(parts[:i] + ["qkv_proj"] + parts[i + 1 :]), offset
        if part in _GATE_UP:
            offset = _GATE_UP[part] * arch.intermediate_size
            return ".".join(parts[:i] + ["gate_up_proj"] + parts[i + 1 :]), offset
    return name, None


def checkpoint_sources(module_name: str) -> list[str]:
    """The checkpoint weights whose rows make up the weight of our Linear ``module_name`` (e.g.
    ``layers.3.self_attn.qkv_proj``), in row order: ``_fused_target`` read backwards."""
    parts = module_name.split(".")
    head, last = parts[:-1], parts[-1]
    prefix = [] if module_name == "lm_head" else ["model"]
    fused = {"qkv_proj": _QKV, "gate_up_proj": _GATE_UP}.get(last, {last: 0})
    return [".".join(prefix + head + [part, "weight"]) for part in fused]


def _expected_names(arch: ModelArch) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.add(p + f"self_attn.{proj}.weight")
        if arch.attention_bias:
            names |= {p + f"self_attn.{x}.bias" for x in ("q_proj", "k_proj", "v_proj")}
        names |= {p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
    return names
