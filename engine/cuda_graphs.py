"""CUDA graphs for decode, verify and draft steps at bucketed batch sizes (CUDA + FlashInfer).

Launching a 7B model's ~400 kernels one by one from Python costs milliseconds, as much as the step
itself at batch 1; a captured graph replays them with one launch. A graph is fixed to one shape:
``batch_size`` sequences of ``q_len`` query rows each (``q_len = 1`` for plain decode and for draft
steps, ``k + 1`` for a verify of k drafts). Everything it reads lives in static buffers refilled
before each replay: token ids, positions and the KV slot mapping (copied to the device), and
FlashInfer's index arrays (refilled by the wrapper's ``plan``, which runs on the host, outside the
graph, as FlashInfer requires).

A batch smaller than its bucket is padded. Padding rows point at scratch blocks that the caller
reserves in the KV pool and never hands to the allocator: they write their K/V only there and
attend only to it, so no real sequence's slot is ever touched.

Logits come back for every row, ``[bucket * q_len, vocab]`` float32, as a view of one static
buffer that all of a model's graphs write (sized for the largest; per-graph outputs would hold
~1.2 GB for a 7B vocabulary at 64 sequences x 5 q_lens): the next replay of any of them
overwrites it, so copy what must outlive it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from specdec.engine.attention.base import AttentionMetadata
from specdec.engine.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    FlashInferStepPlan,
    flashinfer_indices_from_lengths,
)
from specdec.engine.models.decoder import DecoderLM

logger = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def num_scratch_blocks(max_q_len: int, page_size: int) -> int:
    """Blocks a padding row of ``max_q_len`` tokens needs (kept out of the allocator)."""
    return -(-max_q_len // page_size)


def graph_bucket(
    entries: Sequence[Any], captured: Iterable[tuple[int, int]], max_tokens_per_seq: int
) -> int | None:
    """The captured batch bucket a runner's batch replays in, or None to run it eagerly.

    ``entries`` have ``token_ids``, ``start_pos`` and ``num_logits`` (`RunEntry`). A batch fits
    when every sequence feeds the same number of tokens at consecutive positions, attended
    causally, and wants logits for all of them (plain decodes, uniform verifies, one-token draft
    steps), some captured (bucket, q_len) holds it, and no sequence outgrows the graph's page
    budget. Prompt chunks, verifies of mixed length, long draft catch-ups and any entry with
    explicit positions or a tree mask (token trees) run eagerly.
    """
    if not entries:
        return None
    if any(
        getattr(e, "positions", None) is not None or getattr(e, "tree_mask", None) is not None
        for e in entries
    ):
        return None
    q_len = len(entries[0].token_ids)
    if any(len(e.token_ids) != q_len or e.num_logits != q_len for e in entries):
        return None
    if any(e.start_pos + q_len > max_tokens_per_seq for e in entries):
        return None
    return smallest_bucket(captured, len(entries), q_len)


def smallest_bucket(captured: Iterable[tuple[int, int]], batch_size: int, q_len: int) -> int | None:
    """Smallest captured batch size >= batch_size for this q_len, or None."""
    fits = [b for b, q in captured if q == q_len and b >= batch_size]
    return min(fits) if fits else None


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The default buckets up to ``max_num_seqs``; larger batches run eagerly."""
    return [b for b in DEFAULT_BATCH_BUCKETS if b <= max_num_seqs] or [1]


@dataclass
class _Capture:
    batch_size: int
    q_len: int
    graph: torch.cuda.CUDAGraph
    wrapper: object  # a FlashInfer wrapper in CUDA-graph mode
    input_ids: torch.Tensor  # [batch_size * q_len] int64
    positions: torch.Tensor  # [batch_size * q_len] int64
    slot_mapping: torch.Tensor  # [batch_size * q_len] int64
    step: FlashInferStepPlan | None = None  # set by the first _prepare
    meta: AttentionMetadata | None = None
    logits: torch.Tensor | None = None  # [batch_size * q_len, vocab] float32, graph output


class GraphedForward:
    """Captured forwards of one model for a set of (batch bucket, q_len) shapes."""

    def __init__(
        self,
        model: DecoderLM,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        backend: FlashInferAttentionBackend,
        page_size: int,
        max_pages_per_seq: int,
        scratch_blocks: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        if backend.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.scratch_blocks = list(scratch_blocks)
        self.dtype = dtype
        backend.dtype = dtype
        self.device = backend.device
        self._captures: dict[tuple[int, int], _Capture] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._logits: torch.Tensor | None = None  # [max rows, vocab] float32, shared output
        # Warm-up runs go to a side stream before each capture. One stream for all of them: the
        # caching allocator keeps freed blocks per stream (and cuBLAS a workspace per stream), so
        # a stream per capture would keep each warm-up's blocks to itself.
        self._capture_stream: torch.cuda.Stream | None = None

    # ---- capture ----------------------------------------------------------------------------
    def capture(self, batch_sizes: Sequence[int], q_lens: Sequence[int]) -> None:
        """Capture every (batch size, q_len) pair; largest first so smaller ones reuse memory."""
        start = time.perf_counter()
        if len(self.scratch_blocks) * self.page_size < max(q_lens):
            raise ValueError(
                f"{len(self.scratch_blocks)} scratch blocks of {self.page_size} slots cannot "
                f"hold a padding row of {max(q_lens)} tokens"
            )
        rows = max(batch_sizes) * max(q_lens)
        if self._logits is None or self._logits.shape[0] < rows:
            # Graphs captured earlier keep a view of the old buffer, which stays alive with them.
            vocab = self.model.lm_head.out_features  # a pruned head's rows, else the vocabulary
            self._logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        for q_len in sorted(set(q_lens), reverse=True):
            for batch_size in sorted(set(batch_sizes), reverse=True):
                if (batch_size, q_len) not in self._captures:
                    self._captures[(batch_size, q_len)] = self._capture_one(batch_size, q_len)
        # What the warm-ups left cached on the side stream is of no use to the main stream's
        # eager steps: hand it back (the graphs' own pool is not affected).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        logger.info(
            "captured %d CUDA graphs (batch %s x q_len %s) in %.1f s",
            len(self._captures),
            sorted(set(batch_sizes)),
            sorted(set(q_lens)),
            time.perf_counter() - start,
        )

    def _capture_one(self, batch_size: int, q_len: int) -> _Capture:
        rows = batch_size * q_len
        i64 = {"dtype": torch.int64, "device": self.device}
        wrapper = self.backend.make_graph_wrapper(
            batch_size, q_len, batch_size * self.max_pages_per_seq
        )
        cap = _Capture(
            batch_size=batch_size,
            q_len=q_len,
            graph=torch.cuda.CUDAGraph(),
            wrapper=wrapper,
            input_ids=torch.zeros(rows, **i64),
            positions=torch.zeros(rows, **i64),
            slot_mapping=torch.zeros(rows, **i64),
        )
        self._prepare(cap, [], [], [])  # all padding rows: plans the wrapper, fills buffers
        stream = self._capture_stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (allocator, library handles)
                self._forward(cap)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.cuda.graph(cap.graph, pool=self._pool):
            cap.logits = self._forward(cap)
        return cap

    @torch.inference_mode()
    def _forward(self, cap: _Capture) -> torch.Tensor:  # [rows, vocab] float32
        """DecoderLM.forward without its per-step plan (that happens before replay); logits go
        to the shared output buffer."""
        h, residual = self.model.run_layers(
            cap.input_ids, cap.positions, self.kv_layers, self.backend, cap.meta
        )
        assert self._logits is not None
        out = self._logits[: cap.batch_size * cap.q_len]
        return self.model.logits(h, residual, out=out)

    # ---- replay -----------------------------------------------------------------------------
    def accepts(self, entries: Sequence[Any]) -> bool:
        """Whether a runner's batch can replay one of this model's graphs (`graph_bucket`)."""
        limit = self.max_pages_per_seq * self.page_size
        return graph_bucket(entries, self._captures.keys(), limit) is not None

    def bucket_for(self, batch_size: int, q_len: int) -> int | None:
        """Smallest captured batch size >= batch_size for this q_len, or None."""
        return smallest_bucket(self._captures, batch_size, q_len)

    def run(
        self,
        token_ids: Sequence[Sequence[int]],  # per sequence, q_len tokens each
        start_positions: Sequence[int],  # position of each sequence's first new token
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:  # [len(token_ids) * q_len, vocab] float32 view of a static buffer
        """Plan, fill the static buffers and replay; new K/V land in the sequences' slots."""
        bucket, q_len = self.prepare(token_ids, start_positions, block_tables)
        return self.replay(bucket, q_len)[: len(token_ids) * q_len]

    def prepare(
        self,
        token_ids: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> tuple[int, int]:
        """Host half of `run`: pick the bucket, plan and fill its buffers; -> (bucket, q_len)."""
        batch = len(token_ids)
        q_len = len(token_ids[0]) if batch else 0
        if batch == 0 or any(len(t) != q_len for t in token_ids):
            raise ValueError("a graphed batch needs >= 1 sequence, all with the same q_len")
        bucket = self.bucket_for(batch, q_len)
        if bucket is None:
            raise ValueError(f"no captured graph for batch {batch} with q_len {q_len}")
        self._prepare(self._captures[(bucket, q_len)], token_ids, start_positions, block_tables)
        return bucket, q_len

    def replay(self, bucket: int, q_len: int) -> torch.Tensor:  # [bucket * q_len, vocab]
        """Device half of `run`: replay the graph as last prepared (timing replays alone)."""
        cap = self._captures[(bucket, q_len)]
        cap.graph.replay()
        assert cap.logits is not None
        return cap.logits

    def _prepare(
        self,
        cap: _Capture,
        token_ids: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        """Fill the static buffers for real rows plus padding rows, and plan the wrapper."""
        for start in start_positions:
            if -(-(start + cap.q_len) // self.page_size) > self.max_pages_per_seq:
                raise ValueError(f"{start + cap.q_len} tokens exceed the graph's page budget")
        padded = pad_graph_batch(
            token_ids,
            start_positions,
            block_tables,
            cap.batch_size,
            cap.q_len,
            self.page_size,
            self.scratch_blocks,
        )
        indices = flashinfer_indices_from_lengths(
            padded.q_lens, padded.kv_lens, padded.block_tables, self.page_size
        )
        if cap.step is None:
            cap.step = FlashInferStepPlan(indices, self.page_size)
            cap.meta = AttentionMetadata(
                q_lens=padded.q_lens,
                kv_lens=padded.kv_lens,
                block_tables=padded.block_tables,
                page_size=self.page_size,
                slot_mapping=cap.slot_mapping,
                qo_indptr=indices["qo_indptr"].to(self.device),
                plan=cap.step,
            )
        else:
            cap.step.indices = indices
        self.backend.plan_wrapper(cap.step, cap.wrapper, self.dtype)
        cap.input_ids.copy_(torch.tensor(padded.input_ids, dtype=torch.int64), non_blocking=True)
        cap.positions.copy_(torch.tensor(padded.positions, dtype=torch.int64), non_blocking=True)
        cap.slot_mapping.copy_(
            torch.tensor(padded.slot_mapping, dtype=torch.int64), non_blocking=True
        )


@dataclass
class PaddedBatch:
    """Host-side contents of a graph's static buffers: real rows first, then padding rows."""

    input_ids: list[int]  # [bucket * q_len]
    positions: list[int]  # [bucket * q_len]
    slot_mapping: list[int]  # [bucket * q_len]
    q_lens: list[int]  # [bucket]
    kv_lens: list[int]  # [bucket]
    block_tables: list[list[int]]  # [bucket]


def pad_graph_batch(
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    bucket: int,
    q_len: int,
    page_size: int,
    scratch_blocks: Sequence[int],
) -> PaddedBatch:
    """Lay out ``len(token_ids)`` real sequences plus padding up to ``bucket`` rows.

    A padding row has ``q_len`` tokens (id 0) at positions ``0 .. q_len - 1`` whose keys go to,
    and are read from, the scratch blocks only.
    """
    if len(token_ids) > bucket:
        raise ValueError(f"{len(token_ids)} sequences do not fit a bucket of {bucket}")
    if len(scratch_blocks) * page_size < q_len:
        raise ValueError(f"scratch blocks cannot hold a padding row of {q_len} tokens")
    out = PaddedBatch([], [], [], [q_len] * bucket, [], [])
    for toks, start, table in zip(token_ids, start_positions, block_tables, strict=True):
        if len(toks) != q_len:
            raise ValueError(f"every sequence needs {q_len} tokens, got {len(toks)}")
        out.input_ids.extend(toks)
        for pos in range(start, start + q_len):
            out.positions.append(pos)
            out.slot_mapping.append(table[pos // page_size] * page_size + pos % page_size)
        out.kv_lens.append(start + q_len)
        out.block_tables.append(list(table))
    for _ in range(bucket - len(token_ids)):
        out.input_ids.extend([0] * q_len)
        out.positions.extend(range(q_len))
        out.slot_mapping.extend(
            scratch_blocks[p // page_size] * page_size + p % page_size for p in range(q_len)
        )
        out.kv_lens.append(q_len)
        out.block_tables.append(list(scratch_blocks))
    return out
