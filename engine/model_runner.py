"""Turns a list of per-sequence token runs into one ragged forward of one model."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from specdec.engine.attention.base import AttentionBackend, build_attention_metadata
from specdec.engine.kv_cache import ModelKV
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.sequence import Sequence

if TYPE_CHECKING:
    from specdec.engine.cuda_graphs import GraphedForward


@dataclass
class RunEntry:
    """Tokens of one sequence to run after its first start_pos keys, keeping the last num_logits
    rows.

    Their keys and values go to the slots of positions ``start_pos .. start_pos + n - 1``, and
    by default those are also the tokens' positions, attended causally. A token tree sets both
    optional fields: ``positions`` (one per token: its rotary position, ``context_len + depth``
    for a node) and ``tree_mask`` (``[n, m]`` bool over the last m >= n keys: the entry's tokens,
    after nodes of the same tree an earlier forward wrote; see `attention.base`), so node j's KV
    sits at scratch slot ``start_pos + j`` while it attends to the committed keys and its
    ancestors only. Entries with either field never replay a CUDA
    graph.
    """

    seq: Sequence
    token_ids: Seq[int]
    start_pos: int
    num_logits: int
    positions: Seq[int] | None = None
    tree_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.positions is not None and len(self.positions) != len(self.token_ids):
            raise ValueError(
                f"{len(self.positions)} positions for {len(self.token_ids)} tokens; need one each"
            )
        if self.positions is not None and min(self.positions, default=0) < 0:
            raise ValueError("positions must be >= 0")

    @property
    def token_positions(self) -> Seq[int]:
        """Each token's rotary position: ``positions`` when given, else consecutive."""
        if self.positions is not None:
            return self.positions
        return range(self.start_pos, self.start_pos + len(self.token_ids))


class ModelRunner:
    """One model, its KV pages and its attention backend; optionally its captured CUDA graphs."""

    def __init__(
        self,
        model: DecoderLM,
        kv: ModelKV,
        backend: AttentionBackend,
        page_size: int,
        graphed: GraphedForward | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.page_size = page_size
        self.device = backend.device
        self.graphed = graphed
        self.num_graph_runs = 0  # observable: how many forwards replayed a graph

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    @property
    def output_token_ids(self) -> torch.Tensor | None:
        """The token ids of the head's rows when it keeps only some (a pruned draft), else None."""
        return self.model.output_token_ids

    def run(self, entries: Seq[RunEntry]) -> torch.Tensor:
        """One forward over every entry; logits [sum(num_logits), lm_head rows] in entry order
        (the vocabulary, unless the model's head keeps only some rows: `output_token_ids`)."""
        if self.graphed is not None and self.graphed.accepts(entries):
            self.num_graph_runs += 1
            logits = self.graphed.run(
                [e.token_ids for e in entries],
                [e.start_pos for e in entries],
                [e.seq.block_table for e in entries],
            )
            # The graph's output buffer is overwritten by its next replay (the draft's next
            # step, say) while callers may still hold these rows: hand out a copy.
            return logits.clone()
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        for e in entries:
            n = len(e.token_ids)
            offset = len(input_ids)
            input_ids.extend(e.token_ids)
            positions.extend(e.token_positions)
            logits_rows.extend(range(offset + n - e.num_logits, offset + n))
            q_lens.append(n)
            kv_lens.append(e.start_pos + n)
        tree_masks = [e.tree_mask for e in entries]
        meta = build_attention_metadata(
            q_lens,
            kv_lens,
            [e.seq.block_table for e in entries],
            self.page_size,
            self.device,
            tree_masks if any(m is not None for m in tree_masks) else None,
        )
        to = {"dtype": torch.int64, "device": self.device}
        return self.model(
            torch.tensor(input_ids, **to),
            torch.tensor(positions, **to),
            self.kv.layers,
            self.backend,
            meta,
            torch.tensor(logits_rows, **to),
        )
