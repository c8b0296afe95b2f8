"""Offline acceptance-rate eval through LLMEngine (no HTTP).

For every temperature the same prompts run once through a plain engine and once through an engine
per (proposer, k) with speculation forced on; acceptance statistics come from the engine's
per-request SpecStats, the drafting/verifying split from its measured steps (StepTimer), and the
speedup is the ratio of output-token rates measured in this same run. Requests run one at a time,
so the numbers are single-stream latency numbers (batch size 1, as Spec-Bench measures).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.engine.errors import PromptTooLongError
from specdec.engine.sampling_params import SamplingParams
from specdec.evals.datasets import Prompt, limit_per_category, prompt_token_ids
from specdec.evals.eval_rows import BaselineRow, EvalReport, plain_rows, spec_rows
from specdec.evals.greedy_check import compare_greedy
from specdec.evals.runs import ConfigRuns, PromptRun
from specdec.evals.step_timer import StepTimer, StepTotals

logger = logging.getLogger(__name__)

PROPOSERS: tuple[str, ...] = ("draft_model", "ngram")

EngineFactory = Callable[..., object]
"""(speculative_method, k, tree_nodes=0) -> a fresh engine.LLMEngine; method "none" gives the plain
engine, ``tree_nodes`` > 0 one that drafts token trees of that many nodes, k deep."""


@dataclass(frozen=True)
class EvalSettings:
    proposers: tuple[str, ...] = PROPOSERS
    ks: tuple[int, ...] = (1, 2, 4, 8)
    tree_nodes: tuple[int, ...] = ()  # every (proposer, k) also drafts trees of these sizes
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_tokens: int = 128
    seed: int = 0
    warmup_tokens: int = 4  # an untimed request of this many tokens per engine; 0 = none
    baseline_limit: int | None = None  # prompts per category for the baselines (None: all)


@dataclass
class EncodedPrompt:
    prompt: Prompt
    token_ids: list[int]


class BaselineRunner:
    """Interface of evals.baselines: generate greedily for one prompt, return (ids, seconds)."""

    has_assistant: bool = False

    def generate(self, token_ids: list[int], max_tokens: int, k: int | None):
        raise NotImplementedError


def encode_prompts(
    engine, prompts: Sequence[Prompt], max_tokens: int
) -> tuple[list[EncodedPrompt], list[dict]]:
    """Token ids per prompt; prompts that do not fit with ``max_tokens`` are skipped and listed."""
    vocab = engine.target.arch.vocab_size
    encoded, skipped = [], []
    for p in prompts:
        ids = prompt_token_ids(p, engine.tokenizer, vocab)
        try:
            engine.check_lengths(len(ids), SamplingParams(max_tokens=max_tokens))
        except PromptTooLongError as exc:
            skipped.append({"prompt_id": p.id, "category": p.category, "reason": exc.message})
            logger.warning("skipping %s: %s", p.id, exc.message)
            continue
        encoded.append(EncodedPrompt(p, ids))
    return encoded, skipped


def sampling_params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    # A per-prompt seed makes a sampled run repeatable; greedy ignores it.
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)


def run_one(engine, request_id: str, token_ids: list[int], params, speculative: str) -> PromptRun:
    """Submit one request and step the engine until it finishes (nothing else is in flight)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    start_mono = time.monotonic()
    engine.add_request(request_id, token_ids, params, speculative)
    final = None
    while final is None:
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine dropped request {request_id} without finishing it")
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    ttft = None if final.first_token_time is None else final.first_token_time - start_mono
    output = list(final.output_token_ids)
    return PromptRun(request_id, "", output, seconds, ttft, final.spec_stats, cpu)


def run_config(
    engine,
    encoded: Sequence[EncodedPrompt],
    temperature: float,
    settings: EvalSettings,
    speculative: str,
    timer: StepTimer,
    tick: Callable[[], None],
) -> ConfigRuns:
    result = ConfigRuns()
    timer.reset()  # drop the warm-up's steps
    for index, ep in enumerate(encoded):
        cat = ep.prompt.category
        params = sampling_params(temperature, settings.max_tokens, settings.seed + index)
        rid = f"{ep.prompt.id}@t{temperature:g}"
        run = run_one(engine, rid, ep.token_ids, params, speculative)
        run.prompt_id, run.category = ep.prompt.id, cat
        result.runs.setdefault(cat, []).append(run)
        # Steps are attributed to the category of the prompt that ran (one request at a time).
        result.steps.setdefault(cat, StepTotals()).add(timer.reset())
        tick()
    return result


def warm_up(engine, encoded: Sequence[EncodedPrompt], settings: EvalSettings, speculative: str):
    """One short untimed request: first-call costs (allocator, kernels) stay out of the numbers."""
    if settings.warmup_tokens <= 0 or not encoded:
        return
    params = SamplingParams(temperature=0.0, max_tokens=settings.warmup_tokens)
    run_one(engine, "warmup", encoded[0].token_ids, params, speculative)


def evaluate(
    prompts: Sequence[Prompt],
    factory: EngineFactory,
    settings: EvalSettings = EvalSettings(),
    baselines: Callable[[], BaselineRunner] | None = None,
    progress: bool = True,
    meta: dict | None = None,
) -> EvalReport:
    """Run the whole grid and return the report (failures included; never raises on them)."""
    from tqdm import tqdm

    configs = [("none", 0, 0)] + [
        (m, k, n)
        for m in settings.proposers
        for k in settings.ks
        for n in (0, *settings.tree_nodes)
    ]
    plain_engine = factory("none", 0)
    encoded, skipped = encode_prompts(plain_engine, prompts, settings.max_tokens)
    categories = {ep.prompt.id: ep.prompt.category for ep in encoded}
    report = EvalReport(meta=dict(meta or {}), skipped_prompts=skipped)
    report.meta.update(
        settings=dataclasses.asdict(settings),
        num_prompts={c: sum(v == c for v in categories.values()) for c in _order(encoded)},
        engine_config=dataclasses.asdict(plain_engine.config),
    )
    bar = tqdm(
        total=len(encoded) * len(configs) * len(settings.temperatures),
        desc="eval",
        unit="req",
        disable=not progress,
    )
    plain: dict[float, ConfigRuns] = {}
    started = time.perf_counter()
    for method, k, nodes in configs:
        engine = plain_engine if method == "none" else factory(method, k, nodes)
        plain_engine = None  # only the first config reuses it; let the others free memory
        speculative = "off" if method == "none" else "on"
        label = f"{method} k={k}" + (f" tree={nodes}" if nodes else "")
        bar.set_description(f"eval {'plain' if method == 'none' else label}")
        timer = StepTimer.install(engine)
        warm_up(engine, encoded, settings, speculative)
        for temp in settings.temperatures:
            runs = run_config(engine, encoded, temp, settings, speculative, timer, bar.update)
            if method == "none":
                plain[temp] = runs
                report.plain.extend(plain_rows(temp, runs.runs))
                continue
            mismatches = []
            if temp == 0:
                mismatches = compare_greedy(
                    _outputs(runs), _outputs(plain[temp]), categories, method, k, nodes
                )
                for m in mismatches:
                    logger.error(m.describe())
                report.failures.extend(m.to_dict() for m in mismatches)
            report.spec.extend(
                spec_rows(method, k, temp, runs, plain[temp].runs, mismatches, nodes)
            )
        del engine, timer
        gc.collect()  # each engine holds a KV pool; free it before building the next
    bar.close()
    release = getattr(factory, "release", None)
    if callable(release):
        release()
        gc.collect()
    if baselines is not None and 0.0 not in plain:
        logger.warning("the transformers baselines are greedy: add 0 to --temperatures to run them")
    elif baselines is not None:
        report.baselines = run_baselines(baselines(), encoded, settings, plain[0.0], progress)
    report.meta["eval_seconds"] = time.perf_counter() - started
    return report


def run_baselines(
    runner: BaselineRunner,
    encoded: Sequence[EncodedPrompt],
    settings: EvalSettings,
    engine_plain: ConfigRuns,
    progress: bool,
) -> list[BaselineRow]:
    """transformers generate, plain and assisted per k, greedy, on the same token ids (the first
    ``settings.baseline_limit`` prompts of each category when set)."""
    from specdec.evals.eval_rows import baseline_rows
    from tqdm import tqdm

    chosen = [ep.prompt for ep in encoded]
    if settings.baseline_limit is not None:
        chosen = limit_per_category(chosen, settings.baseline_limit)
    keep = {p.id for p in chosen}
    subset = [ep for ep in encoded if ep.prompt.id in keep]
    variants: list[tuple[str, int | None]] = [("hf_plain", None)]
    if runner.has_assistant and "draft_model" in settings.proposers:
        variants += [("hf_assisted", k) for k in settings.ks]
    bar = tqdm(total=len(subset) * len(variants), desc="baselines", disable=not progress)
    rows: list[BaselineRow] = []
    hf_plain: dict[str, list[PromptRun]] | None = None
    # The engine's plain runs on exactly the prompts the baselines ran, for a like-for-like ratio.
    engine_same = {
        cat: [r for r in rs if r.prompt_id in keep] for cat, rs in engine_plain.runs.items()
    }
    for name, k in variants:
        if settings.warmup_tokens > 0 and subset:  # first calls build caches and kernels
            runner.generate(subset[0].token_ids, settings.warmup_tokens, k)
        runs: dict[str, list[PromptRun]] = {}
        for ep in subset:
            start_cpu = time.process_time()
            ids, seconds = runner.generate(ep.token_ids, settings.max_tokens, k)
            cpu = time.process_time() - start_cpu
            run = PromptRun(ep.prompt.id, ep.prompt.category, ids, seconds, None, cpu_seconds=cpu)
            runs.setdefault(ep.prompt.category, []).append(run)
            bar.update()
        hf_plain = hf_plain or runs
        rows.extend(baseline_rows(name, k, runs, hf_plain, engine_same))
    bar.close()
    return rows


def _outputs(runs: ConfigRuns) -> dict[str, list[int]]:
    return {r.prompt_id: r.output_token_ids for rs in runs.runs.values() for r in rs}


def _order(encoded: Sequence[EncodedPrompt]) -> list[str]:
    return list(dict.fromkeys(ep.prompt.category for ep in encoded))
