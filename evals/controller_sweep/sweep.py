"""Benchmark: plain vs fixed-k vs adaptive speculation, side by side, per concurrency and workload.

Every arm has its own engine (own KV pool, scheduler and policy) on the same loaded target and
draft; arms differ only in the policy and the per-request speculation mode:

    plain      requests speculative='off' (no draft forward ever runs)
    fixed-k2   --speculative-policy fixed, k = 2
    fixed-k4   --speculative-policy fixed, k = 4
    adaptive   the adaptive policy, seeded by the step-cost table, learning across the whole run
    adaptive-trees  the same with token trees of ``--tree-nodes`` nodes to price beside chains
                    (not run unless asked for)

The arms' engines step in turn (one step each, the order rotating), so every arm meets the same
spells of a shared machine; each arm is timed by its own steps.

Workloads: code prompts at temperature 0 (acceptance high) and open-ended prompts at temperature
1.0 (acceptance lower). Every request generates exactly ``--max-tokens`` tokens (EOS ignored) so
every arm does the same work. At concurrency c each arm keeps c requests in flight (closed loop)
until ``--num-prompts`` have finished. Reported per point and arm: output throughput (tokens/s of
the arm's own step time) and median / p99 over requests of time per output token (after the first token).

Real pair (slow on a CPU: about 40 minutes for the full sweep on two cores):

    python -m specdec.evals.controller_sweep.sweep

Smoke run on tiny random models (a minute or two):

    python -m specdec.evals.controller_sweep.sweep --tiny --quick

A live sweep confirms; it does not tune. A point that misses is recorded as traces
(`specdec trace`) and reproduced in the deterministic replay (`specdec replay`) before anything
changes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.outputs import RequestOutput
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import SpecStats
from specdec.evals.controller_sweep.report import write_markdown, write_plot
from specdec.evals.environment import environment_info, git_commit

logger = logging.getLogger("controller_sweep")

ARMS = ("plain", "fixed-k2", "fixed-k4", "adaptive", "adaptive-trees")
DEFAULT_ARMS = ("plain", "fixed-k2", "fixed-k4", "adaptive")
FIXED_K = {"fixed-k2": 2, "fixed-k4": 4}
CONCURRENCY = (1, 2, 4, 8, 16)
OUT_DIR = Path("docs/results/controller")

CODE_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Implement binary search over a sorted list in Python, returning the index or -1.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Implement merge sort in Python with type hints.",
    "Write a Python function that counts word frequencies in a text and returns a dict.",
    "Write a function that flattens an arbitrarily nested list of integers in Python.",
    "Implement a least-recently-used cache class in Python with get and put.",
    "Write a Python function that parses a CSV line with quoted fields into a list.",
    "Write a function that returns all prime numbers below n using a sieve.",
    "Implement a breadth-first search over an adjacency-list graph in Python.",
    "Write a Python function that converts a Roman numeral string to an integer.",
    "Write a function that merges two sorted lists into one sorted list in Python.",
    "Implement a function that validates an IPv4 address string in Python.",
    "Write a Python generator that yields sliding windows of size k over a list.",
    "Write a function that computes the Levenshtein distance between two strings.",
)
OPEN_PROMPTS = (
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe your ideal weekend in a small mountain town.",
    "What would a city designed entirely for bicycles look like?",
    "Write a letter from a cat to its owner about the new dog.",
    "Imagine the first day of a colony on Mars and describe it.",
    "Invent a new holiday and explain how people celebrate it.",
    "Describe the taste of a fruit that does not exist.",
    "Write a short poem about autumn rain in the city.",
    "What might people in the year 2300 find strange about us?",
    "Tell a fable about a fox, a crow and a clever snail.",
    "Describe a market in a floating city at dawn.",
    "Write the opening paragraph of a mystery novel set on a night train.",
    "Explain why someone might love collecting old maps.",
    "Describe a conversation between the sun and the moon.",
    "Write a travel diary entry from an explorer of deep ocean caves.",
    "Invent a board game and describe its rules briefly.",
)
WORKLOADS = {"code": (CODE_PROMPTS, 0.0), "open": (OPEN_PROMPTS, 1.0)}


@dataclass
class ArmResult:
    workload: str
    concurrency: int
    arm: str
    num_requests: int
    output_tokens: int
    wall_s: float
    throughput_tok_s: float
    tpot_median_ms: float
    tpot_p99_ms: float
    acceptance_rate: float
    mean_k: float  # drafts verified per decode step of a request
    speculating_fraction: float  # share of decode steps that verified at least one draft
    draft_forwards: int
    num_drafted: int = 0
    num_accepted: int = 0
    decode_steps: int = 0
    spec_steps: int = 0
    tree_steps: int = 0  # verifies of a token tree
    controller: dict = field(default_factory=dict)
    throughput_runs: list[float] = field(default_factory=list)  # one per repeat, in run order
    tpots_ms: list[float] = field(default_factory=list)  # one per request


def merge_runs(runs: list[ArmResult]) -> ArmResult:
    """One arm at one point over its repeats: throughput is the median of the repeats' (a
    shared machine drifts by several percent between runs); TPOT percentiles pool every request;
    counts add up; the controller snapshot is the last run's."""
    tpots = [t for r in runs for t in r.tpots_ms]
    drafted = sum(r.num_drafted for r in runs)
    decode_steps = sum(r.decode_steps for r in runs)
    return ArmResult(
        workload=runs[0].workload,
        concurrency=runs[0].concurrency,
        arm=runs[0].arm,
        num_requests=sum(r.num_requests for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        wall_s=sum(r.wall_s for r in runs),
        throughput_tok_s=float(np.median([r.throughput_tok_s for r in runs])),
        tpot_median_ms=float(np.median(tpots)) if tpots else float("nan"),
        tpot_p99_ms=float(np.percentile(tpots, 99)) if tpots else float("nan"),
        acceptance_rate=sum(r.num_accepted for r in runs) / drafted if drafted else 0.0,
        mean_k=drafted / decode_steps if decode_steps else 0.0,
        speculating_fraction=sum(r.spec_steps for r in runs) / decode_steps
        if decode_steps
        else 0.0,
        draft_forwards=sum(r.draft_forwards for r in runs),
        num_drafted=drafted,
        num_accepted=sum(r.num_accepted for r in runs),
        decode_steps=decode_steps,
        spec_steps=sum(r.spec_steps for r in runs),
        tree_steps=sum(r.tree_steps for r in runs),
        controller=runs[-1].controller,
        throughput_runs=[r.throughput_tok_s for r in runs],
        tpots_ms=tpots,
    )


def encode_prompts(engine: LLMEngine, prompts: tuple[str, ...], tiny: bool) -> list[list[int]]:
    if tiny or engine.tokenizer is None:
        # Tiny models have no tokenizer: fixed pseudo-prompts, repetitive for "code"-like text.
        vocab = engine.target.arch.vocab_size
        return [[(7 * i + 3 * j) % vocab for j in range(24)] for i in range(len(prompts))]
    tok = engine.tokenizer
    if tok.has_chat_template:
        return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [tok.encode(p) for p in prompts]


class ArmLoop:
    """One arm's closed loop at one point in one round, advanced one engine step at a time.

    Keeps ``concurrency`` requests in flight until its queue is empty and its engine idle. Its
    clock is the time of its own steps (admission included): the wall time the arm would have
    taken alone, whatever other arms ran in between. TPOT is read off the same clock.
    """

    def __init__(
        self,
        engine: LLMEngine,
        arm: str,
        requests: list[tuple[str, list[int], SamplingParams]],
        concurrency: int,
    ) -> None:
        self.engine = engine
        self.arm = arm
        self.queue = list(requests)
        self.num_requests = len(requests)
        self.concurrency = concurrency
        self.speculative = "off" if arm == "plain" else "auto"
        self.in_flight = 0
        self.out_tokens = 0
        self.busy_s = 0.0
        self.tpots: list[float] = []
        self._first_token_at: dict[str, float] = {}
        self._stats_before = SpecStats()
        self._stats_before.merge(engine.spec_stats)
        self._forwards_before = self._draft_forwards()

    def _draft_forwards(self) -> int:
        return self.engine.proposer.num_forwards if self.engine.proposer is not None else 0

    @property
    def done(self) -> bool:
        return not self.queue and not self.engine.has_unfinished()

    def advance(self) -> list[RequestOutput]:
        """Admit what the concurrency allows, run one engine step, account its outputs (and
        return them)."""
        t0 = time.perf_counter()
        while self.queue and self.in_flight < self.concurrency:
            rid, prompt, params = self.queue.pop(0)
            self.engine.add_request(rid, prompt, params, speculative=self.speculative)
            self.in_flight += 1
        outputs = self.engine.step()
        self.busy_s += time.perf_counter() - t0
        for out in outputs:
            if out.output_token_ids:
                self._first_token_at.setdefault(out.request_id, self.busy_s)
            if not out.finished:
                continue
            self.in_flight -= 1
            n = len(out.output_token_ids)
            self.out_tokens += n
            first = self._first_token_at.pop(out.request_id, None)
            if n > 1 and first is not None:
                self.tpots.append((self.busy_s - first) / (n - 1))
        return outputs

    def result(self, workload: str) -> ArmResult:
        after = self.engine.spec_stats
        before = self._stats_before
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        decode_steps = after.num_target_steps - before.num_target_steps
        spec_steps = after.num_spec_steps - before.num_spec_steps
        ctrl_stats = {}
        if self.arm.startswith("adaptive") and self.engine.policy is not None:
            ctrl_stats = _scalars(self.engine.policy.stats())
        wall, tpots = self.busy_s, self.tpots
        throughput = self.out_tokens / wall if wall > 0 else 0.0
        return ArmResult(
            workload=workload,
            concurrency=self.concurrency,
            arm=self.arm,
            num_requests=self.num_requests,
            output_tokens=self.out_tokens,
            wall_s=wall,
            throughput_tok_s=throughput,
            tpot_median_ms=1e3 * float(np.median(tpots)) if tpots else float("nan"),
            tpot_p99_ms=1e3 * float(np.percentile(tpots, 99)) if tpots else float("nan"),
            acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_k=drafted / decode_steps if decode_steps else 0.0,
            speculating_fraction=spec_steps / decode_steps if decode_steps else 0.0,
            draft_forwards=self._draft_forwards() - self._forwards_before,
            num_drafted=drafted,
            num_accepted=accepted,
            decode_steps=decode_steps,
            spec_steps=spec_steps,
            tree_steps=after.num_tree_steps - before.num_tree_steps,
            controller=ctrl_stats,
            throughput_runs=[throughput],
            tpots_ms=[1e3 * t for t in tpots],
        )


def round_requests(
    workload: str,
    concurrency: int,
    prompts: list[list[int]],
    temperature: float,
    num_prompts: int,
    max_tokens: int,
    round_index: int,
) -> list[tuple[str, list[int], SamplingParams]]:
    """The requests every arm serves in round ``round_index`` of one point.

    Round r sends requests r*n .. r*n+n-1 (n = ``num_prompts``): request i takes prompt
    i mod len(prompts) and sampling seed i. Every arm of a round gets the same requests, and
    each round gets fresh ones. At temperature > 0 a seeded request draws the same text in every
    arm, so the arms of a round are compared on the same text; repeating one set of requests
    would repeat one draw of text, lucky or unlucky for acceptance, in every round; fresh
    requests per round turn that luck into noise the median over rounds averages.
    """
    first = round_index * num_prompts
    return [
        (
            f"{workload}-c{concurrency}-r{round_index}-{i}",
            prompts[i % len(prompts)],
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i),
        )
        for i in range(first, first + num_prompts)
    ]


def warmup_requests(
    args: argparse.Namespace, workload: str, prompts: list[list[int]]
) -> list[tuple[str, list[int], SamplingParams]]:
    """The untimed requests served before ``workload``'s points: ``--warmup-requests`` of
    ``--warmup-tokens`` tokens, numbered after every request the measured rounds send (fresh
    seeds, so no measured request replays a warm-up's text)."""
    measured = args.repeats * max(args.num_prompts or max(c, 4) for c in args.concurrency)
    n = args.warmup_requests
    after_measured = -(-measured // n)  # ceil: its first request comes after the last measured
    temperature = WORKLOADS[workload][1]
    return round_requests(
        f"warmup-{workload}", 2, prompts, temperature, n, args.warmup_tokens, after_measured
    )


def run_round(
    engines: dict[str, LLMEngine],
    workload: str,
    requests: list[tuple[str, list[int], SamplingParams]],
    concurrency: int,
) -> dict[str, ArmResult]:
    """Every arm serves ``requests`` on its own engine, the engines stepping in turn.

    A shared machine's speed drifts by 10-30% within minutes, so arms run one after another
    compare different spells of the machine. Stepping the arms' engines in turn (the order
    rotating every cycle) puts each arm's steps within a step or two of the others', so the
    drift lands on all of them alike; each arm is timed by its own steps only.
    """
    loops = [ArmLoop(engine, arm, requests, concurrency) for arm, engine in engines.items()]
    cycle = 0
    while live := [loop for loop in loops if not loop.done]:
        shift = cycle % len(live)
        for loop in live[shift:] + live[:shift]:
            loop.advance()
        cycle += 1
    return {loop.arm: loop.result(workload) for loop in loops}


def build_engines(args: argparse.Namespace) -> dict[str, LLMEngine]:
    """One engine per arm, all on the same loaded models, each with its own KV pool, scheduler
    and policy. Only the adaptive arm's engine reads (or measures) the step-cost table."""
    common = dict(
        speculative_mode="auto",
        max_num_seqs=max(args.concurrency),
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,  # prompts come back in later rounds: none may find a cache
        seed=0,
        num_threads=args.num_threads,
    )
    target = draft = None
    if args.tiny:
        from specdec.evals.tiny_pair import tiny_pair

        target, draft = tiny_pair()
        models = dict(
            model="tiny", draft_model="tiny-draft", device="cpu", dtype="float32",
            num_kv_blocks=max(64, 4 * max(args.concurrency) * args.max_model_len // 16),
        )  # fmt: skip
    else:
        models = dict(
            model=args.model,
            draft_model=args.draft_model,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
        )
    engines: dict[str, LLMEngine] = {}
    # The adaptive arm's engine first: it loads the models the others share.
    for arm in ("adaptive", *(a for a in args.arms if a != "adaptive")):
        adaptive = arm.startswith("adaptive")
        cfg = EngineConfig(
            **models,
            **common,
            speculative_policy="adaptive" if adaptive else "fixed",
            num_speculative_tokens=args.adaptive_max_k if adaptive else FIXED_K.get(arm, 4),
            controller_warmup=adaptive,
            stop_drafts_early=adaptive and args.stop_drafts_early,
            spec_tree_max_nodes=args.tree_nodes if arm == "adaptive-trees" else 0,
        )
        engine = LLMEngine(cfg, target=target, draft=draft, progress=not args.tiny)
        target, draft = engine.target, engine.draft
        engines[arm] = engine
    return engines


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--draft-model", default=EngineConfig.draft_model)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB for the KV pool")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["code", "open"])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS))
    p.add_argument(
        "--tree-nodes",
        type=_positive,
        default=16,
        help="adaptive-trees arm: nodes per token tree (the engine's --spec-tree-max-nodes)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per round and arm (default: max(concurrency, 4))",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds per point; in a round every arm serves the same fresh requests, the arms' "
        "engines stepping in turn; throughput is the median over rounds",
    )
    p.add_argument(
        "--stop-drafts-early",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.stop_drafts_early,
        help="adaptive arm: draft up to k and stop on the draft's confidence; the engine's default",
    )
    p.add_argument(
        "--adaptive-max-k",
        type=int,
        default=EngineConfig.num_speculative_tokens,
        help="adaptive arm: the longest draft it may choose, the engine's default k (the fixed "
        "arms draft 2 and 4)",
    )
    p.add_argument(
        "--warmup-requests",
        type=_non_negative,
        default=8,
        help="untimed requests every arm serves (two at a time) before each workload's points",
    )
    p.add_argument("--warmup-tokens", type=_positive, default=32, help="tokens per warm-up request")
    p.add_argument(
        "--quick", action="store_true", help="concurrency 1 and 4, 24 tokens, 2 warm-up requests"
    )
    p.add_argument("--tiny", action="store_true", help="tiny random models (smoke test)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--name", default=None, help="file stem (default bench_controller[_tiny])")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency = [c for c in args.concurrency if c in (1, 4)] or [1, 4]
        args.max_tokens = min(args.max_tokens, 24)
        args.warmup_requests = min(args.warmup_requests, 2)
        args.warmup_tokens = min(args.warmup_tokens, 8)
    args.name = args.name or ("bench_controller_tiny" if args.tiny else "bench_controller")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    t0 = time.perf_counter()
    engines = build_engines(args)  # every arm's engine; the adaptive one always
    adaptive = engines["adaptive"]
    arm_engines = {arm: engines[arm] for arm in args.arms}
    first_engine = engines["adaptive"]
    prompts = {w: encode_prompts(first_engine, WORKLOADS[w][0], args.tiny) for w in args.workloads}

    results: list[ArmResult] = []
    for w in args.workloads:
        prompts_w, temperature = prompts[w], WORKLOADS[w][1]
        # Warm-up (kernels, allocators, the adaptive policy's first live steps; not reported)
        # on this workload right before its points, so the engine-wide acceptance estimate
        # new requests start from is this workload's, as on a server that serves it, rather
        # than whatever workload was warmed up or measured last (it remembers about a hundred
        # verifies).
        if args.warmup_requests > 0:
            run_round(arm_engines, w, warmup_requests(args, w, prompts_w), 2)
        for c in args.concurrency:
            n = args.num_prompts or max(c, 4)
            runs: dict[str, list[ArmResult]] = {arm: [] for arm in args.arms}
            for rep in range(args.repeats):
                requests = round_requests(w, c, prompts_w, temperature, n, args.max_tokens, rep)
                round_results = run_round(arm_engines, w, requests, c)
                for arm, r in round_results.items():
                    runs[arm].append(r)
                    logger.info(
                        "%s c=%d %-9s run %d: %7.2f tok/s  tpot p50 %7.1f ms p99 %7.1f ms  "
                        "acc %.2f  mean k %.2f  fwd %d",
                        w, c, arm, rep + 1, r.throughput_tok_s, r.tpot_median_ms, r.tpot_p99_ms,
                        r.acceptance_rate, r.mean_k, r.draft_forwards,
                    )  # fmt: skip
            results += [merge_runs(runs[arm]) for arm in args.arms]
            # Results so far hit the disk after every point: an hour-long sweep that dies late
            # still leaves everything it measured.
            write_results(args, argv, adaptive, results, t0)
    json_path = write_results(args, argv, adaptive, results, t0, with_plot=True)
    logger.info("wrote %s (.md, .png) in %.0f s", json_path, time.perf_counter() - t0)
    return 0


def write_results(
    args: argparse.Namespace,
    argv: list[str] | None,
    adaptive: LLMEngine,
    results: list[ArmResult],
    t0: float,
    with_plot: bool = False,
) -> Path:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(
            ["python -m specdec.evals.controller_sweep.sweep", *(argv or sys.argv[1:])]
        ),
        "commit": git_commit(),
        "environment": environment_info(),
        "dtype": str(adaptive.dtype).removeprefix("torch."),
        "model": "tiny" if args.tiny else args.model,
        "draft_model": "tiny-draft" if args.tiny else args.draft_model,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "warmup": {"requests": args.warmup_requests, "tokens": args.warmup_tokens},
        "arms_step_in_turn": True,
        "total_seconds": time.perf_counter() - t0,
        "controller_final": _scalars(adaptive.policy.stats()) if adaptive.policy else {},
    }
    rows = [asdict(r) for r in results]
    json_path = args.out_dir / f"{args.name}.json"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    write_markdown(args.out_dir / f"{args.name}.md", meta, rows)
    if with_plot:
        write_plot(args.out_dir / f"{args.name}.png", rows)
    return json_path


def _scalars(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if not isinstance(v, dict)}


if __name__ == "__main__":
    raise SystemExit(main())
