"""Real-pair CPU benchmark for the engine (issue 2) and batch-1 speculation (issue 3).

Everything is measured side by side in one process on the same converted weights:
  engine:   our target alone, decode tok/s at batch 1 and total tok/s for 8 concurrent requests,
            vs transformers `generate` sequential and its padded static batch of 8;
  spec:     time per output token at batch 1, greedy, for plain, draft-model k in --ks and ngram,
            with acceptance per position and mean accepted length, vs transformers assisted
            generation (`assistant_model`);
  rows:     target and draft forward time against the number of query rows (1..16).
Writes JSON + a markdown table (and a PNG of the rows curve) into --output-dir.

    python -m specdec.evals.bench_engine --output-dir docs/results/engine
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.sampling_params import SamplingParams
from specdec.evals.datasets import load_categories, prompt_token_ids
from specdec.evals.formats.measure import decode_rate

from specdec.controller.policy import FixedPolicy

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def bench_engine(engine: LLMEngine, hf, prompts: list[list[int]], n: int) -> dict:
    engine.policy = FixedPolicy(0)
    res: dict = {}
    rates = [
        decode_rate(engine.generate([p], greedy(n), speculative="off")[0]) for p in prompts[:3]
    ]
    res["ours_batch1_decode_tok_s"] = statistics.median(rates)
    t = time.perf_counter()
    outs = engine.generate(prompts[:8], greedy(n), speculative="off")
    res["ours_8_concurrent_total_tok_s"] = sum(len(o.output_token_ids) for o in outs) / (
        time.perf_counter() - t
    )
    hf_rates, hf_total_tokens, hf_total_time = [], 0, 0.0
    for p in prompts[:8]:
        _, t1 = hf.generate(p, 1, None)
        ids, tn = hf.generate(p, n, None)
        hf_total_tokens += len(ids)
        hf_total_time += tn
        if len(hf_rates) < 3:
            hf_rates.append((len(ids) - 1) / (tn - t1))
    res["hf_batch1_decode_tok_s"] = statistics.median(hf_rates)
    res["hf_sequential_8_total_tok_s"] = hf_total_tokens / hf_total_time
    res["hf_static_batch_8_total_tok_s"] = hf_static_batch(hf, prompts[:8], n)
    res["batch1_ratio_ours_over_hf"] = (
        res["ours_batch1_decode_tok_s"] / res["hf_batch1_decode_tok_s"]
    )
    res["concurrent8_over_hf_sequential"] = (
        res["ours_8_concurrent_total_tok_s"] / res["hf_sequential_8_total_tok_s"]
    )
    res["concurrent8_over_hf_static_batch"] = (
        res["ours_8_concurrent_total_tok_s"] / res["hf_static_batch_8_total_tok_s"]
    )
    return res


def hf_static_batch(hf, prompts: list[list[int]], n: int) -> float:
    width = max(len(p) for p in prompts)
    pad = hf.eos_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.target.generate(ids, attention_mask=mask, generation_config=hf._config(n))
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - t)


def bench_spec(engine, ngram_engine, hf, prompts, labels, n, ks) -> dict:
    rows = []

    def ours(label, eng, k, mode):
        eng.policy = FixedPolicy(k)
        for p, cat in zip(prompts, labels, strict=True):
            t = time.perf_counter()
            out = eng.generate([p], greedy(n), speculative=mode)[0]
            dt = time.perf_counter() - t
            s = out.spec_stats
            rows.append(
                {
                    "arm": label,
                    "category": cat,
                    "tpot_ms": 1000 * dt / n,
                    "acceptance": s.acceptance_rate,
                    "mean_accepted_length": s.mean_accepted_length,
                    "acceptance_per_pos": s.acceptance_per_pos(),
                    "tokens": out.output_token_ids,
                }
            )

    ours("plain", engine, 0, "off")
    for k in ks:
        ours(f"draft k={k}", engine, k, "on")
    ours("ngram k=4", ngram_engine, 4, "on")
    for p, cat in zip(prompts, labels, strict=True):
        ids, dt = hf.generate(p, n, 4)
        rows.append({"arm": "transformers assisted k=4", "category": cat, "tpot_ms": 1000 * dt / n})
    plain_tokens = [r["tokens"] for r in rows if r["arm"] == "plain"]
    summary = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        for group in ("code", "chat"):
            sel = [
                r
                for r in rows
                if r["arm"] == arm and (r["category"].startswith("code") == (group == "code"))
            ]
            if not sel:
                continue
            has_stats = "acceptance" in sel[0]  # transformers does not report acceptance
            summary[f"{arm} | {group}"] = {
                "median_tpot_ms": statistics.median(r["tpot_ms"] for r in sel),
                "acceptance": statistics.mean(r["acceptance"] for r in sel) if has_stats else None,
                "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in sel)
                if has_stats
                else None,
            }
    # Greedy speculation must reproduce plain decode token for token, prompt by prompt.
    identical = all(
        [r["tokens"] for r in rows if r["arm"] == arm] == plain_tokens
        for arm in dict.fromkeys(r["arm"] for r in rows if "tokens" in r)
    )
    for r in rows:
        r.pop("tokens", None)
    return {"rows": rows, "summary": summary, "greedy_identical_to_plain": identical}


def bench_rows(runner, max_rows: int = 16, repeats: int = 5) -> dict[int, float]:
    from specdec.engine.model_runner import RunEntry
    from specdec.engine.sequence import Sequence

    alloc_seq = Sequence(-1, "rows", list(range(200 + max_rows)), greedy(1), "off")
    blocks = runner_alloc(runner, alloc_seq)
    out = {}
    for rows in range(1, max_rows + 1):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.run([RunEntry(alloc_seq, list(range(100, 100 + rows)), 200, rows)])
            times.append(time.perf_counter() - t)
        out[rows] = 1000 * statistics.median(times)
    blocks()
    return out


def runner_alloc(runner, seq):
    engine = runner._bench_engine
    engine.allocator.allocate(seq, seq.num_tokens)
    return lambda: engine.allocator.free(seq)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", default="docs/results/engine")
    ap.add_argument("--engine-tokens", type=int, default=48)
    ap.add_argument("--spec-tokens", type=int, default=128)
    ap.add_argument(
        "--num-prompts", type=int, default=8, help="spec prompts (half code, half chat)"
    )
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: engine,spec,rows")
    args = ap.parse_args()
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    ks = [int(k) for k in args.ks.split(",")]

    t = time.perf_counter()
    cfg = EngineConfig(
        model=TARGET,
        draft_model=DRAFT,
        num_speculative_tokens=max(ks),
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=1.0,
        controller_warmup=False,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(cfg)
    warm_start = time.perf_counter() - t
    ngram_engine = LLMEngine(
        EngineConfig(**{**cfg.__dict__, "speculative_method": "ngram", "draft_model": None}),
        target=engine.target,
    )
    from specdec.evals.baselines.hf_generate import HFGenerateBaseline

    hf = HFGenerateBaseline(engine.target.path, engine.draft.path, engine.eos_token_ids)
    tok = engine.tokenizer
    vocab = engine.target.arch.vocab_size
    code = load_categories(["code_generation", "code_editing"], limit=args.num_prompts // 4 or 1)
    chat = load_categories(["multi_turn_chat", "context_qa"], limit=args.num_prompts // 4 or 1)
    spec_prompts = code + chat
    ids = [prompt_token_ids(p, tok, vocab) for p in spec_prompts]
    labels = [p.category for p in spec_prompts]
    all8 = [
        prompt_token_ids(p, tok, vocab)
        for p in load_categories(
            ["code_generation", "multi_turn_chat", "summarization", "math"], limit=2
        )
    ]

    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": "float32",
        "command": "python -m specdec.evals.bench_engine "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in ("", None)
        ),
        "warm_start_seconds_both_models": warm_start,
    }
    engine.target_runner._bench_engine = engine
    if engine.proposer is not None:
        engine.proposer.runner._bench_engine = engine
    if "rows" not in skip:
        result["rows_ms"] = {
            "target": bench_rows(engine.target_runner),
            "draft": bench_rows(engine.proposer.runner),
        }
        write(result, out_dir)
    if "engine" not in skip:
        result["engine"] = bench_engine(engine, hf, all8, args.engine_tokens)
        write(result, out_dir)
    if "spec" not in skip:
        result["spec"] = bench_spec(engine, ngram_engine, hf, ids, labels, args.spec_tokens, ks)
    result["peak_rss_gib"] = peak_rss_gib()
    write(result, out_dir)
    return 0


def write(result: dict, out_dir: Path) -> None:
    (out_dir / "bench_engine.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Engine benchmark ({result['date']}, {result['machine']}, "
        f"{result['threads']} threads, fp32)",
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    if "engine" in result:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in result["engine"].items()]
        lines.append("")
    if "spec" in result:
        lines += [
            "| arm / prompts | median TPOT ms | acceptance | mean accepted length |",
            "|---|---|---|---|",
        ]
        for k, v in result["spec"]["summary"].items():
            acc, mal = v["acceptance"], v["mean_accepted_length"]
            lines.append(
                f"| {k} | {v['median_tpot_ms']:.0f} | "
                f"{'n/a' if acc is None else f'{acc:.2f}'} | "
                f"{'n/a' if mal is None else f'{mal:.2f}'} |"
            )
        lines += [
            "",
            f"greedy speculative output identical to plain: "
            f"{result['spec']['greedy_identical_to_plain']}",
            "",
        ]
    if "rows_ms" in result:
        lines += ["| rows | target ms | draft ms |", "|---|---|---|"]
        for r in result["rows_ms"]["target"]:
            lines.append(
                f"| {r} | {result['rows_ms']['target'][r]:.1f} | "
                f"{result['rows_ms']['draft'][r]:.1f} |"
            )
        plot_rows(result["rows_ms"], out_dir / "rows_curve.png")
    if "peak_rss_gib" in result:
        lines += [
            "",
            f"Peak RSS: {result['peak_rss_gib']:.1f} GiB; warm start (both models): "
            f"{result['warm_start_seconds_both_models']:.1f} s",
        ]
    (out_dir / "bench_engine.md").write_text("\n".join(lines) + "\n")


def plot_rows(rows_ms: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in rows_ms.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=name)
    ax.set_xlabel("query rows in the forward")
    ax.set_ylabel("forward time (ms, median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("Step time vs rows (fp32, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
