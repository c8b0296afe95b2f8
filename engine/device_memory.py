"""Device memory a CUDA engine needs beyond its weights and its KV pool, so the pool leaves room.

The KV pool is sized from the free memory left after the weights load (``gpu_memory_utilization``
of it), but three other consumers only allocate later, once the pool is fixed:

* FlashInfer's workspaces: one float workspace per attention backend (split-KV partials) and an
  8 MiB device int workspace for every wrapper's schedule, the CUDA-graph wrappers included;
* CUDA graphs: the static logits buffer every graph of a model writes (sized for its largest
  capture) and the graph pool, which keeps the transient tensors of the largest capture;
* eager steps: the activations of the largest forward the scheduler may batch (prompt chunks for
  the target, catch-up chunks for the draft: both held to ``max_num_batched_tokens``), and the
  logits of the rows that sample (verify rows of every sequence): the lm_head's output in the
  model dtype and the float32 copies sampling holds at once (`SAMPLING_FLOAT32_COPIES`).

Each is estimated from the model's shapes and the engine's limits rather than measured, because
the graphs must capture over the pool's final tensors. The estimate errs high (every transient
counted as if alive at once); the device check compares it with what a built engine took.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specdec.engine.models.arch import ModelArch

# FlashInfer's wrappers each allocate this much device memory for their schedule (decode.py and
# prefill.py of flashinfer 0.6: ``torch.empty((8 * 1024 * 1024,), dtype=torch.uint8)``).
FLASHINFER_INT_WORKSPACE_BYTES = 8 * 1024 * 1024
EAGER_WRAPPERS = 2  # a backend's prefill and decode wrappers for eager steps
# Float32 [rows, vocab] tensors alive together while a verify step samples (`LLMEngine._sample`):
# the logits, their probabilities, and the target and draft probability grids it verifies.
SAMPLING_FLOAT32_COPIES = 4


def activation_bytes(arch: ModelArch, rows: int, dtype: torch.dtype) -> int:
    """Transient bytes of one decoder layer over ``rows`` token rows, counted as if alive at once:
    hidden state, residual, normed input and attention output; fused q/k/v; gate_up and the
    activated half (layers run one after another, so one layer's worth is the peak)."""
    e = dtype.itemsize
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    per_row = 4 * arch.hidden_size + qkv + 3 * arch.intermediate_size
    return rows * per_row * e


def logits_bytes(arch: ModelArch, rows: int, dtype: torch.dtype) -> int:
    """The lm_head's output for ``rows`` sampling rows in the model dtype plus the float32
    tensors sampling holds at once."""
    e = dtype.itemsize
    return rows * arch.vocab_size * (e + 4 * SAMPLING_FLOAT32_COPIES)


@dataclass(frozen=True)
class RuntimeShapes:
    """What bounds one model's runtime buffers in an engine."""

    max_batched_tokens: int  # the largest eager forward (prompt chunks plus decodes)
    max_sampled_rows: int  # rows that need logits in one step: sequences x (k_max + 1)
    graph_batch_sizes: Sequence[int] = ()  # captured buckets (empty: no CUDA graphs)
    graph_q_lens: Sequence[int] = ()
    float_workspace_bytes: int = 0  # the attention backend's FlashInfer float workspace


def runtime_bytes(arch: ModelArch, dtype: torch.dtype, shapes: RuntimeShapes) -> int:
    """Estimated device bytes one model's runner takes beyond its weights and KV pool."""
    e = dtype.itemsize
    eager = activation_bytes(arch, shapes.max_batched_tokens, dtype) + logits_bytes(
        arch, shapes.max_sampled_rows, dtype
    )
    workspaces = shapes.float_workspace_bytes
    if shapes.float_workspace_bytes:
        workspaces += EAGER_WRAPPERS * FLASHINFER_INT_WORKSPACE_BYTES
    graphs = 0
    if shapes.graph_batch_sizes and shapes.graph_q_lens:
        rows = max(shapes.graph_batch_sizes) * max(shapes.graph_q_lens)
        captures = len(set(shapes.graph_batch_sizes)) * len(set(shapes.graph_q_lens))
        graphs = (
            rows * arch.vocab_size * 4  # the shared float32 logits buffer
            + activation_bytes(arch, rows, dtype)  # the graph pool: the largest capture's ...
            + rows * arch.vocab_size * e  # ... transients, its lm_head output included
            + captures * FLASHINFER_INT_WORKSPACE_BYTES
        )
    return eager + workspaces + graphs
