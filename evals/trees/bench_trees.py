"""Token trees against chains at batch 1 on the real pair, greedy, side by side in one run.

For each weight format (a bare target dtype, or the formats benchmark's
``dtype:quantization/draft_quantization[@kv_cache_dtype]``) the pair is loaded once; each prompt
then runs every arm back to back, in an order rotated per prompt and round (so machine drift hits
every arm alike): plain decode, chains of k drafts, and trees of N nodes k levels deep (fixed
policy, every step speculates).
Per arm: committed tokens per target forward and decode time per output token (prefill
excluded). Every speculative arm's text must equal plain decode's (greedy output is exact).

    python -m specdec.evals.trees.bench_trees --output-dir docs/results/trees
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specdec.evals.environment import environment_info, git_commit
from specdec.evals.formats.measure import Arm as FormatArm

GROUPS = {"code": ("code_generation", "code_editing"), "chat": ("multi_turn_chat", "context_qa")}
DEFAULT_ARMS = (
    "plain,chain:2,chain:3,chain:4,chain:5,chain:6,tree:8:3,tree:8:4,tree:16:4,tree:16:5,tree:32:5"
)


@dataclass(frozen=True)
class TreeArm:
    """``plain``, ``chain:K`` or ``tree:N:K`` (N nodes, K levels)."""

    name: str
    k: int
    nodes: int

    @classmethod
    def parse(cls, text: str) -> TreeArm:
        parts = text.split(":")
        try:
            if parts == ["plain"]:
                return cls(text, 0, 0)
            if parts[0] == "chain" and len(parts) == 2:
                arm = cls(text, int(parts[1]), 0)
            elif parts[0] == "tree" and len(parts) == 3:
                arm = cls(text, int(parts[2]), int(parts[1]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"arm {text!r}: expected plain, chain:K or tree:N:K") from None
        if arm.k < 1 or (parts[0] == "tree" and arm.nodes < arm.k):
            raise ValueError(f"arm {text!r}: need K >= 1 and N >= K")
        return arm

    @property
    def depth(self) -> int:
        return self.k


def load_prompts(per_group: int, tokenizer) -> list[tuple[str, str, list[int]]]:
    from specdec.evals.datasets import load_categories, prompt_token_ids

    out = []
    for group, categories in GROUPS.items():
        prompts = load_categories(list(categories), limit=per_group)
        for p in prompts[:per_group]:
            out.append((p.id, group, prompt_token_ids(p, tokenizer, 1 << 30)))
    return out


def parse_format(text: str) -> FormatArm:
    """A bare dtype is that target dtype with the engine's default formats (target weights in the
    dtype, the draft's format chosen for the CPU); anything else the formats benchmark's syntax."""
    return FormatArm.parse(text if ":" in text else f"{text}:none/auto")


def measure_format(
    fmt: FormatArm,
    arms: list[TreeArm],
    per_group: int,
    max_tokens: int,
    rounds: int,
    threads: int,
) -> dict:
    """Every (prompt, round) runs all arms in a rotated order on one loaded pair."""
    from specdec.engine.llm_engine import LLMEngine
    from specdec.engine.sampling_params import SamplingParams

    from specdec.controller import FixedPolicy

    config = dataclasses.replace(
        fmt.config(threads), speculative_policy="fixed", controller_warmup=False
    )
    engine = LLMEngine(config, progress=False)
    assert engine.tokenizer is not None
    prompts = load_prompts(per_group, engine.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts[0][2]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    free0 = engine.allocator.num_free_blocks
    runs = []
    for r in range(rounds):
        for p, (prompt_id, group, ids) in enumerate(prompts):
            shift = (r * len(prompts) + p) % len(arms)
            plain_tokens = None
            results = {}
            for arm in arms[shift:] + arms[:shift]:
                engine.policy = FixedPolicy(max(arm.k, 1), arm.nodes)
                mode = "off" if arm.k == 0 else "on"
                out = engine.generate([ids], params, speculative=mode)[0]
                decode_s = out.finish_time - out.first_token_time
                stats = out.spec_stats
                results[arm.name] = (out, decode_s, stats)
            plain_tokens = results["plain"][0].output_token_ids if "plain" in results else None
            for arm in arms:
                out, decode_s, stats = results[arm.name]
                runs.append(
                    {
                        "round": r,
                        "prompt": prompt_id,
                        "group": group,
                        "arm": arm.name,
                        "ms_per_token": 1000 * decode_s / max(1, len(out.output_token_ids) - 1),
                        "tokens_per_forward": stats.mean_accepted_length if arm.k else 1.0,
                        "nodes_per_step": stats.nodes_per_tree_step,
                        "accepted_per_rank": list(stats.accepted_per_rank),
                        "equals_plain": plain_tokens is None
                        or out.output_token_ids == plain_tokens,
                    }
                )
    return {
        "format": fmt.name,
        "runs": runs,
        "kv_blocks_leaked": engine.allocator.num_free_blocks != free0,
    }


def summarize(result: dict, arms: list[TreeArm]) -> list[dict]:
    """Per format, group and arm: median time per token and mean tokens per forward; each
    tree's tokens per forward against the chain of its depth, time per token against the
    fastest chain and against plain."""
    rows = []
    for fmt in result["formats"]:
        by = defaultdict(list)
        for run in fmt["runs"]:
            by[(run["group"], run["arm"])].append(run)
        for group in GROUPS:
            stats = {}
            for arm in arms:
                runs = by[(group, arm.name)]
                if runs:
                    stats[arm.name] = (
                        statistics.median(r["ms_per_token"] for r in runs),
                        statistics.fmean(r["tokens_per_forward"] for r in runs),
                        all(r["equals_plain"] for r in runs),
                    )
            chains = [a for a in arms if a.k and not a.nodes and a.name in stats]
            fastest_chain = min((stats[a.name][0] for a in chains), default=float("nan"))
            plain_ms = stats["plain"][0] if "plain" in stats else float("nan")
            for arm in arms:
                if arm.name not in stats:
                    continue
                ms, tpf, exact = stats[arm.name]
                same_depth = f"chain:{arm.k}"
                rows.append(
                    {
                        "format": fmt["format"],
                        "group": group,
                        "arm": arm.name,
                        "ms_per_token": ms,
                        "tokens_per_forward": tpf,
                        "tpf_vs_chain_of_depth": tpf / stats[same_depth][1]
                        if arm.nodes and same_depth in stats
                        else None,
                        "speed_vs_fastest_chain": fastest_chain / ms if arm.k else None,
                        "speed_vs_plain": plain_ms / ms,
                        "output_equals_plain": exact,
                    }
                )
    return rows


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    lines = [
        "# Token trees against chains, batch 1",
        "",
        f"{provenance_line(result)}; {result['rounds']} rounds, "
        f"{result['prompts_per_group']} prompts per group, {result['max_tokens']} tokens, greedy. "
        "Medians over prompts and rounds; arms interleaved per prompt.",
        "",
        "| format | group | arm | ms / token | tokens / target forward | vs chain of its depth "
        "| speed vs fastest chain | speed vs plain | output = plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, digits=3):
        return "" if x is None else f"{x:.{digits}f}"

    for r in result["summary"]:
        lines.append(
            f"| {r['format']} | {r['group']} | {r['arm']} | {r['ms_per_token']:.1f} | "
            f"{r['tokens_per_forward']:.2f} | {f(r['tpf_vs_chain_of_depth'])} | "
            f"{f(r['speed_vs_fastest_chain'])} | {r['speed_vs_plain']:.3f} | "
            f"{'yes' if r['output_equals_plain'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    from specdec.evals.plots import _pyplot

    plt = _pyplot()
    formats = sorted({r["format"] for r in result["summary"]})
    fig, axes = plt.subplots(1, len(formats), figsize=(6 * len(formats), 4.5), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        for group, marker in zip(GROUPS, "os", strict=False):
            rows = [r for r in result["summary"] if r["format"] == fmt and r["group"] == group]
            for r in rows:
                color = "tab:gray" if r["arm"] == "plain" else (
                    "tab:blue" if r["arm"].startswith("chain") else "tab:green"
                )  # fmt: skip
                ax.scatter(r["tokens_per_forward"], r["ms_per_token"], color=color, marker=marker)
                ax.annotate(r["arm"], (r["tokens_per_forward"], r["ms_per_token"]), fontsize=7)
        ax.set_title(f"{fmt} (o code, s chat; blue chains, green trees)")
        ax.set_xlabel("tokens per target forward")
        ax.set_ylabel("ms per output token (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--formats",
        default="float32,bfloat16",
        help="comma-separated target dtypes or DTYPE:QUANTIZATION/DRAFT_QUANTIZATION[@KV] formats",
    )
    parser.add_argument("--arms", default=DEFAULT_ARMS, help="plain, chain:K, tree:N:K")
    parser.add_argument("--prompts-per-group", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        arms = [TreeArm.parse(a) for a in args.arms.split(",")]
        formats = [parse_format(f) for f in args.formats.split(",")]
    except ValueError as e:
        parser.error(str(e))
    if "plain" not in [a.name for a in arms]:
        parser.error("--arms must include plain (the reference output)")
    from specdec.evals.cost_table import cpu_flags_summary

    started = time.perf_counter()
    measured = [
        measure_format(f, arms, args.prompts_per_group, args.max_tokens, args.rounds, args.threads)
        for f in formats
    ]
    result = {
        "command": "python -m specdec.evals.trees.bench_trees " + " ".join(argv or sys.argv[1:]),
        "commit": git_commit(),
        "environment": environment_info(),
        "cpu_flags": cpu_flags_summary(),
        "threads": args.threads,
        "rounds": args.rounds,
        "prompts_per_group": args.prompts_per_group,
        "max_tokens": args.max_tokens,
        "formats": measured,
        "seconds": round(time.perf_counter() - started, 1),
    }
    result["summary"] = summarize(result, arms)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_trees.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench_trees.md").write_text(markdown(result))
    plot(result, out / "bench_trees.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
