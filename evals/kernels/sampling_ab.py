"""The sampler's native noise pass (``noise_stream.c``) against its torch ops, side by side on the
real pair: one engine per (noise, mode) in one process, the engines stepping in turn (as the live
sweep's arms do) over the same seeded temperature-1 requests at each concurrency, plain decode
and adaptive speculation. Seeded requests race on the same noise in both (to the rounding of
``log``), so each mode's two engines should write the same text (each round records whether
they did), and the figures compare the same work. Throughput in output tokens per second of each engine's own step time, median over rounds.

    python -m specdec.evals.kernels.sampling_ab --output-dir docs/results/engine
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path

from specdec.engine import noise
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.evals.controller_sweep.sweep import WORKLOADS, ArmLoop, encode_prompts, round_requests
from specdec.evals.environment import result_header, write_result

NOISE = ("native", "torch")
MODES = {"plain": "off", "adaptive": "auto"}


@contextlib.contextmanager
def torch_noise() -> Iterator[None]:
    """Inside, the sampler's noise runs the torch ops, whatever the machine offers."""
    native_for = noise._native_for
    noise._native_for = lambda keys: None
    try:
        yield
    finally:
        noise._native_for = native_for


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", type=Path, default=Path("docs/results/engine"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    config = EngineConfig(
        max_num_seqs=max(args.concurrency),
        max_model_len=1024,
        kv_cache_memory=0.5,
        enable_prefix_caching=False,  # later rounds resend the prompts: none may find a cache
        num_threads=args.threads,
    )
    engines: dict[tuple[str, str], LLMEngine] = {}
    target = draft = None
    for key in ((n, m) for m in MODES for n in NOISE):
        engines[key] = LLMEngine(config, target=target, draft=draft, progress=False)
        target, draft = engines[key].target, engines[key].draft
    prompts, temperature = WORKLOADS["open"]
    prompt_ids = encode_prompts(engines["native", "plain"], prompts, False)
    if noise._native_for(noise.random_keys(1, "cpu")) is None:
        raise SystemExit("the native kernels do not run here: nothing to compare")

    points = []
    for c in args.concurrency:
        rounds = []
        for r in range(args.rounds):
            requests = round_requests("open", c, prompt_ids, temperature, 2 * c, args.max_tokens, r)
            loops = {key: ArmLoop(engine, key[1], requests, c) for key, engine in engines.items()}
            for (_, mode), loop in loops.items():
                loop.speculative = MODES[mode]
            texts = {key: {} for key in loops}
            turn = 0
            while live := [key for key, loop in loops.items() if not loop.done]:
                for key in live[turn % len(live) :] + live[: turn % len(live)]:
                    with torch_noise() if key[0] == "torch" else contextlib.nullcontext():
                        outputs = loops[key].advance()
                    for out in outputs:
                        if out.finished:
                            texts[key][out.request_id] = out.output_token_ids
                turn += 1
            rates = {f"{n} {m}": loops[n, m].result("open").throughput_tok_s for n, m in loops}
            same = {m: texts["native", m] == texts["torch", m] for m in MODES}
            rounds.append({"tokens_per_s": rates, "same_text": same})
            print(c, r, rates, same, flush=True)
        columns = rounds[0]["tokens_per_s"]
        points.append(
            {
                "concurrency": c,
                "median_tokens_per_s": {
                    k: statistics.median(x["tokens_per_s"][k] for x in rounds) for k in columns
                },
                "median_ratio": {
                    m: statistics.median(
                        x["tokens_per_s"][f"native {m}"] / x["tokens_per_s"][f"torch {m}"]
                        for x in rounds
                    )
                    for m in MODES
                },
                "rounds": rounds,
            }
        )
    result = {
        **result_header("specdec.evals.kernels.sampling_ab", argv, args.threads),
        "dtype": str(engines["native", "plain"].dtype).removeprefix("torch."),
        "max_tokens": args.max_tokens,
        "temperature": temperature,
        "points": points,
    }
    write_result(args.output_dir, "sampling_ab", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    lines = [
        "# The sampler's native noise pass against its torch ops",
        "",
        f"{provenance_line(result)}, {result['dtype']} target with the engine's default draft. "
        f"Open prompts at temperature {result['temperature']}, seeded, {result['max_tokens']} "
        "tokens each (EOS ignored), twice the concurrency in requests per round; the four engines step in turn. "
        "Output tokens per second of each engine's own step time, median over rounds; in "
        "brackets, the median over rounds of native over torch.",
        "",
        "| concurrency | torch plain | native plain | torch adaptive | native adaptive | same text |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        t, ratio = p["median_tokens_per_s"], p["median_ratio"]
        cells = []
        for mode in MODES:
            cells += [
                f"{t[f'torch {mode}']:.2f}",
                f"{t[f'native {mode}']:.2f} ({ratio[mode]:.2f}x)",
            ]
        same = all(all(r["same_text"].values()) for r in p["rounds"])
        lines.append(f"| {p['concurrency']} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
