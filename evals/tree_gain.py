"""What static token trees would commit per target forward, predicted from recorded traces.

A trace holds, at every output position along the target's greedy path, the draft's top-8 tokens
given the true prefix, so the rank of the target's token among them (``rank``; 8 = not among
them) is known. A static tree is a prefix-closed set of rank paths ``(r_1, .., r_j)``: the node at
depth j is the draft's r_j-th choice after its parent. From output position t a verify of that
tree accepts the longest j with ``(rank[t], .., rank[t + j - 1])`` in the tree, exactly as the
greedy tree walk would (every node on the true path was drawn from the distribution the trace
recorded; nodes off it never matter). A chain of depth d is the tree ``{(0,), (0, 0), ..}``.

The tree of N nodes that accepts most on average holds the N rank paths seen most often
(Sequoia's construction on empirical frequencies). Here it is fitted on the other requests of the
same task group and evaluated on the held-out one (leave one request out), so the gain is not an
in-sample fit. Each request is decoded to its end with the tree: ``tokens / forwards`` is the
committed tokens per target forward, and the batch-1 time per token adds the recorded cost table's
price of the target forward (1 + N rows) and of the draft's level-by-level forwards.

    python -m specdec.evals.tree_gain --output-dir docs/results/trees
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from specdec.evals.cost_table import StepCosts
from specdec.evals.traces import (
    TOP_K,
    RequestTrace,
    TraceSet,
    load_cost_table,
    load_traces,
    priced_by,
)

GROUPS = {
    "code": ("code_generation", "code_editing"),
    "chat": ("multi_turn_chat", "context_qa", "summarization", "translation", "math"),
}
DEPTHS = (2, 3, 4, 5, 6)
NODE_BUDGETS = (8, 16, 32)
CONTEXT = 256  # the context a batch-1 step is priced at (tokens before the new rows)

RankPath = tuple[int, ...]


def ranks(trace: RequestTrace) -> np.ndarray:
    """[n] the rank of the target's token among the draft's top choices (TOP_K: not among them)."""
    hit = trace.draft_ids == trace.tokens[:, None]
    return np.where(hit.any(axis=1), hit.argmax(axis=1), TOP_K)


def path_counts(rank_seqs: Sequence[np.ndarray], depth: int) -> Counter[RankPath]:
    """How often each rank path of at most ``depth`` nodes starts at an output position."""
    counts: Counter[RankPath] = Counter()
    for r in rank_seqs:
        for t in range(len(r)):
            path: RankPath = ()
            for j in range(min(depth, len(r) - t)):
                if r[t + j] >= TOP_K:
                    break
                path = (*path, int(r[t + j]))
                counts[path] += 1
    return counts


def best_tree(counts: Counter[RankPath], num_nodes: int) -> frozenset[RankPath]:
    """The ``num_nodes`` most frequent rank paths (shorter first on ties): prefix-closed, since a
    path is never more frequent than its prefix."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    return frozenset(p for p, _ in ranked[:num_nodes])


def chain(depth: int) -> frozenset[RankPath]:
    return frozenset((0,) * j for j in range(1, depth + 1))


def decode(r: np.ndarray, tree: frozenset[RankPath]) -> tuple[int, int]:
    """(tokens, target forwards) of decoding one request to its end with ``tree`` every step."""
    t = forwards = 0
    while t < len(r):
        accepted, path = 0, ()
        while t + accepted < len(r):
            path = (*path, int(r[t + accepted]))
            if path not in tree:
                break
            accepted += 1
        t += accepted + 1
        forwards += 1
    return len(r), forwards  # the last forward's extra tokens fall past the request's end


def nodes_per_level(tree: frozenset[RankPath]) -> list[int]:
    depth = max((len(p) for p in tree), default=0)
    return [sum(1 for p in tree if len(p) == j) for j in range(1, depth + 1)]


def step_seconds(costs: StepCosts, tree: frozenset[RankPath]) -> float:
    """Batch-1 step with ``tree``: one target forward over the last token and every node, and
    one draft forward per level (the first also reads the 1-2 tokens of catch-up)."""
    levels = nodes_per_level(tree)
    seconds = costs.target_seconds([(1 + len(tree), CONTEXT)], greedy_rows=1 + len(tree))
    for f, _ in enumerate(levels):
        # forward f expands the nodes of level f (forward 0: the root), one row per parent
        rows = 2 if f == 0 else levels[f - 1]
        seconds += costs.draft_seconds([(rows, CONTEXT + f)]) + costs.sampling_seconds(rows, 0.0)
    return seconds


def evaluate(traces: TraceSet) -> dict:
    """Every group, depth and shape; step times from the traces' cost table."""
    meta = traces.meta
    costs = StepCosts(meta["cost_table"])
    greedy = [r for r in traces.requests if r.temperature == 0]
    out: dict = {"groups": {}}
    for group, categories in GROUPS.items():
        members = [r for r in greedy if r.category in categories]
        seqs = [ranks(r) for r in members]
        rows = []
        for depth in DEPTHS:
            shapes: dict[str, list] = {"chain": [0, 0, 0.0]}
            for n in NODE_BUDGETS:
                shapes[f"tree_n{n}"] = [0, 0, 0.0]
            for i, r in enumerate(seqs):
                rest = seqs[:i] + seqs[i + 1 :]
                counts = path_counts(rest, depth)
                trees = {"chain": chain(depth)}
                for n in NODE_BUDGETS:
                    trees[f"tree_n{n}"] = best_tree(counts, n)
                for name, tree in trees.items():
                    tokens, forwards = decode(r, tree)
                    acc = shapes[name]
                    acc[0] += tokens
                    acc[1] += forwards
                    acc[2] += forwards * step_seconds(costs, tree)
            for name, (tokens, forwards, seconds) in shapes.items():
                rows.append(
                    {
                        "depth": depth,
                        "shape": name,
                        "tokens_per_forward": tokens / forwards,
                        "ms_per_token": 1e3 * seconds / tokens,
                    }
                )
        plain_tokens = sum(len(r) for r in seqs)
        plain_ms = 1e3 * costs.target_seconds([(1, CONTEXT)], greedy_rows=1)
        out["groups"][group] = {
            "requests": len(members),
            "positions": plain_tokens,
            "plain_ms_per_token": plain_ms,
            "rows": rows,
        }
    out["cost_table_machine"] = meta.get("cost_table_machine") or meta.get("machine", {})
    return out


def summary(result: dict) -> dict:
    """Per group: the best chain, and per node budget the best tree of equal depth as the best
    chain (tokens per forward) and the best tree overall (time per token)."""
    out = {}
    for group, g in result["groups"].items():
        rows = g["rows"]
        chains = [r for r in rows if r["shape"] == "chain"]
        best_chain_tpf = max(chains, key=lambda r: r["tokens_per_forward"])
        best_chain_time = min(chains, key=lambda r: r["ms_per_token"])
        trees = {}
        for n in NODE_BUDGETS:
            same_depth = next(
                r
                for r in rows
                if r["shape"] == f"tree_n{n}" and r["depth"] == best_chain_tpf["depth"]
            )
            fastest = min(
                (r for r in rows if r["shape"] == f"tree_n{n}"), key=lambda r: r["ms_per_token"]
            )
            trees[f"tree_n{n}"] = {
                "tokens_per_forward_vs_chain": same_depth["tokens_per_forward"]
                / best_chain_tpf["tokens_per_forward"],
                "time_per_token_gain_vs_best_chain": best_chain_time["ms_per_token"]
                / fastest["ms_per_token"],
                "fastest_depth": fastest["depth"],
            }
        out[group] = {
            "best_chain_depth": best_chain_tpf["depth"],
            "best_chain_tokens_per_forward": best_chain_tpf["tokens_per_forward"],
            "fastest_chain_depth": best_chain_time["depth"],
            "trees": trees,
        }
    return out


def markdown(result: dict, command: str, commit: str) -> str:
    machine = result.get("cost_table_machine", {})
    lines = [
        "# Static token trees predicted from traces",
        "",
        f"`{command}` (commit {commit}) on the committed trace set (greedy requests only; each",
        "request held out from the tree it is decoded with). Steps priced by a cost table of "
        f"{machine.get('cpu', 'unknown')} ({machine.get('cpu_flags', '')}), "
        f"{machine.get('dtype', '?')}, {machine.get('threads', '?')} threads.",
        "",
        "| group | depth | shape | tokens / target forward | ms / token (batch 1) |",
        "|---|---|---|---|---|",
    ]
    for group, g in result["groups"].items():
        for r in g["rows"]:
            lines.append(
                f"| {group} | {r['depth']} | {r['shape']} | {r['tokens_per_forward']:.2f} | "
                f"{r['ms_per_token']:.1f} |"
            )
    lines += ["", "| group | best chain depth | tree | tokens/forward vs chain of equal depth "
              "| time/token gain vs fastest chain |", "|---|---|---|---|---|"]  # fmt: skip
    for group, s in result["summary"].items():
        for name, t in s["trees"].items():
            lines.append(
                f"| {group} | {s['best_chain_depth']} | {name} | "
                f"{t['tokens_per_forward_vs_chain']:.3f} | "
                f"{t['time_per_token_gain_vs_best_chain']:.3f} (depth {t['fastest_depth']}) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=None, help="trace set directory (default: committed)")
    parser.add_argument(
        "--cost-table-from",
        default=None,
        help="a trace set's meta.json (or its directory) whose cost table prices the steps "
        "(another weight format, say)",
    )
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--commit", default="unknown", help="commit named in the markdown")
    args = parser.parse_args(argv)
    traces = load_traces(args.traces)
    if args.cost_table_from:
        traces = priced_by(traces, load_cost_table(args.cost_table_from))
    result = evaluate(traces)
    result["summary"] = summary(result)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_gain.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    command = "python -m specdec.evals.tree_gain " + " ".join(argv or sys.argv[1:])
    (out / "tree_gain.md").write_text(markdown(result, command, args.commit))
    print((out / "tree_gain.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
