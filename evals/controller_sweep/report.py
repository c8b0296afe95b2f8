"""Markdown table and PNG plot for evals/controller_sweep/sweep.py results, with the issue's targets.

Targets checked per point: adaptive within 5% of the best of plain / fixed-k throughput; adaptive
never more than 3% slower than plain; at concurrency 1 on code, adaptive at least as fast as the
best fixed k. Each is judged on the median over rounds of adaptive's throughput over the other
arms' within a round (the rounds are paired: same requests, steps interleaved), and, beside it,
on the ratio of the arms' medians over rounds.

Results of several runs (a sweep split into parts, each point measured once) merge into one
report::

    python -m specdec.evals.controller_sweep.report --out docs/results/controller/sweep part1.json part2.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import median

ARM_ORDER = ("plain", "fixed-k2", "fixed-k4", "adaptive", "adaptive-trees")


def _points(rows: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    points: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        points[(r["workload"], r["concurrency"])][r["arm"]] = r
    return points


# Each target: the least ratio of adaptive's throughput to the comparison arm's that passes.
TARGETS = {
    "within_5pct_of_best": 0.95,  # A: against the best of plain and fixed k
    "not_3pct_slower_than_plain": 0.97,  # B
    "c1_code_at_least_best_fixed": 1.0,  # C: code at c=1 only, against the best fixed k
    "trees_within_2pct_of_adaptive": 0.98,  # D: adaptive with trees against adaptive with chains
}
_COMPARED_WITH = {
    "within_5pct_of_best": ("plain", "fixed-k2", "fixed-k4"),
    "not_3pct_slower_than_plain": ("plain",),
    "c1_code_at_least_best_fixed": ("fixed-k2", "fixed-k4"),
    "trees_within_2pct_of_adaptive": ("adaptive",),
}
# The arm each target judges (the others judge adaptive).
_JUDGED = {"trees_within_2pct_of_adaptive": "adaptive-trees"}


def _targets_at(workload: str, concurrency: int) -> list[str]:
    names = ["within_5pct_of_best", "not_3pct_slower_than_plain"]
    if workload == "code" and concurrency == 1:
        names.append("c1_code_at_least_best_fixed")
    return names + ["trees_within_2pct_of_adaptive"]


def paired_ratios(
    arms: dict[str, dict], compared_with: tuple[str, ...], judged: str = "adaptive"
) -> list[float]:
    """``judged``'s throughput over the best of ``compared_with`` (those that ran), round by round.

    The arms of one round served the same requests with their steps interleaved, so a ratio
    within a round is free of the slow drift of a shared machine that the medians across rounds
    still carry. A round an arm did not finish has no ratio.
    """
    ad = arms.get(judged, {}).get("throughput_runs", [])
    runs = [arms[a].get("throughput_runs", []) for a in compared_with if a in arms]
    if not runs:
        return []
    return [v / max(r[i] for r in runs) for i, v in enumerate(ad) if all(len(r) > i for r in runs)]


def check_targets(
    workload: str, concurrency: int, arms: dict[str, dict], paired: bool = True
) -> dict[str, bool | None]:
    """Pass/fail of each target at one point (None when an arm it needs was not run).

    ``paired``: judge the median over rounds of adaptive's ratio to the other arms within each
    round (``paired_ratios``), the comparison the rounds are built for; otherwise the ratio of
    the arms' medians over rounds, which may come from different rounds and so carry the
    machine's drift between them.
    """
    out: dict[str, bool | None] = {}
    for name in _targets_at(workload, concurrency):
        judged = _JUDGED.get(name, "adaptive")
        compared_with = [a for a in _COMPARED_WITH[name] if a in arms]
        if judged not in arms:
            continue
        if not compared_with:
            out[name] = None
        elif paired:
            ratios = paired_ratios(arms, tuple(compared_with), judged)
            out[name] = median(ratios) >= TARGETS[name] if ratios else None
        else:
            best = max(arms[a]["throughput_tok_s"] for a in compared_with)
            out[name] = arms[judged]["throughput_tok_s"] >= TARGETS[name] * best
    return out


def round_ratios(arms: dict[str, dict]) -> dict[str, list[float]]:
    """Adaptive's throughput over the best other arm's, and over plain's, round by round; their
    spread shows how far a check's verdict rests on noise."""
    return {
        "best": paired_ratios(arms, _COMPARED_WITH["within_5pct_of_best"]),
        "plain": paired_ratios(arms, _COMPARED_WITH["not_3pct_slower_than_plain"]),
    }


def _method(meta: dict) -> str:
    """How the figures were measured, as the run that wrote ``meta`` measured them."""
    rounds = meta.get("repeats", 1)
    if meta.get("arms_step_in_turn"):
        how = (
            f"Throughput in output tokens/s of each arm's own step time, the median over {rounds} "
            "round(s) per point. In a round every arm serves the same requests (each round fresh "
            "ones) on its own engine, the engines stepping in turn, so the arms meet the same "
            "spells of a shared machine; each round's figure is in the JSON."
        )
        warmup = meta.get("warmup")
        if warmup:  # runs from before it was recorded warmed up on two 8-token requests
            how += (
                f" Before each workload's points every arm served {warmup['requests']} untimed "
                f"warm-up requests of {warmup['tokens']} tokens, two at a time."
            )
    else:  # results from before the arms stepped in turn: whole runs, one arm after another
        how = (
            f"Throughput in output tokens/s, the median of {rounds} interleaved run(s) of every "
            "arm per point (the arm order reversed every other round; each run's figure is in "
            "the JSON)."
        )
    return how + (
        " TPOT = time per output token after the first, median and p99 over the requests of "
        "all runs, in ms. Checks: A = adaptive within 5% of the best arm, B = adaptive not more "
        "than 3% slower than plain, C = (code, c=1) adaptive at least as fast as the best fixed "
        "k, D = adaptive with trees not more than 2% slower than adaptive with chains, each "
        "judged on the median over rounds of adaptive's throughput over the other arms' "
        "in the same round (checks), and on the arms' medians over rounds, which may come from "
        "different rounds (checks on medians). Per round: adaptive's throughput over the best "
        "other arm's (÷ best) and over plain's (÷ plain) in each round."
    )


def _marks(checks: dict[str, bool | None]) -> str:
    letters = dict(zip(TARGETS, "ABCD", strict=True))
    return " ".join(f"{letters[k]}{'✓' if v else '✗'}" for k, v in checks.items() if v is not None)


def _machine(meta: dict) -> str:
    """Commit, CPU, threads and weight format, where the run recorded them."""
    env = meta.get("environment")
    if not env:
        return ""
    return (
        f" Commit {meta.get('commit', 'unknown')}; {env['cpu']}, {env['torch_threads']} threads, "
        f"{meta.get('dtype', '?')} weights."
    )


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [
        "# Adaptive speculation controller: benchmark",
        "",
        f"Command: `{meta['command']}`  ",
        f"Target `{meta['model']}`, draft `{meta['draft_model']}`, {meta['max_tokens']} output "
        f"tokens per request (EOS ignored), total run {meta['total_seconds']:.0f} s."
        + _machine(meta),
        "",
        _method(meta),
        "",
    ]
    if meta["model"] == "tiny":
        lines += [
            "Tiny random models: this run shows the script works end to end; its timings say "
            "nothing about the controller on real models.",
            "",
        ]
    points = _points(rows)
    for workload in sorted({w for w, _ in points}):
        lines += [f"## {workload}", ""]
        arms = [
            a for a in ARM_ORDER if any(a in v for (w, _), v in points.items() if w == workload)
        ]
        head = ["c"] + [f"{a} tok/s" for a in arms] + [f"{a} TPOT p50/p99" for a in arms]
        head += ["adaptive mean k (spec %)", "accept (k4)", "checks", "checks on medians"]
        head.append("per round ÷ best; ÷ plain")
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for (w, c), by_arm in sorted(points.items()):
            if w != workload:
                continue
            cells = [str(c)]
            cells += [f"{by_arm[a]['throughput_tok_s']:.2f}" if a in by_arm else "-" for a in arms]
            cells += [
                f"{by_arm[a]['tpot_median_ms']:.0f}/{by_arm[a]['tpot_p99_ms']:.0f}"
                if a in by_arm
                else "-"
                for a in arms
            ]
            ad = by_arm.get("adaptive")
            cells.append(f"{ad['mean_k']:.2f} ({ad['speculating_fraction']:.0%})" if ad else "-")
            k4 = by_arm.get("fixed-k4")
            cells.append(f"{k4['acceptance_rate']:.2f}" if k4 else "-")
            for paired in (True, False):
                cells.append(_marks(check_targets(w, c, by_arm, paired)))
            ratios = round_ratios(by_arm)
            cells.append(
                "; ".join(" ".join(f"{r:.2f}" for r in ratios[key]) or "-" for key in ratios)
            )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    final = meta.get("controller_final", {})
    if final:
        lines += ["## Adaptive controller at the end of the run", "", "```"]
        lines += [f"{k}: {v}" for k, v in final.items()]
        lines += ["```", ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = _points(rows)
    workloads = sorted({w for w, _ in points})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        conc = sorted(c for w, c in points if w == workload)
        for arm in ARM_ORDER:
            xs = [c for c in conc if arm in points[(workload, c)]]
            if not xs:
                continue
            tp = [points[(workload, c)][arm]["throughput_tok_s"] for c in xs]
            tpot = [points[(workload, c)][arm]["tpot_median_ms"] for c in xs]
            style = {"linewidth": 2.5} if arm == "adaptive" else {"linestyle": "--"}
            axes[row][0].plot(xs, tp, marker="o", label=arm, **style)
            axes[row][1].plot(xs, tpot, marker="o", label=arm, **style)
        for col, ylabel in enumerate(("output tokens / s", "median time per output token (ms)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xticks(conc, [str(c) for c in conc])
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{workload}")
            ax.grid(alpha=0.3)
        axes[row][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_results(parts: list[dict]) -> tuple[dict, list[dict]]:
    """One (meta, rows) from several runs' results; a point measured twice is refused (which
    run's would be the result is a choice the report must not make silently)."""
    if not parts:
        raise ValueError("nothing to merge")
    rows: list[dict] = []
    seen: set[tuple[str, int, str]] = set()
    for part in parts:
        for r in part["results"]:
            key = (r["workload"], r["concurrency"], r["arm"])
            if key in seen:
                raise ValueError(f"{key[0]} c={key[1]} {key[2]} is in more than one part")
            seen.add(key)
            rows.append(r)
    metas = [p["meta"] for p in parts]
    for field in ("model", "draft_model", "max_tokens", "repeats", "arms_step_in_turn"):
        if len({str(m.get(field)) for m in metas}) > 1:
            raise ValueError(f"the parts differ in {field}: not one benchmark")
    meta = {
        **metas[0],
        "command": "`; `".join(m["command"] for m in metas),
        "concurrency": sorted({c for m in metas for c in m["concurrency"]}),
        "total_seconds": sum(m["total_seconds"] for m in metas),
    }
    meta.pop("controller_final", None)  # each part's own controller ended differently
    return meta, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Merge bench_controller results into one report.")
    ap.add_argument("parts", nargs="+", type=Path, help="results JSON files")
    ap.add_argument("--out", type=Path, required=True, help="path stem for .json, .md and .png")
    args = ap.parse_args(argv)
    meta, rows = merge_results([json.loads(p.read_text()) for p in args.parts])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    write_markdown(args.out.with_suffix(".md"), meta, rows)
    write_plot(args.out.with_suffix(".png"), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
