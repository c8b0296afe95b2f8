"""Measurement: how firm is a replay verdict, given the spread of the cost table behind it?

A cost table measured in shuffled rounds (``specdec trace --cost-table-only``) keeps every
shape's time in each round beside its median. This program replays plain decode, the fixed
draft lengths and the adaptive policy on the table as measured and on ``--resamples`` tables
drawn from it: each shape's median over its rounds drawn with replacement (seeded), an equally
plausible measurement of the same machine. For each scenario it reports adaptive over the best
fixed arm (and over plain where no fixed arm beats it) on the measured table, and that ratio's
spread over the resamples. The best of six fixed arms, each priced by its own few table points,
gains from whichever points came out low; adaptive, priced through a fitted curve, cannot. A
verdict that flips within the resamples' spread is the table's noise, not the policy's.

    python -m specdec.evals.controller_sweep.table_noise \\
        --cost-table-from evals/data/traces_bf16_int4/cost_table_zen5_b970af4.json \\
        --output-dir docs/results/replay/bf16_int4_zen5_b970af4
    python -m specdec.evals.controller_sweep.table_noise --traces DIR --resamples 2  # own table
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
from pathlib import Path
from statistics import median

BEST_TARGET = 0.98  # adaptive over the best fixed arm (issue targets, docs/controller.md)
PLAIN_TARGET = 0.99  # adaptive over plain where no fixed arm beats plain


def has_resampleable_rounds(cost_table: dict) -> bool:
    """Whether every timed shape of a table keeps its per-round times."""
    timed = [row for kind, rows in cost_table.items() if kind != "sampling" for row in rows]
    return bool(timed) and all(row.get("rounds") for row in timed)


def resampled(table: dict, rng: random.Random) -> dict:
    """``table`` (``load_cost_table``'s keys) with each timed shape's seconds the median of its
    rounds drawn with replacement; sampling times kept."""
    out = copy.deepcopy(table)
    for kind, rows in out["cost_table"].items():
        if kind == "sampling":
            continue
        for row in rows:
            row["seconds"] = median(rng.choices(row["rounds"], k=len(row["rounds"])))
    return out


def verdict(tokens_per_s: dict[str, float]) -> dict:
    """Adaptive against the best fixed arm, and against plain where no fixed arm beats it."""
    fixed = {k: v for k, v in tokens_per_s.items() if k.startswith("fixed_k")}
    best = max(fixed, key=lambda k: fixed[k])
    plain, adaptive = tokens_per_s["plain"], tokens_per_s["adaptive"]
    return {
        "best_fixed": best,
        "adaptive_over_best": adaptive / max(fixed[best], plain),
        "adaptive_over_plain": adaptive / plain if fixed[best] <= plain else None,
    }


def summarize(measured: dict, resamples: list[dict]) -> list[dict]:
    """Per scenario: the measured table's verdict and its spread over the resampled tables."""
    rows = []
    for i, scenario in enumerate(measured["scenarios"]):
        name = scenario["name"]
        v = verdict(scenario["tokens_per_s"])
        others = [verdict(r["scenarios"][i]["tokens_per_s"]) for r in resamples]
        ratios = [o["adaptive_over_best"] for o in others]
        winners: dict[str, int] = {}
        for o in others:
            winners[o["best_fixed"]] = winners.get(o["best_fixed"], 0) + 1
        best = v["best_fixed"]
        best_tps = [r["scenarios"][i]["tokens_per_s"][best] for r in resamples]
        rows.append(
            v
            | {
                "scenario": name,
                "resampled_over_best": ratios,
                "resampled_meets_best": sum(r >= BEST_TARGET for r in ratios),
                "resampled_best_fixed": winners,
                # the measured winner's tokens/s over its median on the resampled tables
                "best_fixed_lift": scenario["tokens_per_s"][best] / median(best_tps),
            }
        )
    return rows


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    n = result["resamples"]
    lines = [
        "# Replay verdicts against the cost table's own spread",
        "",
        f"{provenance_line(result)}; traces `{result['traces']}`, cost table"
        f" `{result['cost_table']}` ({result['table_machine']}), {n} resampled tables, seed"
        f" {result['seed']}.",
        "",
        "| scenario | best fixed | adaptive / best | resampled: median (range) | meets"
        f" {BEST_TARGET} | winner's lift | adaptive / plain |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["scenarios"]:
        rs = r["resampled_over_best"]
        plain = r["adaptive_over_plain"]
        lines.append(
            f"| {r['scenario']} | {r['best_fixed'].removeprefix('fixed_')} |"
            f" {r['adaptive_over_best']:.3f} | {median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f}) |"
            f" {r['resampled_meets_best']}/{n} | {r['best_fixed_lift']:.3f} |"
            f" {'' if plain is None else f'{plain:.3f}'} |"
        )
    lines += [
        "",
        "adaptive / best: adaptive over the best of plain and fixed k = 1..6 on the table as"
        f" measured (target {BEST_TARGET}); resampled: the same ratio on tables whose every shape"
        " is the median of its rounds drawn with replacement; meets: resampled tables on which"
        " it reaches the target; winner's lift: the measured table's best fixed arm over its"
        " median on the resampled tables; adaptive / plain where no fixed arm beats plain"
        f" (target {PLAIN_TARGET}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", default=None, help="trace set (default: evals/data/traces)")
    p.add_argument(
        "--cost-table-from",
        default=None,
        help="a cost table with per-round times (default: the traces' own)",
    )
    p.add_argument("--resamples", type=int, default=8, help="resampled tables to replay")
    p.add_argument("--seed", type=int, default=0, help="seed of the resampling")
    p.add_argument("--scenarios", default="all", help="scenario names, comma-separated")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--output-dir", type=Path, default=None, help="write table_noise.json/.md")
    args = p.parse_args(argv)
    if args.resamples < 1 or args.workers < 1:
        p.error("--resamples and --workers must be >= 1")

    from specdec.engine.errors import SpecdecError
    from specdec.evals.environment import result_header, write_result
    from specdec.evals.replay import default_policies
    from specdec.evals.replay_suite import default_scenarios, pick_by_name, run_suite
    from specdec.evals.traces import COST_TABLE_KEYS, load_cost_table, load_traces, priced_by

    try:
        traces = load_traces(args.traces)
        if args.cost_table_from:
            table = load_cost_table(args.cost_table_from)
        else:
            table = {k: traces.meta[k] for k in COST_TABLE_KEYS if k in traces.meta}
        scenarios = pick_by_name(args.scenarios, default_scenarios(), "scenario")
    except SpecdecError as e:
        p.error(str(e))
    if not has_resampleable_rounds(table.get("cost_table", {})):
        p.error(
            "the cost table keeps no per-round times (measured before tables kept their rounds):"
            " measure one with `specdec trace --cost-table-only`"
        )
    names = ("plain", *(f"fixed_k{k}" for k in range(1, 7)), "adaptive")
    policies = [pol for pol in default_policies() if pol.name in names]
    rng = random.Random(args.seed)
    reports = []
    for i in range(args.resamples + 1):
        priced = priced_by(traces, table if i == 0 else resampled(table, rng))
        reports.append(run_suite(priced, scenarios, policies, workers=args.workers))
        print(f"table {i}/{args.resamples} replayed", file=sys.stderr)

    machine = table.get("cost_table_machine", {})
    result = result_header("specdec.evals.controller_sweep.table_noise", argv, threads=1) | {
        "traces": args.traces or "evals/data/traces",
        "cost_table": args.cost_table_from or "the traces' own",
        "table_machine": f"{machine.get('cpu', '?')}, {machine.get('dtype', '?')},"
        f" {machine.get('threads', '?')} threads, commit {table.get('cost_table_commit', '?')}",
        "resamples": args.resamples,
        "seed": args.seed,
        "scenarios": summarize(reports[0], reports[1:]),
        "tokens_per_s": [{s["name"]: s["tokens_per_s"] for s in r["scenarios"]} for r in reports],
    }
    text = markdown(result)
    print(text)
    if args.output_dir is not None:
        write_result(args.output_dir, "table_noise", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
