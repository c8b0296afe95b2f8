"""The target's side of a token-tree step: the verify entry, its rows' sampling contexts, and
moving the accepted path's K/V into place.

The root is the sequence's last committed token (position ``T - 1``, not yet computed by the
target); node j is verified at scratch slot position ``T + j`` with rotary position
``T - 1 + depth``. After the verify accepts nodes ``a_1 .. a_m`` (depths 1..m) their K/V moves
from ``T + a_d`` to ``T + d - 1``, where a chain's would have been written; ``a_d >= d - 1``, so
every move reads a slot at or after the one it writes. Rejected nodes' slots lie past the
committed tokens: never counted as computed, truncated with the rest of the scratch blocks, so
never hashed into the prefix cache. The draft's K/V of the accepted nodes it fed (every level but
the last it grew) moves the same way in the draft's pool, and counts as computed by the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specdec.engine.attention.base import slots_for_positions
from specdec.engine.kv_cache import ModelKV, copy_kv_slots
from specdec.engine.model_runner import RunEntry
from specdec.engine.sampling import RowContext
from specdec.engine.sequence import Sequence

from specdec.draft_tree import DraftTree


@dataclass(frozen=True)
class TreePath:
    """What a tree's verify accepted: node indices from the root, each one's rank among its
    siblings, and the tree's depth."""

    nodes: list[int]
    ranks: list[int]
    depth: int


def tree_verify_entry(seq: Sequence, tree: DraftTree) -> RunEntry:
    """The target's entry for a tree: the root (the last committed token, at its own slot) and
    every node at scratch slot ``T + j``, each row attending to the context and its ancestors."""
    root = seq.num_tokens - 1
    n = tree.num_nodes
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[1:, 1:] = tree.attention_mask().cpu()
    return RunEntry(
        seq,
        [seq.token_ids[root], *tree.tokens],
        root,
        n + 1,
        positions=[root, *(root + d for d in tree.depths)],
        tree_mask=mask,
    )


def tree_row_contexts(seq: Sequence, tree: DraftTree) -> list[RowContext]:
    """The sampling context of the target's rows for a tree: the root's, then each node's with
    its path as the output so far (penalties see what plain decode would)."""
    out = seq.output_token_ids
    rows = [RowContext(seq.params, seq.prompt_token_ids, out)]
    rows += [
        RowContext(seq.params, seq.prompt_token_ids, out + tree.path_tokens(j))
        for j in range(tree.num_nodes)
    ]
    return rows


def move_accepted_kv(kv: ModelKV, seq: Sequence, nodes: list[int], page_size: int) -> None:
    """Copy the accepted nodes' K/V from their scratch slots to the positions after the root
    (call before the sequence's committed tokens grow)."""
    context = seq.num_tokens
    moves = [(context + j, context + d) for d, j in enumerate(nodes) if j != d]
    if not moves:
        return
    table = seq.block_table
    copy_kv_slots(
        kv,
        slots_for_positions(table, [src for src, _ in moves], page_size),
        slots_for_positions(table, [dst for _, dst in moves], page_size),
    )


def commit_tree_kv(
    seq: Sequence,
    nodes: list[int],
    draft_fed: int,
    page_size: int,
    target_kv: ModelKV | None,
    draft_kv: ModelKV | None,
) -> None:
    """Move the accepted ``nodes``' K/V into place in the target's pool and, for the leading ones
    among the draft's first ``draft_fed`` nodes, in the draft's, which then counts them as
    computed (call before the sequence's committed tokens grow). A pool of None (a runner
    without one) moves nothing; the draft's count moves all the same."""
    if target_kv is not None:
        move_accepted_kv(target_kv, seq, nodes, page_size)
    fed = 0
    while fed < len(nodes) and nodes[fed] < draft_fed:
        fed += 1
    if fed:
        if draft_kv is not None:
            move_accepted_kv(draft_kv, seq, nodes[:fed], page_size)
        seq.num_draft_computed_tokens = seq.num_tokens + fed
