"""Measurement: where a live decode step's time goes, by draft length and temperature.

The replay's clock charges a step its forwards and its sampling draws, priced by the cost table
(docs/evals.md); everything else a live step does (scheduling, the proposer's work around each
draft forward, the draft's own draws, verifying against the draft's distributions) costs nothing
there. This program runs ``--concurrency`` requests at once under a fixed k on the real engine,
per temperature and k, and splits every full-batch decode step's wall time into the target
forward, the draft forwards and the rest (host work), so the rest can be set beside the cost
table's prices.

    python -m specdec.evals.controller_sweep.step_breakdown --output-dir docs/results/controller
    python -m specdec.evals.controller_sweep.step_breakdown --tiny --max-tokens 8   # smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path


class TimedRunner:
    """A model runner whose forwards' wall time adds up in ``seconds`` (every other attribute is
    the runner's own)."""

    def __init__(self, runner) -> None:
        self._runner, self.seconds, self.forwards = runner, 0.0, 0

    def run(self, entries):
        start = time.perf_counter()
        out = self._runner.run(entries)
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        return out

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


def measure_point(engine, target: TimedRunner, draft: TimedRunner, requests, k: int) -> dict:
    """Serve ``requests`` (id, prompt, params) under fixed ``k``; the mean full-batch decode
    step (every request running, none prefilling) and its parts, in ms."""
    engine.policy.k = k
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, speculative="auto" if k else "off")
    steps, wall, fwd_t, fwd_d, n_d = 0, 0.0, 0.0, 0.0, 0
    while engine.has_unfinished():
        sch = engine.scheduler
        full = not sch.waiting and len(sch.running) == len(requests)
        full = full and not any(s.is_prefilling for s in sch.running)
        before = (target.seconds, draft.seconds, draft.forwards)
        start = time.perf_counter()
        engine.step()
        if full:
            steps += 1
            wall += time.perf_counter() - start
            fwd_t += target.seconds - before[0]
            fwd_d += draft.seconds - before[1]
            n_d += draft.forwards - before[2]
    n = max(1, steps)
    step, target_ms, draft_ms = 1e3 * wall / n, 1e3 * fwd_t / n, 1e3 * fwd_d / n
    return {
        "k": k,
        "steps": steps,
        "step_ms": step,
        "target_forward_ms": target_ms,
        "draft_forwards_ms": draft_ms,
        "draft_forwards_per_step": n_d / n,
        "rest_ms": step - target_ms - draft_ms,
    }


def markdown(result: dict) -> str:
    lines = [
        "# Where a live decode step's time goes",
        "",
        f"`{result['command']}` at commit {result['commit']}; {result['environment']['cpu']} "
        f"({result['cpu_flags']}), {result['threads']} threads, {result['dtype']}; "
        f"{result['concurrency']} requests at once under a fixed k, {result['max_tokens']} tokens "
        "each; the mean over the steps in which all of them decode, of the last of "
        f"{result['repeats']} passes. Rest: the step's wall time less its forwards (host work).",
        "",
        "| T | k | steps | step ms | target forward ms | draft forwards ms (per step) | rest ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['temperature']:g} | {p['k']} | {p['steps']} | {p['step_ms']:.0f} | "
            f"{p['target_forward_ms']:.0f} | {p['draft_forwards_ms']:.0f} "
            f"({p['draft_forwards_per_step']:.1f}) | {p['rest_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", type=Path, default=None, help="write step_breakdown.json/.md")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="passes a point (the last reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight models instead")
    args = p.parse_args(argv)
    if min(args.ks) < 0 or args.concurrency < 1 or args.repeats < 1 or args.max_tokens < 2:
        p.error("--ks must be >= 0, --concurrency and --repeats >= 1, --max-tokens >= 2")

    from specdec.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.engine.sampling_params import SamplingParams
    from specdec.evals.controller_sweep.sweep import CODE_PROMPTS, OPEN_PROMPTS, encode_prompts
    from specdec.evals.environment import result_header, write_result

    models: dict = dict(model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT)
    target = draft = None
    if args.tiny:
        from specdec.evals.tiny_pair import tiny_pair

        target, draft = tiny_pair()
        models = dict(model="tiny", draft_model="tiny-draft", dtype="float32", num_kv_blocks=512)
    config = EngineConfig(
        **models,
        speculative_mode="auto",
        speculative_policy="fixed",
        num_speculative_tokens=max(max(args.ks), 1),
        max_num_seqs=args.concurrency,
        max_model_len=1024,
        enable_prefix_caching=False,
        num_threads=args.threads,
        controller_warmup=False,
        stop_drafts_early=False,
    )
    engine = LLMEngine(config, target=target, draft=draft, progress=False)
    timed_target = engine.target_runner = TimedRunner(engine.target_runner)
    timed_draft = engine.proposer.runner = TimedRunner(engine.proposer.runner)
    free_before = engine.allocator.num_free_blocks
    points = []
    for temperature, texts in ((0.0, CODE_PROMPTS), (1.0, OPEN_PROMPTS)):
        prompts = encode_prompts(engine, texts, args.tiny)
        for k in args.ks:
            for rep in range(args.repeats):
                requests = [
                    (
                        f"T{temperature:g}-k{k}-{rep}-{i}",
                        prompts[i % len(prompts)],
                        SamplingParams(
                            temperature=temperature,
                            max_tokens=args.max_tokens,
                            ignore_eos=True,
                            seed=i,
                        ),
                    )  # fmt: skip
                    for i in range(args.concurrency)
                ]
                point = measure_point(engine, timed_target, timed_draft, requests, k)
            points.append({"temperature": temperature, **point})
            print(points[-1], flush=True)
    if engine.allocator.num_free_blocks != free_before:
        raise AssertionError("step_breakdown leaked KV blocks")
    result = result_header(
        "specdec.evals.controller_sweep.step_breakdown", argv, threads=args.threads
    ) | {
        "model": config.model,
        "draft_model": config.draft_model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "points": points,
    }
    text = markdown(result)
    print(text)
    if args.output_dir is not None:
        write_result(args.output_dir, "step_breakdown", result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
