"""The torch attention backend's native row kernel (``paged_attention.c``) against its torch calls,
side by side on the real pair: two engines in one process with the same formats, one with the
native rows switched off, each decoding every prompt plainly and with adaptive speculation,
prompts interleaved so a shared machine's drift falls on both. Batch 1, greedy, EOS ignored;
decode tokens per second after the first token; each engine's speculative output must equal its
plain output (the two engines' outputs may part: their attention rounds differently in bf16).

    python -m specdec.evals.kernels.attention_ab --output-dir docs/results/engine
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specdec.engine.llm_engine import LLMEngine
from specdec.evals.datasets import load_categories, prompt_token_ids
from specdec.evals.environment import result_header, write_result
from specdec.evals.formats.measure import Arm, decode_rate, greedy

CATEGORIES = {"code": ("code_generation", "code_editing"), "chat": ("multi_turn_chat",)}
ARMS = ("native", "torch")
MODES = {"plain": "off", "adaptive": "auto"}


def switch_off_native_attention(engine: LLMEngine) -> None:
    """The engine's attention runs the torch calls for every row (target and draft)."""
    for runner in (engine.target_runner, getattr(engine.proposer, "runner", None)):
        if runner is not None and hasattr(runner.backend, "native"):
            runner.backend.native = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", type=Path, default=Path("docs/results/engine"))
    ap.add_argument("--arm", default="auto:none/int4", help="formats, as bench_formats spells them")
    ap.add_argument("--prompts-per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    config = Arm.parse(args.arm).config(args.threads, 4096)
    engines = {name: LLMEngine(config, progress=False) for name in ARMS}
    switch_off_native_attention(engines["torch"])
    if engines["native"].target_runner.backend.native is None:
        raise SystemExit("the native kernels do not run here: nothing to compare")
    tokenizer = engines["native"].tokenizer
    prompts = [
        (p.id, group, prompt_token_ids(p, tokenizer, 1 << 30))
        for group, categories in CATEGORIES.items()
        for p in load_categories(list(categories), limit=args.prompts_per_category)
    ]
    params = greedy(args.max_tokens)
    for engine in engines.values():  # first-call overheads out of the figures
        engine.generate([prompts[0][2]], greedy(4), "auto")
    runs = []
    for prompt_id, group, ids in prompts:
        run, outputs = {"id": prompt_id, "group": group}, {}
        for mode, speculative in MODES.items():
            for name, engine in engines.items():
                out = engine.generate([ids], params, speculative)[0]
                run[f"{name} {mode}"] = decode_rate(out)
                outputs[name, mode] = out.output_token_ids
        for name in ARMS:
            run[f"{name} spec_equals_plain"] = outputs[name, "plain"] == outputs[name, "adaptive"]
        runs.append(run)
        print(run, flush=True)
    columns = [f"{name} {mode}" for mode in MODES for name in ARMS]
    summary = {
        group: {c: statistics.median(r[c] for r in runs if r["group"] == group) for c in columns}
        for group in CATEGORIES
    }
    result = {
        **result_header("specdec.evals.kernels.attention_ab", argv, args.threads),
        "arm": args.arm,
        "max_tokens": args.max_tokens,
        "summary": summary,
        "runs": runs,
    }
    write_result(args.output_dir, "attention_ab", result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    lines = [
        "# Native attention rows against the torch calls",
        "",
        f"{provenance_line(result)}. Formats `{result['arm']}`; batch 1, greedy, EOS ignored, "
        f"{result['max_tokens']} tokens per prompt, both engines in one process, prompts "
        "interleaved. Decode tokens per second after the first token, median over prompts; in "
        "brackets, native over torch.",
        "",
        "| prompts | torch plain | native plain | torch adaptive | native adaptive |",
        "|---|---|---|---|---|",
    ]
    for group, s in result["summary"].items():
        cells = []
        for mode in MODES:
            torch_rate, native_rate = s[f"torch {mode}"], s[f"native {mode}"]
            cells += [f"{torch_rate:.2f}", f"{native_rate:.2f} ({native_rate / torch_rate:.2f}x)"]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    equal = all(r[f"{name} spec_equals_plain"] for r in result["runs"] for name in ARMS)
    lines += ["", f"Speculative output equal to plain output, both engines, every prompt: {equal}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
