"""`specdec replay`: every speculation policy on recorded traces, against simulated time.

Runs the engine's scheduler, allocator, step loop and controllers on the traces `specdec trace`
recorded (the committed set by default); writes replay.json and replay.md. See docs/evals.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replay")
    g.add_argument(
        "--traces", default=None, help="trace set directory (default: evals/data/traces)"
    )
    g.add_argument(
        "--cost-table-from",
        default=None,
        help="price the steps by another cost table: a trace set (directory or meta.json) or a "
        "file of `specdec trace --cost-table-only`'s keys (default: the traces' own)",
    )
    g.add_argument("--output-dir", default="replay-results", help="where replay.json/.md go")
    g.add_argument(
        "--scenarios", default="all", help="scenario names, comma-separated (default: all)"
    )
    g.add_argument("--policies", default="all", help="policy names, comma-separated (default: all)")
    g.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes the runs are spread over (default: one per CPU; output is the same)",
    )
    g.add_argument(
        "--baseline",
        default=None,
        help="an earlier replay.json on the same traces: replay.md checks adaptive against it",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from specdec.evals.environment import command_line, git_commit
    from specdec.evals.replay import default_policies
    from specdec.evals.replay_suite import (
        default_scenarios,
        pick_by_name,
        run_suite,
        targets_markdown,
        to_json,
        to_markdown,
    )
    from specdec.evals.traces import load_cost_table, load_traces, priced_by

    torch.set_num_threads(1)  # the replay's tensors are tiny: threads only add overhead
    logging.getLogger("engine").setLevel(logging.WARNING)
    logging.getLogger("specdec").setLevel(logging.WARNING)
    traces = load_traces(args.traces)
    if args.cost_table_from:
        traces = priced_by(traces, load_cost_table(args.cost_table_from))
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    scenarios = pick_by_name(args.scenarios, default_scenarios(), "scenario")
    policies = pick_by_name(args.policies, default_policies(), "policy")
    start = time.perf_counter()
    report = run_suite(traces, scenarios, policies, workers=args.workers)
    seconds = time.perf_counter() - start
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(to_json(report))
    meta = traces.meta
    header = (
        f"# Replay\n\n`{command_line()}` (commit {git_commit()}) on the traces "
        f"recorded by `{meta.get('command', '?')}` "
        f"(commit {meta.get('commit', '?')}; {meta.get('machine', {}).get('cpu', '?')}, "
        f"{meta.get('machine', {}).get('threads', '?')} threads)"
    )
    if "cost_table_command" in meta:
        header += (
            f", cost table by `{meta['cost_table_command']}` "
            f"(commit {meta.get('cost_table_commit', '?')}; "
            f"{meta.get('cost_table_machine', {}).get('cpu', '?')})"
        )
        if args.cost_table_from:
            header += f" read from `{args.cost_table_from}`"
    header += (
        ". Output tokens per simulated second; the best policy of each scenario in bold. "
        "docs/evals.md explains the scenarios, policies and approximations.\n\n"
    )
    body = to_markdown(report, header)
    names = {p.name for p in policies}
    if {"adaptive", "plain"} <= names and any(n.startswith("fixed_k") for n in names):
        body += "\n## Targets\n\n"
        if args.baseline:
            body += f"Baseline: `{args.baseline}`.\n\n"
        body += targets_markdown(report, baseline)
    (out / "replay.md").write_text(body)
    print(to_markdown(report))
    print(f"replayed {len(scenarios)} scenarios x {len(policies)} policies in {seconds:.1f} s")
    return 0
