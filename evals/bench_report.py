"""Bench outputs: the side-by-side table printed at the end, bench.json and the plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from specdec.evals.metrics import RequestRecord
from specdec.evals.plots import plot_latency_percentiles, plot_load_sweep, run_label

ROWS: list[tuple[str, str, str | None]] = [
    ("completed", "completed", None),
    ("failed", "failed", None),
    ("duration (s)", "duration_s", None),
    ("request throughput (req/s)", "request_throughput", None),
    ("output token throughput (tok/s)", "output_token_throughput", None),
    ("total token throughput (tok/s)", "total_token_throughput", None),
]
LATENCY_ROWS = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]


def request_dict(prompt_id: str, record: RequestRecord) -> dict:
    """Per-request row of bench.json (milliseconds)."""

    def ms(v: float | None) -> float | None:
        return None if v is None else 1000 * v

    return {
        "prompt_id": prompt_id,
        "ttft_ms": ms(record.ttft),
        "tpot_ms": ms(record.tpot),
        "e2e_ms": ms(record.e2e),
        "itl_ms": [1000 * x for x in record.itls],
        "output_tokens": record.output_tokens,
        "prompt_tokens": record.prompt_tokens,
        "server_arm": record.arm,
        "speculative": record.speculative,
        "error": record.error,
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def side_by_side(runs: Sequence[dict]) -> str:
    """A plain-text table: one column per run (arm and load), one row per metric."""
    header = ["metric", *(run_label(r) for r in runs)]
    table: list[list[str]] = []
    for title, key, _ in ROWS:
        table.append([title, *(_cell(r["metrics"].get(key)) for r in runs)])
    for title, key in LATENCY_ROWS:
        for stat in ("mean", "median", "p90", "p99"):
            table.append([f"{stat} {title} (ms)", *(_cell(r["metrics"][key][stat]) for r in runs)])
    if any("goodput" in r["metrics"] for r in runs):
        table.append(["goodput (req/s)", *(_cell(r["metrics"].get("goodput")) for r in runs)])
        table.append(
            ["requests within SLO", *(_cell(r["metrics"].get("good_requests")) for r in runs)]
        )
    if any("speculative" in r["metrics"] for r in runs):
        table.append(
            [
                "acceptance rate",
                *(_cell(r["metrics"].get("speculative", {}).get("acceptance_rate")) for r in runs),
            ]
        )
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(cells)

    lines = [fmt(row) for row in [header, *table]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ab_summary(runs: Sequence[dict]) -> list[str]:
    """One line per load level comparing the spec arm with the plain arm."""
    lines = []
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in runs:
        by_key.setdefault((r["concurrency"], r["request_rate"]), {})[r["arm"]] = r["metrics"]
    for (conc, rate), arms in by_key.items():
        if "spec" not in arms or "plain" not in arms:
            continue
        s, p = arms["spec"], arms["plain"]
        load = f"concurrency {conc}" if conc else f"rate {rate}/s"

        def ratio(a: float | None, b: float | None) -> str:
            return f"x{a / b:.2f}" if a and b else "-"

        lines.append(
            f"spec / plain at {load}: output throughput "
            f"{ratio(s['output_token_throughput'], p['output_token_throughput'])}, "
            f"median TPOT {ratio(s['tpot_ms']['median'], p['tpot_ms']['median'])}, "
            f"median E2E {ratio(s['e2e_ms']['median'], p['e2e_ms']['median'])}"
        )
    return lines


def json_safe(value):
    """inf/nan are not JSON: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_bench_outputs(result: dict, output_dir: str | Path) -> dict[str, Path]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json"}
    paths["json"].write_text(json.dumps(json_safe(result), indent=2) + "\n")
    runs = [r for r in result["runs"] if r["metrics"]["completed"]]
    if runs:
        paths["latency_plot"] = plot_latency_percentiles(runs, out / "latency_percentiles.png")
    if len({r["concurrency"] for r in runs}) > 1:
        paths["sweep_plot"] = plot_load_sweep(runs, out / "throughput_tpot_vs_concurrency.png")
    return paths
