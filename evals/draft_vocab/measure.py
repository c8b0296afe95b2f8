"""What the pruned draft head costs in acceptance and saves in draft time, for each N.

    python -m specdec.evals.draft_vocab.measure --corpus docs/results/draft_vocab/greedy_outputs.jsonl \
        --text 'specdec/**/*.py' 'engine/**/*.py' 'api/**/*.py' 'evals/**/*.py' 'docs/*.md' \
        --output-dir docs/results/draft_vocab

Acceptance (`replay`): the draft reads each corpus output once (teacher forcing, full head); for
every kept-vocabulary size N and ranking, its pruned greedy pick at every position gives the
greedy speculative decode at fixed k exactly (`replay.replay_greedy`). Rankings:

* ``frequency``: the table `build_table` makes, counted on the *other* half of the prompts
  (`corpus.fold`: every other prompt of each category) plus the --text files, so no output is
  measured against a table that counted it;
* ``frequency (outputs only)``: the same without the --text files;
* ``id order``: the special tokens and then the lowest ids (byte-pair ids roughly follow merge
  order, so this is the baseline a frequency table must beat).

On a subset (--sampled-per-category), the target reads the same outputs too, and the rejection
rule's expected acceptance at temperature 1, ``sum_y min(p(y), q_N(y))``, is averaged over
positions.

Draft cost: one-token draft forwards (batch 1, context --context tokens) through a head of N rows,
the arms interleaved round by round, medians reported; beside them the target's one-token decode
and (k + 1)-token verify forwards on the same machine, and from those an estimate of speculative
time per token, ``(k * draft + verify) / mean accepted length``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from specdec.evals.draft_vocab import corpus as corpus_io
from specdec.evals.draft_vocab.build_table import table_from, text_files
from specdec.evals.draft_vocab.replay import (
    GreedyReplay,
    pruned_argmax,
    rejection_acceptance,
    replay_greedy,
)

from specdec.draft_vocab import FrequencyTable, special_token_ids, tokenizer_fingerprint

SIZES = (8192, 16384, 32768, 65536, 0)  # the default --sizes; 0: the full vocabulary
KS = (4, 6)
RANKINGS = ("frequency", "frequency (outputs only)", "id order")


def fold_tables(
    records: Sequence[corpus_io.CorpusRecord], texts: list[list[int]], engine
) -> dict[tuple[str, int], FrequencyTable]:
    """(ranking, fold) -> the table used for the records of that fold (built from the other)."""
    arch, tok = engine.draft.arch, engine.draft.tokenizer
    eos = tuple(arch.eos_token_ids)
    out = {}
    for f in (0, 1):
        train = [r.output_ids for r in corpus_io.fold(records, 1 - f)]
        out[("frequency", f)] = table_from(train, texts, arch.vocab_size, tok, eos, {})
        out[("frequency (outputs only)", f)] = table_from(train, [], arch.vocab_size, tok, eos, {})
        specials = tuple(sorted(special_token_ids(tok, eos)))
        out[("id order", f)] = FrequencyTable(
            specials, arch.vocab_size, tokenizer_fingerprint(tok), {}
        )
    return out


def _fold_of(records: Sequence[corpus_io.CorpusRecord]) -> dict[str, int]:
    return {r.id: f for f in (0, 1) for r in corpus_io.fold(records, f)}


def _teacher_forced(runner, engine, record: corpus_io.CorpusRecord, seq_id: int) -> torch.Tensor:
    """[len(output), vocab] logits of ``runner`` at the rows that predicted each output token."""
    from specdec.engine.model_runner import RunEntry
    from specdec.engine.sampling_params import SamplingParams
    from specdec.engine.sequence import Sequence as Seq

    ids = list(record.prompt_ids) + list(record.output_ids)
    seq = Seq(seq_id, f"draft-vocab-{seq_id}", ids, SamplingParams(max_tokens=1), "off")
    engine.allocator.allocate(seq, seq.num_tokens)
    try:
        run = RunEntry(seq, ids[:-1], 0, len(record.output_ids))
        return runner.run([run]).float()
    finally:
        engine.allocator.free(seq)


def measure_acceptance(
    engine,
    records: Sequence[corpus_io.CorpusRecord],
    folds: dict[str, int],  # record id -> its fold, whose tables it is measured with
    tables: dict[tuple[str, int], FrequencyTable],
    sampled_per_category: int,
    sizes: Sequence[int],
) -> dict:
    vocab = engine.draft.arch.vocab_size
    kept = {(name, f, n): tables[(name, f)].kept_ids(n) for (name, f) in tables for n in sizes if n}
    replays = {(name, n, k): GreedyReplay() for name in RANKINGS for n in sizes for k in KS}
    covered = {(name, n): 0 for name in RANKINGS for n in sizes}
    agreed = {(name, n): 0 for name in RANKINGS for n in sizes}
    sampled = {(name, n): [] for name in RANKINGS for n in sizes}
    positions = 0
    per_category: dict[str, int] = {}
    for i, r in enumerate(records):
        f = folds[r.id]
        logits = _teacher_forced(engine.proposer.runner, engine, r, -1 - i)  # [T, vocab]
        out = torch.tensor(r.output_ids)
        want_p = per_category.get(r.category, 0) < sampled_per_category
        p = None
        if want_p:
            per_category[r.category] = per_category.get(r.category, 0) + 1
            t_logits = _teacher_forced(engine.target_runner, engine, r, -1000 - i)
            p = torch.softmax(t_logits.double(), dim=-1)
        positions += len(out)
        for name in RANKINGS:
            for n in sizes:
                ids = kept[(name, f, n)] if n else None
                pick = logits.argmax(dim=-1).cpu() if ids is None else pruned_argmax(logits, ids)
                agree = (pick == out).tolist()
                agreed[(name, n)] += sum(agree)
                if ids is None:
                    covered[(name, n)] += len(out)
                else:
                    mask = torch.zeros(vocab, dtype=torch.bool)
                    mask[ids] = True
                    covered[(name, n)] += int(mask[out].sum())
                for k in KS:
                    replays[(name, n, k)].add(replay_greedy(agree, k))
                if p is not None:
                    acc = rejection_acceptance(p, logits, ids)
                    sampled[(name, n)].extend(acc.tolist())
        print(f"  acceptance: {i + 1}/{len(records)} outputs", file=sys.stderr, flush=True)
    rows = []
    for name in RANKINGS:
        for n in sizes:
            if n == 0 and name != RANKINGS[0]:
                continue
            row = {
                "ranking": name if n else "full vocabulary",
                "draft_vocab_size": n or vocab,
                "positions": positions,
                "coverage": covered[(name, n)] / positions,
                "agreement": agreed[(name, n)] / positions,
                "sampled_positions": len(sampled[(name, n)]),
                "sampled_acceptance_t1": (
                    statistics.fmean(sampled[(name, n)]) if sampled[(name, n)] else None
                ),
            }
            for k in KS:
                rep = replays[(name, n, k)]
                row[f"k{k}_acceptance"] = rep.acceptance
                row[f"k{k}_mean_accepted_length"] = rep.mean_accepted_length
            rows.append(row)
    return {"rows": rows}


def measure_cost(
    engine,
    table: FrequencyTable,
    sizes: Sequence[int],
    context: int,
    rounds: int,
    reps: int,
    draft_only: bool = False,
) -> dict:
    """Median ms of one-token draft forwards per N and of the target's decode and verify."""
    from specdec.engine.model_runner import ModelRunner, RunEntry
    from specdec.engine.sampling import RowContext, compute_probs
    from specdec.engine.sampling_params import SamplingParams
    from specdec.engine.sequence import Sequence as Seq

    from specdec.draft_vocab import embed_logits

    base = engine.proposer.runner
    vocab = engine.draft.arch.vocab_size
    arms = {}
    for n in sizes:
        if n:
            ids = table.kept_ids(n)
            model = engine.draft.model.with_output_rows(ids)
            arms[f"draft N={n}"] = (ModelRunner(model, base.kv, base.backend, base.page_size), ids)
        else:
            arms["draft full"] = (base, None)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    seq = Seq(-7, "draft-vocab-cost", [1] * (context + 8), params, "off")
    engine.allocator.allocate(seq, seq.num_tokens)
    greedy_row = [RowContext(params, (), ())]
    k = KS[0]
    try:
        one = [RunEntry(seq, [1], context, 1)]
        verify = [RunEntry(seq, [1] * (k + 1), context, k + 1)]
        forward = {name: [] for name in arms}
        step = {name: [] for name in arms}
        target = {"target decode": [], f"target verify (k={k})": []}

        def timed(fn) -> float:
            best = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                best.append(time.perf_counter() - t0)
            return statistics.median(best) * 1e3

        for _ in range(rounds):
            for name, (runner, ids) in arms.items():
                forward[name].append(timed(lambda runner=runner: runner.run(one)))

                def draft_step(runner=runner, ids=ids) -> None:
                    logits = runner.run(one)
                    if ids is not None:
                        logits = embed_logits(logits, ids, vocab)
                    compute_probs(logits, greedy_row).argmax(dim=-1)

                step[name].append(timed(draft_step))
            if not draft_only:
                target["target decode"].append(timed(lambda: engine.target_runner.run(one)))
                target[f"target verify (k={k})"].append(
                    timed(lambda: engine.target_runner.run(verify))
                )
        med = statistics.median
        return {
            "context_tokens": context,
            "rounds": rounds,
            "reps_per_round": reps,
            "draft_forward_ms": {n: med(v) for n, v in forward.items()},
            "draft_step_ms": {n: med(v) for n, v in step.items()},
            # The fastest round: on a loaded shared machine, the least disturbed estimate.
            "draft_forward_ms_min": {n: min(v) for n, v in forward.items()},
            "draft_step_ms_min": {n: min(v) for n, v in step.items()},
            # Weight bytes one decode forward reads: every decoder layer, the final norm and the
            # head's rows (one embedding row is negligible).
            "draft_weight_bytes_per_forward": {
                name: runner.model.weight_bytes() for name, (runner, _) in arms.items()
            },
            "target_ms": {n: med(v) for n, v in target.items() if v},
        }
    finally:
        engine.allocator.free(seq)


def estimate(acceptance: dict, cost: dict, k: int) -> list[dict]:
    """Speculative ms per token, (k * draft step + verify) / mean accepted length, per N."""
    verify = cost["target_ms"][f"target verify (k={k})"]
    out = []
    for row in acceptance["rows"]:
        if row["ranking"] not in ("frequency", "full vocabulary"):
            continue
        n = row["draft_vocab_size"]
        name = "draft full" if row["ranking"] == "full vocabulary" else f"draft N={n}"
        draft = cost["draft_step_ms"][name]
        length = row[f"k{k}_mean_accepted_length"]
        out.append(
            {
                "draft_vocab_size": n,
                "draft_step_ms": draft,
                "ms_per_token": (k * draft + verify) / length if length else None,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="target (default: the default pair's)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny random pair (smoke run)")
    parser.add_argument("--corpus", required=True, help="JSONL of build_table generate")
    parser.add_argument("--text", nargs="*", default=[], help="glob patterns of text files")
    parser.add_argument("--limit", type=int, default=None, help="outputs per category")
    parser.add_argument(
        "--sizes",
        default=",".join(str(n) for n in SIZES),
        help="kept-vocabulary sizes N, 0 for the full vocabulary (default: %(default)s)",
    )
    parser.add_argument("--sampled-per-category", type=int, default=1)
    parser.add_argument(
        "--draft-only",
        action="store_true",
        help="load only the draft (the corpus holds the target's outputs): greedy acceptance and "
        "draft cost, no T=1 column, no target timings",
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    return run(args)


def build_engine(args: argparse.Namespace):
    from specdec.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
    from specdec.engine.llm_engine import LLMEngine

    target = draft = None
    if args.draft_only and not args.tiny:
        from specdec.engine.loader import load_model, resolve_device, resolve_dtype

        device = resolve_device("auto")
        name = args.draft_model or DEFAULT_DRAFT
        draft = load_model(name, resolve_dtype("auto", device), device, progress=False)
        target = draft  # the engine wants a target; nothing reads its runner in this mode
        models = dict(model=name, draft_model=name)
    elif args.tiny:
        from specdec.evals.tiny_pair import tiny_pair

        target, draft = tiny_pair()
        models = dict(model="tiny", draft_model="tiny-draft", device="cpu", dtype="float32")
    else:
        models = dict(
            model=args.model or DEFAULT_TARGET, draft_model=args.draft_model or DEFAULT_DRAFT
        )
    cfg = EngineConfig(
        **models,
        speculative_method="draft_model",
        speculative_mode="off",
        draft_vocab_size=0,  # the full head reads every position; pruning is applied here
        controller_warmup=False,
        max_model_len=2048,
        kv_cache_memory=0.25,  # one sequence at a time
        num_threads=args.num_threads,
    )
    return LLMEngine(cfg, target=target, draft=draft, progress=False)


def run(args: argparse.Namespace) -> int:
    from specdec.evals.cli_args import parse_ints
    from specdec.evals.environment import environment_info, git_commit

    engine = build_engine(args)
    corpus = corpus_io.read(args.corpus)
    files = text_files(args.text)
    tok = engine.draft.tokenizer
    texts = [tok.encode(f.read_text(errors="replace")) for f in files] if tok else []
    # Tables come from the whole corpus (each fold's from the other fold); --limit only thins
    # the outputs measured.
    tables = fold_tables(corpus, texts, engine)
    folds = _fold_of(corpus)
    records = corpus
    if args.limit is not None:
        by_cat: dict[str, int] = {}
        records = []
        for r in corpus:
            by_cat[r.category] = by_cat.get(r.category, 0) + 1
            if by_cat[r.category] <= args.limit:
                records.append(r)
    sizes = parse_ints(args.sizes, "--sizes", 0, engine.draft.arch.vocab_size)
    sampled = 0 if args.draft_only else args.sampled_per_category
    acceptance = measure_acceptance(engine, records, folds, tables, sampled, sizes)
    table = tables[("frequency", 0)]
    cost = measure_cost(engine, table, sizes, args.context, args.rounds, args.reps, args.draft_only)
    result = {
        "command": "python -m specdec.evals.draft_vocab.measure " + shlex.join(sys.argv[1:]),
        "commit": git_commit(),
        "environment": {**environment_info(), "cpu_flags": cpu_flags()},
        "dtype": str(engine.dtype).removeprefix("torch."),
        "target": None if args.draft_only else engine.config.model,
        "draft": engine.config.draft_model,
        "corpus": args.corpus,
        "outputs": len(records),
        "corpus_outputs": len(corpus),
        "text_files": len(files),
        "text_tokens": sum(len(t) for t in texts),
        "acceptance": acceptance,
        "cost": cost,
        "estimate_k4": [] if args.draft_only else estimate(acceptance, cost, KS[0]),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_vocab.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "draft_vocab.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix extensions that set which kernels are fast."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return sorted(f for f in have if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# Vocabulary-pruned draft head: acceptance and draft cost",
        "",
        f"Command: `{result['command']}` at commit `{result['commit']}`.",
        f"Target `{result['target']}`, draft `{result['draft']}`, {result['dtype']}, "
        f"{env['torch_threads']} threads, {env['cpu']} ({', '.join(env['cpu_flags'])}), "
        f"torch {env['torch']}, {env['time']}.",
        f"{result['outputs']} greedy outputs of the target ({result['acceptance']['rows'][0]['positions']} "
        f"positions) of the corpus's {result['corpus_outputs']}; each scored with frequency "
        "tables counted on the other half of the corpus's prompts"
        f" (+ {result['text_files']} project text files, {result['text_tokens']} tokens).",
        "",
        "## Acceptance (greedy, replayed exactly from teacher-forced draft picks)",
        "",
        "| ranking | N | coverage | agreement | k=4 acceptance | k=4 mean len | k=6 acceptance "
        "| k=6 mean len | T=1 rejection-rule acceptance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["acceptance"]["rows"]:
        t1 = r["sampled_acceptance_t1"]
        lines.append(
            f"| {r['ranking']} | {r['draft_vocab_size']} | {r['coverage']:.4f} | "
            f"{r['agreement']:.4f} | {r['k4_acceptance']:.4f} | {r['k4_mean_accepted_length']:.3f} "
            f"| {r['k6_acceptance']:.4f} | {r['k6_mean_accepted_length']:.3f} | "
            f"{'' if t1 is None else f'{t1:.4f}'} |"
        )
    cost = result["cost"]
    lines += [
        "",
        f"T=1 column: mean of sum_y min(p, q_N) over {result['acceptance']['rows'][0]['sampled_positions']} "
        "positions of the same outputs (a subset of prompts; none with --draft-only).",
        "",
        f"## Forward cost (batch 1, context {cost['context_tokens']}, median of {cost['rounds']} "
        f"interleaved rounds x {cost['reps_per_round']})",
        "",
        "| arm | weight MB read | forward ms (median / min) | step ms: forward + embed + greedy "
        "pick (median / min) |",
        "|---|---|---|---|",
    ]
    for name, ms in cost["draft_forward_ms"].items():
        mb = cost["draft_weight_bytes_per_forward"][name] / 1e6
        lines.append(
            f"| {name} | {mb:.0f} | {ms:.1f} / {cost['draft_forward_ms_min'][name]:.1f} | "
            f"{cost['draft_step_ms'][name]:.1f} / {cost['draft_step_ms_min'][name]:.1f} |"
        )
    for name, ms in cost["target_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | |")
    if not result["estimate_k4"]:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## Estimated speculative time per token (k=4, frequency ranking)",
        "",
        "| N | draft step ms | (4 x draft + verify) / mean accepted length, ms |",
        "|---|---|---|",
    ]
    for e in result["estimate_k4"]:
        lines.append(
            f"| {e['draft_vocab_size']} | {e['draft_step_ms']:.2f} | {e['ms_per_token']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
