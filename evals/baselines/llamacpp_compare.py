"""llama.cpp against this engine on the same CPU, the same GGUF files and the same prompt ids.

llama.cpp (through its Python binding, ``llama-cpp-python``, installed apart from this project)
decodes the default pair's Q4_K_M target GGUF (or another GGUF of the target, ``--llama-cpp-gguf``)
natively, with plain greedy decode (its speculative
mode with the draft lost to its own plain decode when measured, so plain is its best arm). This
engine runs the same GGUF files in the formats ``--arms`` names (``dtype:quantization/
draft_quantization``, as the formats benchmark spells them; default: the engine's defaults), each
one engine with a plain and an adaptive speculative arm. Every arm decodes the same prompts at
batch 1, greedy, EOS ignored,
the arms interleaved prompt by prompt so a shared machine's drift falls on all of them; the
figure is decode tokens per second after the first token (prompt processing excluded).

llama.cpp runs in a child process of its own: on CPUs with AMX both it and oneDNN (this engine's
matmuls) use the tile registers, and oneDNN releases the tile configuration after its kernels,
which leaves llama.cpp's next tile instruction illegal when both share a process.

    pip install llama-cpp-python   # into any environment that can import this project
    python -m specdec.evals.baselines.llamacpp_compare --output-dir docs/results/bench \
        --arms auto:none/none,auto:none/int4

A Q8_0 file of the target for ``--llama-cpp-gguf`` comes from llama.cpp's own quantizer, through
the same binding (``write_q8_0``): requantized from the Q4_K_M file, so it decodes at Q8_0's speed
(bytes per weight set it) with Q4_K_M's weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

CATEGORIES = {"code": ("code_generation", "code_editing"), "chat": ("multi_turn_chat",)}
LLAMA_CPP = "llama_cpp_plain"


def llama_cpp_decode(llm, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``ids`` (EOS ignored: the generator runs until ``max_tokens``) and
    the decode rate (tokens after the first per second)."""
    tokens: list[int] = []
    first_at = 0.0
    gen = llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)
    for token in gen:
        if not tokens:
            first_at = time.perf_counter()
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    rate = (len(tokens) - 1) / (time.perf_counter() - first_at) if len(tokens) > 1 else 0.0
    return tokens, rate


def gguf_file_type(path: str) -> str:
    """The GGUF's weight format as llama.cpp names it, e.g. ``Q4_K_M``."""
    import gguf

    field = gguf.GGUFReader(path).fields["general.file_type"]
    return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


def write_q8_0(source: str, out: str, threads: int) -> None:
    """llama.cpp's quantizer: ``source`` (any GGUF of the model) as Q8_0 at ``out``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = threads
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to Q8_0")


def _llama_cpp_worker(conn, gguf: str, threads: int) -> None:
    """Serves (prompt ids, max tokens) -> (tokens, decode rate) from its own process."""
    from llama_cpp import Llama

    llm = Llama(gguf, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
    while (request := conn.recv()) is not None:
        conn.send(llama_cpp_decode(llm, *request))


class LlamaCppProcess:
    """llama.cpp on ``gguf`` in a spawned child process; ``decode(ids, max_tokens)``."""

    def __init__(self, gguf: str, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_llama_cpp_worker, args=(child, gguf, threads))
        self._proc.start()

    def decode(self, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        self._conn.send((ids, max_tokens))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", type=Path, default=Path("docs/results/bench"))
    ap.add_argument("--name", default="llamacpp_compare")
    ap.add_argument("--prompts-per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--llama-cpp-gguf",
        default=None,
        help="the target GGUF llama.cpp decodes (default: the default target's Q4_K_M file); "
        "'q8_0' writes and uses a Q8_0 file of it (see the module docstring)",
    )
    ap.add_argument(
        "--arms",
        default="auto:none/none",
        help="this engine's formats, comma-separated DTYPE:QUANTIZATION/DRAFT_QUANTIZATION",
    )
    args = ap.parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(
            "llama-cpp-python is not installed: pip install llama-cpp-python (it builds llama.cpp)"
        )
    import torch
    from specdec.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.engine.cpu_features import vector_flags_summary
    from specdec.engine.llm_engine import LLMEngine
    from specdec.engine.sampling_params import SamplingParams
    from specdec.engine.weights.cache import specdec_home
    from specdec.evals.datasets import load_categories, prompt_token_ids
    from specdec.evals.environment import environment_info, git_commit
    from specdec.evals.formats.measure import Arm, decode_rate

    torch.set_num_threads(args.threads)
    arms = [Arm.parse(text) for text in args.arms.split(",")]
    # Arm configs turn the prefix cache off: each arm computes its prompt itself. A cached prefix
    # changes how the prompt's attention is chunked, which in bf16 rounds differently and can
    # move a greedy token.
    engines = {arm.name: LLMEngine(arm.config(args.threads, 4096), progress=False) for arm in arms}
    tokenizer = next(iter(engines.values())).tokenizer
    gguf = specdec_home() / "gguf" / f"{DEFAULT_TARGET}.gguf"
    if args.llama_cpp_gguf == "q8_0":
        q8 = gguf.with_name(f"{DEFAULT_TARGET}.q8_0.gguf")
        if not q8.exists():
            write_q8_0(str(gguf), str(q8), args.threads)
        gguf = q8
    elif args.llama_cpp_gguf:
        gguf = Path(args.llama_cpp_gguf)
    llm = LlamaCppProcess(str(gguf), args.threads)
    prompts = []
    for group, categories in CATEGORIES.items():
        for p in load_categories(list(categories), limit=args.prompts_per_category):
            ids = prompt_token_ids(p, tokenizer, 1 << 30)
            prompts.append((p.id, group, ids))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():  # first-call overheads out of the figures
        engine.generate([prompts[0][2]], SamplingParams(temperature=0, max_tokens=4), "auto")
    llm.decode(prompts[0][2], 4)
    runs = []
    for prompt_id, group, ids in prompts:
        llama_tokens, llama_rate = llm.decode(ids, args.max_tokens)
        run = {"id": prompt_id, "group": group, "prompt_tokens": len(ids), LLAMA_CPP: llama_rate}
        for name, engine in engines.items():
            plain = engine.generate([ids], params, speculative="off")[0]
            spec = engine.generate([ids], params, speculative="auto")[0]
            run[f"{name} plain"] = decode_rate(plain)
            run[f"{name} adaptive"] = decode_rate(spec)
            run[f"{name} spec_equals_plain"] = spec.output_token_ids == plain.output_token_ids
            # Greedy tokens llama.cpp shares with this engine's plain output before they
            # first differ: the formats differ, so the outputs part after a while.
            run[f"{name} common_prefix_with_llama_cpp"] = _common_prefix(
                llama_tokens, plain.output_token_ids
            )
        runs.append(run)
        print(json.dumps(runs[-1]), flush=True)
    llm.close()
    summary = summarize(runs, list(engines))
    result = {
        "command": " ".join(
            ["python -m specdec.evals.baselines.llamacpp_compare", *(argv or sys.argv[1:])]
        ),
        "commit": git_commit(),
        "environment": environment_info(),
        "cpu_flags": vector_flags_summary(),
        "arms": {
            name: str(engine.dtype).removeprefix("torch.") for name, engine in engines.items()
        },
        "llama_cpp_gguf": gguf.name,
        "llama_cpp_file_type": gguf_file_type(str(gguf)),
        "draft": DEFAULT_DRAFT,
        "max_tokens": args.max_tokens,
        "summary": summary,
        "runs": runs,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    (args.output_dir / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def summarize(runs: list[dict], arm_names: list[str]) -> dict[str, dict[str, float]]:
    """Per prompt group, the median decode rate of llama.cpp and of each arm's plain and
    adaptive decode."""
    columns = [LLAMA_CPP] + [
        f"{name} {mode}" for name in arm_names for mode in ("plain", "adaptive")
    ]
    groups = dict.fromkeys(r["group"] for r in runs)
    return {
        group: {c: statistics.median(r[c] for r in runs if r["group"] == group) for c in columns}
        for group in groups
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens ``a`` and ``b`` share before they first differ."""
    from specdec.evals.greedy_check import first_difference

    diff = first_difference(a, b)
    return len(a) if diff is None else diff


def markdown(result: dict) -> str:
    env = result["environment"]
    arms = ", ".join(f"`{name}` ({dtype})" for name, dtype in result["arms"].items())
    fmt = result["llama_cpp_file_type"]
    lines = [
        "# llama.cpp and this engine on the same CPU",
        "",
        f"Command: `{result['command']}` at commit {result['commit']}. Machine: {env['cpu']} "
        f"({result['cpu_flags']}), {env['torch_threads']} threads. Batch 1, greedy, EOS "
        f"ignored, {result['max_tokens']} tokens per prompt, arms interleaved prompt by prompt. "
        f"llama.cpp: `{result['llama_cpp_gguf']}` ({fmt}) with its CPU kernels, plain decode. "
        f"This engine: the same GGUF files in the formats {arms} "
        "(target dtype:quantization/draft quantization), plain and adaptive speculative decode "
        "with the draft. Decode tokens per second after the first token, median over prompts; "
        "in brackets, the ratio to llama.cpp.",
        "",
        f"| prompts | llama.cpp {fmt} plain | "
        + " | ".join(f"{name} {mode}" for name in result["arms"] for mode in ("plain", "adaptive"))
        + " |",
        "|---|---|" + "---|" * (2 * len(result["arms"])),
    ]
    for group, s in result["summary"].items():
        base = s[LLAMA_CPP]
        cells = [f"{s[c]:.2f} ({s[c] / base:.2f}x)" for c in s if c != LLAMA_CPP]
        lines.append(f"| {group} | {base:.2f} | " + " | ".join(cells) + " |")
    same = all(v for r in result["runs"] for k, v in r.items() if k.endswith("spec_equals_plain"))
    lines += ["", f"specdec speculative output equal to its plain output on every prompt: {same}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
