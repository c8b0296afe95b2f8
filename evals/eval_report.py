"""Eval outputs: eval.json, eval.md (a table per category) and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.evals.eval_rows import ALL, BaselineRow, EvalReport, PlainRow, SpecRow
from specdec.evals.plots import plot_acceptance_by_position, plot_speedup_by_k

HEADER = (
    "| configuration | T | tok/s | speedup | speedup (CPU time) | acceptance "
    "| mean accepted length | acceptance by position | draft time | verify time | greedy = plain |"
)
RULE = "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|:---:|"


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return _f(None if value is None else 100 * value, "{:.0f}%")


def _plain_line(r: PlainRow) -> str:
    return (
        f"| plain | {r.temperature:g} | {r.tokens_per_s:.2f} | 1.00 | 1.00 | - | 1.00 | - | - | - "
        "| - |"
    )


def _spec_line(r: SpecRow) -> str:
    per_pos = " ".join(f"{a:.2f}" for a in r.acceptance_per_pos) or "-"
    same = {None: "-", True: "yes", False: f"**NO ({r.num_mismatches})**"}[r.greedy_identical]
    cells = [
        f"{r.proposer} k={r.k}" + (f" tree={r.tree_nodes}" if r.tree_nodes else ""),
        f"{r.temperature:g}",
        f"{r.tokens_per_s:.2f}",
        _f(r.speedup),
        _f(r.speedup_cpu),
        _pct(r.acceptance_rate),
        f"{r.mean_accepted_length:.2f}",
        per_pos,
        _pct(r.draft_time_share),
        _pct(r.verify_time_share),
        same,
    ]
    return "| " + " | ".join(cells) + " |"


def _baseline_line(r: BaselineRow) -> str:
    name = r.name if r.k is None else f"{r.name} k={r.k}"
    return (
        f"| {name} | {r.temperature:g} | {r.tokens_per_s:.2f} | {_f(r.speedup_vs_hf_plain)} "
        f"| {_f(r.speedup_cpu_vs_hf_plain)} | - | - | - | - | - "
        f"| {r.matches_engine_plain}/{r.num_prompts} |"
    )


def category_table(report: EvalReport, category: str) -> str:
    lines = [HEADER, RULE]
    for temp in dict.fromkeys(r.temperature for r in report.plain):
        lines += [
            _plain_line(r) for r in report.plain if r.category == category and r.temperature == temp
        ]
        lines += [
            _spec_line(r) for r in report.spec if r.category == category and r.temperature == temp
        ]
        lines += [
            _baseline_line(r)
            for r in report.baselines
            if r.category == category and r.temperature == temp
        ]
    return "\n".join(lines)


def to_markdown(report: EvalReport) -> str:
    meta = report.meta
    out = ["# Speculative decoding eval", ""]
    if meta.get("target"):
        out.append(f"Target `{meta['target']}`, draft `{meta.get('draft') or '-'}`.")
    if meta.get("command"):
        out += ["", f"Command: `{meta['command']}`"]
    out += [
        "",
        "tok/s: output tokens per second of request wall time, one request at a time. speedup: "
        "against plain decode on the same prompts in the same run (for transformers rows: "
        "against transformers plain); speedup (CPU time): the same ratio over this process's CPU "
        "time, which other jobs on the machine disturb much less. acceptance: accepted / drafted "
        "tokens. mean accepted length: tokens committed per target forward, bonus token "
        "included. draft/verify time: shares of engine step time. greedy = plain: speculative "
        "output token-identical to plain decode at T=0 (transformers rows: prompts identical "
        "to the engine's plain output).",
        "",
    ]
    if report.failures:
        out += ["## FAILURES", ""]
        out += [
            f"- {f['proposer']} k={f['k']} {f['prompt_id']}: differs at output token "
            f"{f['position']}"
            for f in report.failures
        ]
        out.append("")
    categories = [ALL] + [c for c in report.categories() if c != ALL]
    for cat in categories:
        n = next((r.num_prompts for r in report.plain if r.category == cat), 0)
        title = "All categories" if cat == ALL else cat
        out += [f"## {title} ({n} prompts)", "", category_table(report, cat), ""]
    if report.skipped_prompts:
        out += ["## Skipped prompts", ""]
        out += [f"- {s['prompt_id']}: {s['reason']}" for s in report.skipped_prompts]
    return "\n".join(out).rstrip() + "\n"


def write_eval_outputs(report: EvalReport, output_dir: str | Path) -> dict[str, Path]:
    """Write eval.json, eval.md and the plots; return their paths by kind."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "markdown": out / "eval.md"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    if report.spec:
        paths["acceptance_plot"] = plot_acceptance_by_position(
            report.spec, out / "acceptance_by_position.png"
        )
        paths["speedup_plot"] = plot_speedup_by_k(report.spec, out / "speedup_by_k.png")
    return paths
