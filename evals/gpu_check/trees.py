"""Device-check stage for token trees: one verify step in which every sequence carries a tree of
N nodes (FlashInfer's custom-mask prefill path on CUDA, the torch backend's tree mask on the CPU)
against a plain decode step and against a causal verify of as many rows, at each batch size.

A tree verify entry is the sequence's last committed token (the root row) and the tree's nodes,
grown level by level as the engine's dynamic growth does (about N / depth nodes a level). Tree
batches never replay CUDA graphs, so the plain decode is timed both as the engine runs it
(graphed, on CUDA) and eagerly; the causal verify of N + 1 rows separates what the mask costs from
what the rows cost.
"""

from __future__ import annotations

from typing import Any

import torch
from specdec.engine.attention.base import tree_mask_from_parents
from specdec.evals.gpu_check.context import CheckContext
from specdec.evals.gpu_check.models import Timer, eager_step
from specdec.evals.gpu_check.timing import get_rig

TREE_DEPTH = 4  # the depth the chain-versus-tree comparison uses (chain k = 4)


def tree_entry_parents(nodes: int, depth: int) -> list[int]:
    """Parents of the rows of one tree verify entry: row 0 is the root (-1), then `nodes` nodes
    in breadth-first order over min(depth, nodes) levels of as equal widths as they divide into
    (wider levels first), each level's nodes hung under the level above in turn."""
    if nodes < 1 or depth < 1:
        raise ValueError(f"need nodes >= 1 and depth >= 1, got {nodes} and {depth}")
    levels = min(depth, nodes)
    widths = [nodes // levels + (1 if i < nodes % levels else 0) for i in range(levels)]
    parents, above = [-1], [0]
    for width in widths:
        level = list(range(len(parents), len(parents) + width))
        parents += [above[j % len(above)] for j in range(width)]
        above = level
    return parents


def stage_tree_timing(ctx: CheckContext) -> dict[str, Any]:
    rows = []
    for batch in ctx.tree_batch_sizes:
        rows.append(_tree_row(ctx, batch))
        ctx.log(
            f"  trees batch {batch}: decode {rows[-1]['decode_ms']:.3f} ms, {rows[-1]['trees']}"
        )
    return {
        "target_shape": ctx.target_shape,
        "context_len": ctx.context_len,
        "depth": TREE_DEPTH,
        "rows": rows,
        "pass": True,
    }


def _tree_row(ctx: CheckContext, batch: int) -> dict[str, Any]:
    rig, timer, iters = get_rig(ctx), Timer(ctx.device), ctx.iters
    starts, tables = [ctx.context_len] * batch, rig.tables[:batch]

    def eager(q_len: int, masks: list | None = None) -> torch.Tensor:
        ids = [[1] * q_len] * batch
        return eager_step(
            rig.target, rig.t_kv, rig.t_backend, ctx.page_size, ids, starts, tables, masks
        )

    row: dict[str, Any] = {"batch": batch}
    row["decode_ms"] = timer.median_ms(lambda: rig.target_step([[1]] * batch, starts), iters)
    row["eager_decode_ms"] = timer.median_ms(lambda: eager(1), iters)
    row["chain_k4_ms"] = timer.median_ms(lambda: eager(5), iters)
    row["trees"] = {}
    for nodes in ctx.tree_nodes:
        masks = [tree_mask_from_parents(tree_entry_parents(nodes, TREE_DEPTH))] * batch
        tree_ms = timer.median_ms(lambda q=nodes + 1, m=masks: eager(q, m), iters)
        causal_ms = timer.median_ms(lambda q=nodes + 1: eager(q), iters)
        row["trees"][nodes] = {
            "tree_ms": tree_ms,
            "causal_same_rows_ms": causal_ms,
            "tree_vs_decode": tree_ms / row["decode_ms"],
            "tree_vs_chain_k4": tree_ms / row["chain_k4_ms"],
            "mask_cost": tree_ms / causal_ms,
        }
    return row
