"""What each draft format costs in acceptance and saves in draft time, on the real pair.

    python -m specdec.evals.formats.draft_quality --output-dir docs/results/formats \
        --draft-quantizations none,int8-dynamic,int4,int4+torch

For every draft format (``--draft-quantization``), the draft reads each committed greedy output
of the target (``docs/results/draft_vocab/greedy_outputs.jsonl``) the way it drafts: the prompt in
one prefill, then **one token per forward**, so a format whose kernel depends on the row count
(int4 switches to its int8 copy beyond a few rows) is measured on the rows it drafts with. At every
output position its greedy pick (through the engine's default pruned head) either equals the
target's token or not; those flags give the greedy speculative decode at any fixed k exactly
(`specdec.evals.draft_vocab.replay`). Beside them: the one-token draft forward and the target's
one-token decode step on the same machine, formats interleaved round by round, medians.

Every format keeps the output exact (the rejection rule verifies every draft token); what changes
is acceptance, and so the speed, which the adaptive policy prices from the measured rates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
from specdec.engine.models import native
from specdec.evals.draft_vocab import corpus as corpus_io
from specdec.evals.draft_vocab.replay import GreedyReplay, replay_greedy

KS = (2, 4, 6)
# A format named ``int4+torch`` is the int4 draft on the torch kernels instead of the native ones.
TORCH_KERNEL = "torch"
CORPUS = "docs/results/draft_vocab/greedy_outputs.jsonl"


def draft_agreement(engine, record: corpus_io.CorpusRecord, seq_id: int) -> list[bool]:
    """Per output position, whether the draft's greedy pick, having read the prompt and the
    output before it one token per forward, equals the target's token there."""
    from specdec.engine.model_runner import RunEntry
    from specdec.engine.sampling_params import SamplingParams
    from specdec.engine.sequence import Sequence

    runner = engine.proposer.runner
    ids = list(record.prompt_ids) + list(record.output_ids)
    seq = Sequence(seq_id, f"draft-quality-{seq_id}", ids, SamplingParams(max_tokens=1), "off")
    engine.allocator.allocate(seq, seq.num_tokens)
    token_ids = getattr(runner.model, "output_token_ids", None)  # the pruned head's ids
    prompt_len = len(record.prompt_ids)
    try:
        logits = runner.run([RunEntry(seq, ids[:prompt_len], 0, 1)])
        agree = []
        for t, want in enumerate(record.output_ids):
            pick = int(logits[-1].argmax())
            agree.append((pick if token_ids is None else int(token_ids[pick])) == want)
            if t + 1 < len(record.output_ids):
                logits = runner.run([RunEntry(seq, [want], prompt_len + t, 1)])
        return agree
    finally:
        engine.allocator.free(seq)


def measure(args: argparse.Namespace) -> dict:
    from specdec.engine.config import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.engine.llm_engine import LLMEngine
    from specdec.engine.loader import load_model, resolve_dtype
    from specdec.evals.formats.measure import Arm, one_row_forward_ms

    torch.set_num_threads(args.threads)
    records = corpus_io.read(args.corpus)
    if args.limit:
        records = records[: args.limit]
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    target = load_model(DEFAULT_TARGET, dtype, torch.device("cpu"), progress=False)
    engines = {}
    for fmt in args.draft_quantizations.split(","):
        scheme, _, kernel = fmt.partition("+")
        config = Arm(dtype_name, "none", scheme).config(args.threads)
        if kernel not in ("", TORCH_KERNEL):
            raise SystemExit(f"{fmt!r}: the only kernel suffix is +{TORCH_KERNEL}")
        with native.switched_off() if kernel else contextlib.nullcontext():
            engines[fmt] = LLMEngine(config, target=target, progress=False)
    rows = {}
    for fmt, engine in engines.items():
        agree_all: list[bool] = []
        replays = {k: GreedyReplay() for k in KS}
        for i, record in enumerate(records):
            agree = draft_agreement(engine, record, -1 - i)
            agree_all += agree
            for k in KS:
                replays[k].add(replay_greedy(agree, k))
        rows[fmt] = {
            "draft_quantization": fmt,
            "positions": len(agree_all),
            "agreement": sum(agree_all) / len(agree_all),
            **{f"k{k}_acceptance": replays[k].acceptance for k in KS},
            **{f"k{k}_tokens_per_verify": replays[k].mean_accepted_length for k in KS},
            "draft_ms": [],
            "target_ms": [],
            "draft_weight_bytes": engine.proposer.runner.model.weight_bytes(),
        }
        print(json.dumps({k: v for k, v in rows[fmt].items() if "ms" not in k}), flush=True)
    for _ in range(args.rounds):  # interleaved: a drift of the machine falls on every format
        for fmt, engine in engines.items():
            rows[fmt]["draft_ms"].append(one_row_forward_ms(engine, engine.proposer.runner, 9))
            rows[fmt]["target_ms"].append(one_row_forward_ms(engine, engine.target_runner, 5))
    for row in rows.values():
        row["draft_step_ms"] = statistics.median(row.pop("draft_ms"))
        row["target_step_ms"] = statistics.median(row.pop("target_ms"))
        row["draft_over_target"] = row["draft_step_ms"] / row["target_step_ms"]
    return {"dtype": dtype_name, "target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT, "rows": rows}


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    lines = [
        "# Draft formats: acceptance against draft time",
        "",
        f"{provenance_line(result)}, {result['dtype']} target and "
        f"draft. {result['outputs']} committed greedy outputs of the target, read by the draft "
        "one token per forward; acceptance and tokens per verify at fixed k replayed exactly from "
        "its greedy picks; step times are medians of one-token forwards at a 64-token context, "
        f"{result['rounds']} rounds with the formats interleaved.",
        "",
        "| draft format | agreement | "
        + " | ".join(f"k={k} acceptance | k={k} tokens/verify" for k in KS)
        + " | draft step ms | target step ms | draft / target | draft weights held, MB |",
        "|---|---|" + "---|---|" * len(KS) + "---|---|---|---|",
    ]
    for row in result["rows"].values():
        cells = [
            f"{row[f'k{k}_acceptance']:.3f} | {row[f'k{k}_tokens_per_verify']:.2f}" for k in KS
        ]
        lines.append(
            f"| `{row['draft_quantization']}` | {row['agreement']:.3f} | "
            + " | ".join(cells)
            + f" | {row['draft_step_ms']:.1f} | {row['target_step_ms']:.1f} "
            f"| {row['draft_over_target']:.3f} | {row['draft_weight_bytes'] / 1e6:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", type=Path, required=True)
    ap.add_argument("--draft-quantizations", default="none,int8-dynamic,int4")
    ap.add_argument("--dtype", default="auto", help="target and draft weight dtype")
    ap.add_argument("--corpus", default=CORPUS, help="JSONL of the target's greedy outputs")
    ap.add_argument("--limit", type=int, default=0, help="first N outputs only (0: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from specdec.evals.environment import result_header, write_result

    measured = measure(args)  # first: the header records the threads it set
    result = {
        **result_header("specdec.evals.formats.draft_quality", argv, args.threads),
        "rounds": args.rounds,
        "outputs": len(corpus_io.read(args.corpus)[: args.limit or None]),
        **measured,
    }
    write_result(args.output_dir, "draft_quality", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
