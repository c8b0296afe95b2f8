"""Random-weight models at real shapes, KV pools, batch layouts and timers for the device check.

Shapes are those of the default pair (Qwen2.5-Coder 0.5B / 1.5B) and of a 7B-class target
(Qwen2.5-7B: same tokenizer family, so it pairs with the 0.5B draft). Weights are random: speed
and kernel parity do not depend on trained values. The tiny shapes serve ``--cpu-smoke``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from specdec.engine.attention.base import AttentionBackend, build_attention_metadata
from specdec.engine.kv_cache import ModelKV, allocate_model_kv
from specdec.engine.models import ModelArch, model_arch_from_hf_config
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.models.registry import instantiate_model


def _qwen2(vocab, hidden, inter, layers, heads, kv_heads, tie, head_dim=None) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": tie,
    }


SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, tie=True),
    "1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, tie=True),
    "7b": _qwen2(152064, 3584, 18944, 28, 28, 4, tie=False),
    # --cpu-smoke stand-ins: same structure (GQA, bias, untied head), seconds on a CPU.
    "tiny": _qwen2(512, 128, 256, 2, 4, 2, tie=False),
    "tiny-draft": _qwen2(512, 64, 128, 2, 4, 2, tie=False),
}


def arch_for(shape: str, vocab_size: int | None = None) -> ModelArch:
    """The architecture of a named shape; `vocab_size` overrides it (a draft must share the
    target's vocabulary for speculative decoding)."""
    cfg = dict(SHAPES[shape])
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return model_arch_from_hf_config(cfg)


def random_model(arch: ModelArch, dtype: torch.dtype, device: torch.device, seed: int) -> DecoderLM:
    """A DecoderLM with random weights: unit norms, N(0, 1/fan_in) matrices, N(0, 1) embeddings."""
    model = instantiate_model(arch, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:  # q/k/v biases
                p.normal_(0.0, 0.02, generator=gen)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
    model.rope.to(torch.float32)
    return model.eval()


def kv_bytes_per_token(arch: ModelArch, dtype: torch.dtype) -> int:
    return arch.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size())


def make_pool(
    arch: ModelArch, num_blocks: int, page_size: int, dtype: torch.dtype, device, seed: int
) -> ModelKV:
    """A KV pool filled with N(0, 1) keys/values (never zeros: zeros hide indexing mistakes)."""
    kv = allocate_model_kv(arch, num_blocks, page_size, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for k, v in kv.layers:
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    return kv


def contiguous_tables(
    batch: int, max_tokens: int, page_size: int, first_block: int = 0
) -> list[list[int]]:
    """Block tables giving each of `batch` sequences room for `max_tokens` tokens, no sharing."""
    pages = -(-max_tokens // page_size)
    return [
        list(range(first_block + i * pages, first_block + (i + 1) * pages)) for i in range(batch)
    ]


def eager_step(
    model: DecoderLM,
    kv: ModelKV,
    backend: AttentionBackend,
    page_size: int,
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    tree_masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:  # [sum of q_lens, vocab] float32, logits of every row
    """One forward of a ragged batch without graphs (the engine's own path); `tree_masks` as
    `build_attention_metadata` takes them."""
    device = backend.device
    q_lens = [len(t) for t in token_ids]
    kv_lens = [s + q for s, q in zip(start_positions, q_lens, strict=True)]
    meta = build_attention_metadata(q_lens, kv_lens, block_tables, page_size, device, tree_masks)
    ids = torch.tensor([t for row in token_ids for t in row], device=device)
    positions = torch.tensor(
        [s + j for s, q in zip(start_positions, q_lens, strict=True) for j in range(q)],
        device=device,
    )
    rows = torch.arange(ids.numel(), device=device)
    return model(ids, positions, kv.layers, backend, meta, rows)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; inf when either holds a NaN or inf."""
    got, want = got.double(), want.double()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@dataclass
class Timer:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    device: torch.device

    def times_ms(self, fn: Callable[[], object], iters: int, warmup: int = 3) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        if self.device.type == "cuda":
            for _ in range(iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
        return out

    def median_ms(self, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
        return statistics.median(self.times_ms(fn, iters, warmup))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def hbm_copy_bandwidth(device: torch.device, gib: float, iters: int) -> dict[str, float]:
    """Device-to-device copy of a random buffer; bytes counted as read + written."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = Timer(device).median_ms(lambda: dst.copy_(src), iters, warmup=2)
    moved = 2 * n * 2  # read + write
    return {"bytes": moved, "median_ms": ms, "gb_per_s": moved / (ms * 1e-3) / 1e9}
