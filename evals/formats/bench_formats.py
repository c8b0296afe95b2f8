"""Weight formats on the real pair, side by side: each arm (target dtype and quantization, draft
quantization) runs in its own process, arms interleaved round by round, and the report compares
batch-1 plain and speculative (adaptive) decode on code and chat prompts, draft forward time
against a target step, peak resident memory, and the quality of quantized targets (agreement with
the fp32 greedy output, perplexity on `evals/data/heldout/`) and drafts (agreement with the
target's greedy token, acceptance).

    python -m specdec.evals.formats.bench_formats --output-dir docs/results/formats
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

from specdec.engine.cpu_features import vector_flags_summary
from specdec.evals.environment import environment_info, git_commit
from specdec.evals.formats.measure import LONG_CONTEXT, Arm, measure_arm
from specdec.evals.greedy_check import first_difference

DEFAULT_ARMS = (
    "float32:none/none",
    "bfloat16:none/none",
    "bfloat16:none/int8",
    "bfloat16:none/int8-dynamic",
    "bfloat16:int8/int8-dynamic",
)
REFERENCE = "float32:none/none"  # quantized targets' agreement is measured against its outputs
CATEGORIES = {"code": ("code_generation", "code_editing"), "chat": ("multi_turn_chat",)}


def load_prompts(per_category: int) -> list[tuple[str, str, str]]:
    """(id, code|chat, category file) for the first prompts of each group."""
    from specdec.evals.datasets import load_categories

    chosen = []
    for group, categories in CATEGORIES.items():
        prompts = load_categories(list(categories), limit=per_category)
        chosen += [(p.id, group, p.category) for p in prompts[:per_category]]
    return chosen


def heldout_text() -> str:
    return (resources.files("specdec.evals.data") / "heldout" / "mixed.txt").read_text()


def child(args: argparse.Namespace) -> int:
    """Measure one arm and write its JSON to --child-output."""
    import torch
    from specdec.engine.tokenizer import Tokenizer
    from specdec.engine.weights import resolve_model
    from specdec.evals.datasets import load_categories, prompt_token_ids

    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_dir(resolve_model(Arm.parse(args.child).config(1).model))
    by_id = {p.id: p for p in load_categories([c for cs in CATEGORIES.values() for c in cs])}
    prompts = [
        (pid, group, prompt_token_ids(by_id[pid], tokenizer, 1 << 30))
        for pid, group, _ in load_prompts(args.prompts_per_category)
    ]
    result = measure_arm(
        Arm.parse(args.child), prompts, heldout_text(), args.max_tokens, args.threads
    )
    Path(args.child_output).write_text(json.dumps(result))
    return 0


def run_arm_process(arm: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "arm.json"
        cmd = [
            sys.executable,
            "-m",
            "specdec.evals.formats.bench_formats",
            "--child",
            arm,
            "--child-output",
            str(out),
            "--threads",
            str(args.threads),
            "--max-tokens",
            str(args.max_tokens),
            "--prompts-per-category",
            str(args.prompts_per_category),
        ]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Per arm: medians over prompts and rounds, quality against the reference arm."""
    by_arm: dict[str, list[dict]] = {}
    for results in rounds:
        for r in results:
            by_arm.setdefault(r["name"], []).append(r)
    reference = {
        run["id"]: run["plain_tokens"]
        for run in (by_arm.get(REFERENCE) or [{"runs": []}])[0]["runs"]
    }
    rows = []
    for name, results in by_arm.items():
        runs = [run for r in results for run in r["runs"]]
        row: dict = {"arm": name, "resolved_dtype": results[0]["resolved_dtype"]}
        for group in CATEGORIES:
            mine = [run for run in runs if run["category"] == group]
            row[f"{group}_plain_tok_s"] = statistics.median(x["plain_tok_s"] for x in mine)
            row[f"{group}_spec_tok_s"] = statistics.median(x["spec_tok_s"] for x in mine)
            row[f"{group}_fixed_k_tok_s"] = statistics.median(x["fixed_k_tok_s"] for x in mine)
        target_ms = statistics.median(r["target_step_ms"] for r in results)
        long_ms = [r["target_step_long_ms"] for r in results if "target_step_long_ms" in r]
        draft_ms = statistics.median(r["draft_step_ms"] for r in results)
        judged = sum(x["first_position_judged"] for x in runs)
        drafted = sum(x["drafted"] for x in runs)
        first_runs = results[0]["runs"]
        agreement = [
            _agreement(run["plain_tokens"], reference[run["id"]])
            for run in first_runs
            if run["id"] in reference
        ]
        row.update(
            target_step_ms=target_ms,
            target_step_long_ms=statistics.median(long_ms) if long_ms else None,
            kv_blocks_per_gib=results[0].get("kv_blocks"),
            draft_step_ms=draft_ms,
            draft_over_target=draft_ms / target_ms,
            draft_agreement=sum(x["first_position_accepted"] for x in runs) / judged
            if judged
            else None,
            acceptance=sum(x["accepted"] for x in runs) / drafted if drafted else None,
            tokens_per_target_step=sum(x["emitted"] for x in runs)
            / max(1, sum(x["target_steps"] for x in runs)),
            spec_equals_plain=all(x["spec_equals_plain"] for x in runs),
            auto_drafted=sum(x["auto_drafted"] for x in runs),
            matching_prefix_vs_fp32=statistics.mean(agreement) if agreement else None,
            identical_to_fp32=sum(a == 1.0 for a in agreement) if agreement else None,
            prompts=len(first_runs),
            perplexity=statistics.median(r["perplexity"] for r in results),
            peak_rss_gib=max(r["peak_rss_gib"] for r in results),
            load_seconds=statistics.median(r["load_seconds"] for r in results),
            kv_blocks_leaked=any(r["kv_blocks_leaked"] for r in results),
        )
        rows.append(row)
    return rows


def _agreement(tokens: list[int], reference: list[int]) -> float:
    """Fraction of the reference output reproduced before the first differing token."""
    diff = first_difference(tokens, reference)
    return 1.0 if diff is None else diff / max(1, len(reference))


def markdown(result: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = [
        "# Weight formats on the default pair",
        "",
        f"Command: `{result['command']}` at commit {result['commit']}.",
        f"Machine: {result['environment']['cpu']} ({result['cpu_flags']}), "
        f"{result['threads']} threads, torch {result['environment']['torch']}, "
        f"{result['date']}. Batch 1, greedy, {result['max_tokens']} tokens per prompt, "
        f"{result['rounds']} round(s) of every arm in its own process, arms interleaved. "
        "Arm = `target dtype:target quantization/draft quantization[@KV pool format]` (the draft "
        "runs in the target's dtype; the KV pool holds the model dtype unless `@fp8...` says).",
        "",
        "| arm | code plain tok/s | code adaptive tok/s | code k=6 tok/s | chat plain tok/s "
        "| chat adaptive tok/s | chat k=6 tok/s | adaptive drafted | target step ms "
        f"| target step ms at {LONG_CONTEXT} | KV blocks per GiB "
        "| draft step ms | draft / target | draft agreement | acceptance (k=6) "
        "| spec == plain | prefix kept vs fp32 | perplexity | peak RSS GiB |",
        "|---" * 19 + "|",
    ]
    for r in result["arms"]:
        lines.append(
            f"| `{r['arm']}` | {f(r['code_plain_tok_s'])} | {f(r['code_spec_tok_s'])} "
            f"| {f(r['code_fixed_k_tok_s'])} | {f(r['chat_plain_tok_s'])} "
            f"| {f(r['chat_spec_tok_s'])} | {f(r['chat_fixed_k_tok_s'])} | {r['auto_drafted']} "
            f"| {f(r['target_step_ms'], '.0f')} | {f(r.get('target_step_long_ms'), '.0f')} "
            f"| {r.get('kv_blocks_per_gib', '-')} | {f(r['draft_step_ms'], '.0f')} "
            f"| {f(r['draft_over_target'])} | {f(r['draft_agreement'])} | {f(r['acceptance'])} "
            f"| {'yes' if r['spec_equals_plain'] else 'NO'} "
            f"| {f(r['matching_prefix_vs_fp32'])} ({r['identical_to_fp32']}/{r['prompts']}) "
            f"| {f(r['perplexity'], '.3f')} | {f(r['peak_rss_gib'])} |"
        )
    lines += [
        "",
        "Adaptive: `speculative=auto` with the adaptive policy (adaptive drafted: draft tokens it "
        "proposed over all prompts; 0 means it chose plain decode). k=6: `speculative=on`, six "
        "drafts every step. Draft agreement: share of first draft positions (k=6 runs) where the "
        "draft's greedy token equals the target's. Acceptance: accepted / drafted tokens. Prefix "
        "kept vs fp32: mean share of the fp32 target's plain greedy output reproduced before the "
        "first differing token (in brackets, prompts identical throughout). Perplexity: the "
        "target on `evals/data/heldout/mixed.txt`. Peak RSS: the arm's whole process (both "
        "models, KV pool, runtime).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", default="docs/results/formats")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-category", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-output", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    arms = [Arm.parse(a).name for a in args.arms.split(",") if a]
    if args.rounds < 1 or args.max_tokens < 2 or args.prompts_per_category < 1:
        ap.error("--rounds and --prompts-per-category must be >= 1, --max-tokens >= 2")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m specdec.evals.formats.bench_formats " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    result = {
        "command": command.strip(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment_info(),
        "cpu_flags": vector_flags_summary(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "raw": [],
    }
    for round_index in range(args.rounds):
        # Each round visits the arms in turn; later rounds rotate the order so no arm always
        # runs first (machine speed drifts within minutes).
        order = arms[round_index % len(arms) :] + arms[: round_index % len(arms)]
        results = []
        for arm in order:
            print(f"round {round_index + 1}: {arm}", file=sys.stderr, flush=True)
            results.append(run_arm_process(arm, args))
            result["raw"] = [*result["raw"][:round_index], results]
            result["arms"] = summarize(result["raw"])
            (out_dir / "formats.json").write_text(json.dumps(result, indent=1))
            (out_dir / "formats.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
