"""`specdec bench`: load-test a running server through the OpenAI API (see docs/evals.md)."""

from __future__ import annotations

import argparse
import math
import sys

from specdec.evals.cli_args import ArgumentError, parse_ints
from specdec.evals.datasets import load_categories, load_prompt_file, parse_categories
from specdec.evals.loadgen import LoadSpec
from specdec.evals.metrics import parse_slo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    g.add_argument(
        "--model",
        default=None,
        help="model name to request (default: the first one the server lists)",
    )
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    w = parser.add_argument_group("workload")
    w.add_argument("--categories", default="all", help="built-in prompt categories, or all")
    w.add_argument("--dataset", default=None, help="a JSONL prompt file instead of the built-ins")
    w.add_argument("--num-prompts", type=int, default=16, help="measured requests per run")
    w.add_argument("--warmup", type=int, default=1, help="untimed requests per arm before runs")
    w.add_argument(
        "--no-prime-cache",
        action="store_true",
        help="do not send each prompt once (max_tokens=1) before measuring; then the first arm "
        "and load level meet a cold prefix cache and later ones a warm one",
    )
    w.add_argument("--max-tokens", type=int, default=128)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (server support needed)"
    )
    w.add_argument("--seed", type=int, default=0, help="arrival times and sampling seeds")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        default=None,
        help="requests in flight, or a comma-separated sweep such as 1,2,4 (default: 1, or no cap "
        "with --request-rate)",
    )
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default: inf)"
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier",
    )
    arms = parser.add_argument_group("arms")
    arms.add_argument(
        "--ab", action="store_true", help="run the spec and plain arms on the same workload"
    )
    arms.add_argument(
        "--speculative",
        choices=("auto", "on", "off"),
        default=None,
        help="per-request speculation switch (with --ab: the spec arm's mode, default auto)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,tpot=50")
    out.add_argument("--output-dir", default="bench-results")
    out.add_argument("--no-progress", action="store_true")


def loads_from_args(args: argparse.Namespace) -> list[LoadSpec]:
    if not args.request_rate > 0:
        raise ArgumentError(f"--request-rate must be > 0, got {args.request_rate:g}")
    if not args.burstiness > 0:
        raise ArgumentError(f"--burstiness must be > 0, got {args.burstiness:g}")
    if args.concurrency is None:
        levels = [None] if math.isfinite(args.request_rate) else [1]
    else:
        levels = parse_ints(args.concurrency, "--concurrency", 1)
    return [LoadSpec(c, args.request_rate, args.burstiness) for c in levels]


def run(args: argparse.Namespace) -> int:
    from specdec.evals.bench_report import ab_summary, side_by_side, write_bench_outputs
    from specdec.evals.bench_runner import (
        BenchConfig,
        choose_arms,
        probe_server,
        run_bench,
        select_prompts,
    )
    from specdec.evals.environment import command_line, environment_info
    from specdec.evals.sse_client import RequestSpec

    # Everything the user typed is checked before the server is contacted.
    slo = parse_slo(args.slo)
    loads = loads_from_args(args)
    for flag, value, low in (
        ("--num-prompts", args.num_prompts, 1),
        ("--warmup", args.warmup, 0),
        ("--max-tokens", args.max_tokens, 1),
    ):
        if value < low:
            raise ArgumentError(f"{flag} must be >= {low}, got {value}")
    if args.temperature < 0:
        raise ArgumentError(f"--temperature must be >= 0, got {args.temperature:g}")
    if args.dataset:
        pool = load_prompt_file(args.dataset)
    else:
        pool = load_categories(parse_categories(args.categories))
    prompts = select_prompts(pool, args.num_prompts)

    models = probe_server(args.base_url, timeout=10.0)
    model = args.model or (models[0] if models else None)
    if model is None:
        raise ArgumentError(f"the server at {args.base_url} lists no models; pass --model")
    cfg = BenchConfig(
        base_url=args.base_url,
        request=RequestSpec(
            model, args.endpoint, args.max_tokens, args.temperature, None, args.ignore_eos
        ),
        arms=choose_arms(args.ab, args.speculative),
        loads=loads,
        warmup=args.warmup,
        prime_cache=not args.no_prime_cache,
        slo=slo,
        seed=args.seed,
        request_timeout=args.request_timeout,
    )
    runs = run_bench(cfg, prompts, progress=not args.no_progress)
    result = {
        "meta": {
            "command": command_line(),
            "base_url": args.base_url,
            "model": model,
            "endpoint": args.endpoint,
            "num_prompts": args.num_prompts,
            "warmup": args.warmup,
            "prime_cache": cfg.prime_cache,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "slo_ms": {k: v * 1000 for k, v in slo.items()},
            "categories": sorted({p.category for p in prompts}),
            "environment": environment_info(),
        },
        "runs": runs,
    }
    paths = write_bench_outputs(result, args.output_dir)
    print(side_by_side(runs))
    for line in ab_summary(runs):
        print(line)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return _exit_code(runs)


def _exit_code(runs: list[dict]) -> int:
    """Non-zero when some run completed nothing (the first error says why)."""
    status = 0
    for run in runs:
        m = run["metrics"]
        if m["failed"]:
            first = m["errors"][0] if m["errors"] else "unknown error"
            print(
                f"warning: {m['failed']} of {m['num_requests']} requests failed in the "
                f"{run['arm']} arm: {first}",
                file=sys.stderr,
            )
        if not m["completed"]:
            status = 1
        mismatched = {a for a in run["server_arms"] if a not in (run["arm"], "unreported")}
        if run["arm"] != "default" and mismatched:
            print(
                f"warning: the {run['arm']} arm was served as {sorted(mismatched)} (X-Specdec-Arm)",
                file=sys.stderr,
            )
    return status
