"""The replay suite: scenarios built from a trace set, every policy on each, replay.json/.md.

Workloads: ``code`` is the code categories at temperature 0, ``open`` every other category at
temperature 1. A scenario with more requests than its pool holds reuses recorded requests as
replicas whose prompts fold into other local ids (no prefix-cache sharing between replicas; a
replica's acceptance draws at temperature 1 are its own).

Scenario times (slow-down windows, stalls, Poisson rates) are derived from the cost table and the
requests, never from a run, so every policy meets the same machine.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from specdec.engine.errors import ConfigError
from specdec.evals.cost_table import StepCosts
from specdec.evals.replay import (
    EngineShape,
    Policy,
    PolicyResult,
    ReplayRequest,
    Round,
    Workload,
    default_policies,
    replay_request,
    run_policy,
)
from specdec.evals.traces import RequestTrace, TraceSet

CODE_CATEGORIES = ("code_generation", "code_editing")
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
LONG_PROMPT_TOKENS = 3840  # prompt + output stay within the replay engine's 4096 positions
SEED = 0
# The live sweep's code workload: its warm-up (requests, tokens), concurrencies, rounds a point
# and tokens a request; the points replayed with their rounds measured.
SWEEP_WARMUP = (8, 32)
SWEEP_CONCURRENCIES = (1, 4, 8, 16)
SWEEP_ROUNDS = 3
SWEEP_TOKENS = 48
SWEEP_MEASURED = (8, 16)


def requests_for(c: int) -> int:
    """Requests per closed-loop scenario at concurrency ``c``: enough for the batch to fill and
    drain (2c), at least 8; kept small so the whole suite replays in well under a minute."""
    return max(8, 2 * c)


def code_pool(traces: Sequence[RequestTrace]) -> list[RequestTrace]:
    return [t for t in traces if t.category in CODE_CATEGORIES and t.temperature == 0]


def open_pool(traces: Sequence[RequestTrace]) -> list[RequestTrace]:
    return [t for t in traces if t.category not in CODE_CATEGORIES and t.temperature > 0]


def build_requests(
    name: str,
    pool: Sequence[RequestTrace],
    n: int,
    filler_to: int = 0,
    start: int = 0,
    max_tokens: int = 0,
) -> list[ReplayRequest]:
    """``n`` requests cycling through ``pool``; ``filler_to`` pads prompts to that many tokens,
    ``max_tokens`` cuts the recorded outputs to that many."""
    if not pool:
        raise ValueError(f"scenario {name}: the trace set has no requests for its workload")
    out = []
    for i in range(start, start + n):
        trace = pool[i % len(pool)]
        filler = max(0, filler_to - int(trace.prompt_ids.shape[0])) if filler_to else 0
        req = replay_request(trace, f"{name}-{i}", SEED, i // len(pool), filler)
        out.append(req.cut(max_tokens) if max_tokens else req)
    return out


def plain_seconds_estimate(requests: Sequence[ReplayRequest], c: int, costs: StepCosts) -> float:
    """Rough plain-decoding duration of a closed loop at concurrency ``c`` (for placing slow-down
    windows and stalls inside the run): steps of ``c`` one-row decodes, plus the prompts."""
    tokens = sum(len(r.path) for r in requests)
    step = costs.target_seconds([(1, len(r.prompt)) for r in requests[:c]], sampled_rows=c)
    prefill = sum(costs.target_seconds([(len(r.prompt), 0)], sampled_rows=1) for r in requests)
    return tokens / min(c, len(requests)) * step + prefill


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    build: Callable[[TraceSet, StepCosts], Workload]


def _closed(pool_of, c: int, name: str) -> Callable[[TraceSet, StepCosts], Workload]:
    def build(traces: TraceSet, costs: StepCosts) -> Workload:
        return Workload(build_requests(name, pool_of(traces.requests), requests_for(c)), c)

    return build


def _slowdown(traces: TraceSet, costs: StepCosts) -> Workload:
    c = 8
    reqs = build_requests("slowdown", code_pool(traces.requests), requests_for(c))
    est = plain_seconds_estimate(reqs, c, costs)
    return Workload(reqs, c, slowdowns=[(0.25 * est, 0.6 * est, 1.3)])


def _stalls(traces: TraceSet, costs: StepCosts) -> Workload:
    c = 4
    reqs = build_requests("stalls", open_pool(traces.requests), requests_for(c))
    est = plain_seconds_estimate(reqs, c, costs)
    stall = 10 * costs.target_seconds(
        [(1, 256)], sampled_rows=1
    )  # ten single-sequence decode steps
    return Workload(
        reqs, c, stalls=[est * f for f in (0.15, 0.35, 0.55, 0.75)], stall_seconds=stall
    )


def _switch(traces: TraceSet, costs: StepCosts) -> Workload:
    c, n = 8, requests_for(8)
    first = build_requests("switch", code_pool(traces.requests), n // 2)
    second = build_requests("switch", open_pool(traces.requests), n - n // 2, start=n // 2)
    return Workload(first + second, c)


def _burst(traces: TraceSet, costs: StepCosts) -> Workload:
    """Code requests two at a time, then sixteen at once: the decision the pairs left is held
    when the burst's prompts and first decodes share steps."""
    pool = code_pool(traces.requests)
    pairs = build_requests("burst-pairs", pool, 8)
    burst = build_requests("burst", pool, 16, start=8)
    pair_seconds = plain_seconds_estimate(pairs[:2], 2, costs)
    for i, r in enumerate(pairs):
        r.arrival = (i // 2) * pair_seconds
    for r in burst:
        r.arrival = 4.5 * pair_seconds
    return Workload(pairs + burst, None)


def _ramp(traces: TraceSet, costs: StepCosts) -> Workload:
    """Code requests from 8 clients, then from 16: the decision and the cost fit that 8 sequences
    left meet a batch twice as large, as when a server's load grows (or a sweep's points follow
    each other on one engine)."""
    first = requests_for(8)
    reqs = build_requests("ramp", code_pool(traces.requests), first + 4 * 16)
    return Workload(reqs, 8, grow_to=(first, 16))


def _long_prompts(traces: TraceSet, costs: StepCosts) -> Workload:
    c = 4
    reqs = build_requests(
        "long", code_pool(traces.requests), requests_for(c), filler_to=LONG_PROMPT_TOKENS
    )
    return Workload(reqs, c)


def _mixed(traces: TraceSet, costs: StepCosts) -> Workload:
    """Poisson arrivals (fixed seed) of code and open requests, interleaved at random, at 60% of
    what plain decoding at eight sequences could serve."""
    n = 32
    code = build_requests("mixed-code", code_pool(traces.requests), n)
    chat = build_requests("mixed-open", open_pool(traces.requests), n)
    rng = np.random.default_rng(SEED)
    picks = rng.random(n) < 0.5
    reqs = [code[i] if picks[i] else chat[i] for i in range(n)]
    mean_tokens = sum(len(r.path) for r in reqs) / n
    plain_rate = 8 / costs.target_seconds(
        [(1, 256)] * 8, sampled_rows=8
    )  # tokens/s at eight sequences
    rate = 0.6 * plain_rate / mean_tokens  # requests per second
    t = 0.0
    for r, gap in zip(reqs, rng.exponential(1.0 / rate, n), strict=True):
        t += float(gap)
        r.arrival = t
    return Workload(reqs, None)


def _sweep(measured_c: int) -> Callable[[TraceSet, StepCosts], Workload]:
    """The live sweep's code points (``evals/controller_sweep``) on one engine, as they follow
    each other: untimed pairs, then three rounds per concurrency of max(c, 4) requests of
    ``SWEEP_TOKENS``, each round started once the last drained, up to ``measured_c``'s rounds,
    the only ones reported. A round of c requests at c clients starts them all at once."""

    def build(traces: TraceSet, costs: StepCosts) -> Workload:
        pool = code_pool(traces.requests)
        rounds = [Round(SWEEP_WARMUP[0], 2, measured=False)]
        for c in SWEEP_CONCURRENCIES[: SWEEP_CONCURRENCIES.index(measured_c) + 1]:
            rounds += [Round(max(c, 4), c, measured=c == measured_c)] * SWEEP_ROUNDS
        name = f"sweep{measured_c}"
        reqs = build_requests(name, pool, rounds[0].size, max_tokens=SWEEP_WARMUP[1])
        n = sum(r.size for r in rounds[1:])
        reqs += build_requests(name, pool, n, start=rounds[0].size, max_tokens=SWEEP_TOKENS)
        return Workload(reqs, None, rounds=tuple(rounds))

    return build


def default_scenarios() -> list[Scenario]:
    out = []
    for c in CONCURRENCIES:
        out.append(
            Scenario(f"code_c{c}", f"code at T=0, {c} clients", _closed(code_pool, c, f"code{c}"))
        )
    for c in CONCURRENCIES:
        out.append(
            Scenario(f"open_c{c}", f"open at T=1, {c} clients", _closed(open_pool, c, f"open{c}"))
        )
    out += [
        Scenario("slowdown", "code at T=0, 8 clients; the machine 30% slower mid-run", _slowdown),
        Scenario("stalls", "open at T=1, 4 clients; four single stalled steps", _stalls),
        Scenario("switch", "8 clients; code at T=0, then open at T=1", _switch),
        Scenario("burst", "code at T=0: four pairs, then 16 requests at once", _burst),
        Scenario("ramp", "code at T=0: 16 requests from 8 clients, then 64 from 16", _ramp),
        Scenario(
            "long_prompts", "code at T=0, 4 clients; prompts padded to 3840 tokens", _long_prompts
        ),
        Scenario(
            "mixed", "Poisson arrivals of code and open requests at 60% of plain capacity", _mixed
        ),
    ]
    out += [
        Scenario(f"sweep_code_c{c}", f"the live sweep's code rounds up to {c} clients", _sweep(c))
        for c in SWEEP_MEASURED
    ]
    return out


def pick_by_name(text: str, items: list, what: str) -> list:
    """The items (scenarios, policies) named in comma-separated ``text``; all for '' or 'all'."""
    if text.strip() in ("", "all"):
        return items
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {i.name: i for i in items}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run_suite(
    traces: TraceSet,
    scenarios: Sequence[Scenario] | None = None,
    policies: Sequence[Policy] | None = None,
    on_result: Callable[[str, str, PolicyResult], None] | None = None,
    workers: int = 1,
) -> dict:
    """Every policy on every scenario; the replay.json body.

    With ``workers`` > 1 the (scenario, policy) runs of the default scenarios and policies are
    spread over that many processes (each run is independent and deterministic, and results are
    gathered in order, so the output is byte for byte the serial one)."""
    scenarios = list(scenarios if scenarios is not None else default_scenarios())
    policies = list(policies if policies is not None else default_policies())
    shape = engine_shape(traces)
    pairs = [(sc, policy) for sc in scenarios for policy in policies]
    if workers > 1 and _all_defaults(scenarios, policies):
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, ctx, _worker_init, (traces, shape)) as pool:
            names = [(sc.name, policy.name) for sc, policy in pairs]
            results = list(pool.map(_run_named, names))
    else:
        costs = StepCosts(traces.cost_table)
        results = [
            run_policy(sc.build(traces, costs), policy, costs, shape)[0] for sc, policy in pairs
        ]
    out = []
    for i, sc in enumerate(scenarios):
        row: dict = {"name": sc.name, "description": sc.description}
        metrics: dict[str, dict[str, float]] = {
            m: {} for m in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "mean_k", "acceptance")
        }
        for j, policy in enumerate(policies):
            result = results[i * len(policies) + j]
            metrics["tokens_per_s"][policy.name] = round(result.tokens_per_s, 3)
            metrics["ttft_p50_s"][policy.name] = round(_percentile(result.ttft, 50), 4)
            metrics["ttft_p99_s"][policy.name] = round(_percentile(result.ttft, 99), 4)
            metrics["mean_k"][policy.name] = round(result.mean_k, 3)
            acc = result.accepted / result.drafted if result.drafted else 0.0
            metrics["acceptance"][policy.name] = round(acc, 4)
            row["requests"] = len(result.ttft)
            row["output_tokens"] = result.tokens
            if on_result:
                on_result(sc.name, policy.name, result)
        row.update(metrics)
        out.append(row)
    return {"scenarios": out}


def engine_shape(traces: TraceSet) -> EngineShape:
    """The replayed engine: the recorded pair's pool and batch limits."""
    eng = traces.meta.get("engine", {})
    return EngineShape(
        num_kv_blocks=eng["num_kv_blocks"],
        page_size=eng.get("page_size", 16),
        max_num_seqs=eng.get("max_num_seqs", 32),
        max_num_batched_tokens=eng.get("max_num_batched_tokens", 512),
    )


def _all_defaults(scenarios: Sequence[Scenario], policies: Sequence[Policy]) -> bool:
    """Whether every scenario and policy is a default one (a worker rebuilds them by name)."""
    known_scenarios = {s.name for s in default_scenarios()}
    known_policies = {p.name for p in default_policies()}
    return all(s.name in known_scenarios for s in scenarios) and all(
        p.name in known_policies for p in policies
    )


_WORKER: dict = {}


def _worker_init(traces: TraceSet, shape: EngineShape) -> None:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("specdec").setLevel(logging.WARNING)
    _WORKER.update(traces=traces, shape=shape, costs=StepCosts(traces.cost_table))


def _run_named(names: tuple[str, str]) -> PolicyResult:
    scenario = next(s for s in default_scenarios() if s.name == names[0])
    policy = next(p for p in default_policies() if p.name == names[1])
    traces, costs = _WORKER["traces"], _WORKER["costs"]
    return run_policy(scenario.build(traces, costs), policy, costs, _WORKER["shape"])[0]


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1, sort_keys=False) + "\n"


def to_markdown(report: dict, header: str = "") -> str:
    """One row per scenario: tokens/s of every policy, then adaptive / best fixed and / plain."""
    rows = report["scenarios"]
    if not rows:
        return header + "(no scenarios)\n"
    names = list(rows[0]["tokens_per_s"])
    fixed = [n for n in names if n.startswith("fixed_k")]
    cols = ["scenario", *names]
    ratios = "adaptive" in names
    if ratios:
        cols += ["adaptive / best fixed", "adaptive / plain"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        tps = r["tokens_per_s"]
        best = max(tps.values())
        cells = [r["name"]]
        for n in names:
            v = f"{tps[n]:.2f}"
            cells.append(f"**{v}**" if tps[n] == best else v)
        if ratios:
            best_fixed = max((tps[n] for n in fixed), default=0.0)
            cells.append(f"{tps['adaptive'] / best_fixed:.3f}" if best_fixed else "-")
            cells.append(f"{tps['adaptive'] / tps['plain']:.3f}" if tps.get("plain") else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return header + "\n".join(lines) + "\n"


def targets_markdown(report: dict, baseline: dict | None = None) -> str:
    """The issue's replay targets checked scenario by scenario: adaptive against the best fixed
    k, against plain where no fixed k beats plain, and against ``baseline``'s adaptive (an
    earlier controller's replay.json on the same traces; replays are deterministic, so the two
    compare exactly)."""
    before = {
        s["name"]: s["tokens_per_s"]["adaptive"] for s in (baseline or {}).get("scenarios", [])
    }
    lines = [
        "| scenario | adaptive | best fixed k | / best fixed | / plain | baseline | / baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    miss_best, miss_plain, ratios = [], [], {}
    for s in report["scenarios"]:
        tps = s["tokens_per_s"]
        ad, plain = tps["adaptive"], tps["plain"]
        fixed = {n: v for n, v in tps.items() if n.startswith("fixed_k")}
        best = max(fixed.values())
        if ad < 0.98 * best:
            miss_best.append(f"{s['name']} {ad / best:.3f}")
        if best < plain and ad < 0.99 * plain:
            miss_plain.append(f"{s['name']} {ad / plain:.3f}")
        base = before.get(s["name"])
        if base:
            ratios[s["name"]] = ad / base
        cells = [s["name"], f"{ad:.2f}", f"{best:.2f}", f"{ad / best:.3f}", f"{ad / plain:.3f}"]
        cells += [f"{base:.2f}", f"{ad / base:.3f}"] if base else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    n = len(report["scenarios"])
    lines += [
        "",
        f"- adaptive >= 0.98x the best fixed k: {n - len(miss_best)} of {n}"
        + (f"; missed in {', '.join(miss_best)}" if miss_best else ""),
        "- adaptive >= 0.99x plain where no fixed k beats plain: "
        + (f"missed in {', '.join(miss_plain)}" if miss_plain else "met everywhere"),
    ]
    if ratios:
        at_least = sum(r >= 1.0 for r in ratios.values())
        low = [f"{k} {r:.3f}" for k, r in ratios.items() if r < 0.97]
        lines.append(
            f"- adaptive >= the baseline in {at_least} of {len(ratios)} scenarios"
            + (f"; below 0.97x in {', '.join(low)}" if low else "; never below 0.97x")
        )
    return "\n".join(lines) + "\n"
