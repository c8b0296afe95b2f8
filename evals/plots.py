"""PNG plots of eval and bench results (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.evals.eval_rows import SpecRow


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _arm(r: SpecRow) -> str:
    """The proposer, and the tree size when the row's steps drafted trees."""
    return r.proposer + (f" tree={r.tree_nodes}" if r.tree_nodes else "")


def _temps(rows: Sequence[SpecRow]) -> list[float]:
    return sorted({r.temperature for r in rows})


def plot_acceptance_by_position(rows: Sequence[SpecRow], path: Path) -> Path:
    """Acceptance of draft position j (all categories), one line per proposer and k, one panel per
    temperature."""
    plt = _pyplot()
    temps = _temps(rows)
    fig, axes = plt.subplots(1, max(1, len(temps)), figsize=(5.5 * max(1, len(temps)), 4))
    axes = list(axes) if len(temps) > 1 else [axes]
    for ax, temp in zip(axes, temps, strict=False):
        for r in rows:
            if r.temperature != temp or r.category != "all" or not r.acceptance_per_pos:
                continue
            xs = list(range(1, len(r.acceptance_per_pos) + 1))
            ax.plot(xs, r.acceptance_per_pos, marker="o", label=f"{_arm(r)} k={r.k}")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"acceptance by draft position, T={temp:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted share")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup_by_k(rows: Sequence[SpecRow], path: Path) -> Path:
    """Speedup against plain decode by k, one line per category, one panel per proposer x
    temperature; the dashed line at 1 is break-even."""
    plt = _pyplot()
    temps = _temps(rows)
    proposers = list(dict.fromkeys(_arm(r) for r in rows))
    n_r, n_c = max(1, len(temps)), max(1, len(proposers))
    fig, axes = plt.subplots(n_r, n_c, figsize=(5.5 * n_c, 4 * n_r), squeeze=False)
    for i, temp in enumerate(temps):
        for j, proposer in enumerate(proposers):
            ax = axes[i][j]
            sel = [r for r in rows if r.temperature == temp and _arm(r) == proposer]
            for cat in dict.fromkeys(r.category for r in sel):
                pts = sorted((r.k, r.speedup) for r in sel if r.category == cat and r.speedup)
                if not pts:
                    continue
                style = {"linewidth": 2.5, "color": "black"} if cat == "all" else {"alpha": 0.8}
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cat, **style)
            ax.axhline(1.0, linestyle="--", color="grey", linewidth=1)
            ax.set_xticks(sorted({r.k for r in sel}))
            ax.set_title(f"{proposer}, T={temp:g}")
            ax.set_xlabel("k (draft tokens per step)")
            ax.set_ylabel("speedup vs plain decode")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


LATENCY_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
STATS = ("mean", "median", "p90", "p99")


def plot_latency_percentiles(runs: Sequence[dict], path: Path) -> Path:
    """Grouped bars: mean/median/p90/p99 of each latency metric, one bar per arm (and load)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(LATENCY_METRICS), figsize=(4.5 * len(LATENCY_METRICS), 4))
    width = 0.8 / max(1, len(runs))
    for ax, (key, title) in zip(axes, LATENCY_METRICS, strict=True):
        for i, run in enumerate(runs):
            values = [run["metrics"][key][s] or 0.0 for s in STATS]
            xs = [x + i * width for x in range(len(STATS))]
            ax.bar(xs, values, width=width, label=run_label(run))
        ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(STATS))])
        ax.set_xticklabels(STATS)
        ax.set_title(f"{title} (ms)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_load_sweep(runs: Sequence[dict], path: Path) -> Path:
    """Output token throughput and median TPOT against concurrency, one line per arm."""
    plt = _pyplot()
    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in dict.fromkeys(r["arm"] for r in runs):
        pts = sorted(
            ((r["concurrency"], r["metrics"]) for r in runs if r["arm"] == arm),
            key=lambda p: p[0],
        )
        xs = [p[0] for p in pts]
        ax_tp.plot(xs, [m["output_token_throughput"] for _, m in pts], marker="o", label=arm)
        ax_tpot.plot(xs, [m["tpot_ms"]["median"] or 0.0 for _, m in pts], marker="o", label=arm)
    ax_tp.set_title("output token throughput")
    ax_tp.set_ylabel("tokens / s")
    ax_tpot.set_title("median TPOT")
    ax_tpot.set_ylabel("ms")
    levels = sorted({r["concurrency"] for r in runs if r["concurrency"] is not None})
    for ax in (ax_tp, ax_tpot):
        ax.set_xticks(levels)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_label(run: dict) -> str:
    load = f"c={run['concurrency']}" if run.get("concurrency") else f"rate={run['request_rate']}"
    return f"{run['arm']} {load}"
