"""Measurement: does a target forward's time depend on how its rows split over sequences?

The policy prices a forward by its rows, its sequences and the (query, key) pairs it attends to
(docs/controller.md, "Step time"). A cost-table point that breaks that model, such as 16 rows
over 16 sequences timed below 14 rows over 2, is either a real cost of rows per sequence (which
would need a term of its own) or the machine's noise while the table was measured. This program
tells the two apart: it times forwards of equal total rows split as 1 x R, 2 x R/2, ... R x 1
sequences at one context, in rounds whose shape order is shuffled (seeded), and reports each
shape's time over a reference shape's in the same round. A slow spell of a shared machine moves
both sides of a paired ratio; a cost of the split shows as a ratio that stays off 1 in every round.
``--groups ladders`` times verify ladders instead (1-4 rows a sequence at 8 and 16 sequences,
over one row a sequence), the shapes whose ratios decide which draft length a cost table favours.

    python -m specdec.evals.controller_sweep.row_split --output-dir docs/results/controller
    python -m specdec.evals.controller_sweep.row_split --groups ladders --context 32
    python -m specdec.evals.controller_sweep.row_split --tiny --rounds 3   # smoke run

Every row keeps its logits, as a verify's do.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from statistics import median

Shape = tuple[int, int]  # (sequences, rows each)
# Each group's first shape is its reference. Splits: equal total rows over fewer sequences.
SPLITS: dict[str, tuple[Shape, ...]] = {
    "8 rows": ((8, 1), (4, 2), (2, 4), (1, 8)),
    "16 rows": ((16, 1), (8, 2), (4, 4), (2, 8), (1, 16)),
    "14 rows": ((14, 1), (2, 7)),
    "32 rows": ((32, 1), (16, 2), (8, 4), (4, 8)),
}
# Ladders: plain decode and verifies of k = 1..3 at one sequence count.
LADDERS: dict[str, tuple[Shape, ...]] = {
    "8 sequences": ((8, 1), (8, 2), (8, 3), (8, 4)),
    "16 sequences": ((16, 1), (16, 2), (16, 3), (16, 4)),
}
GROUPS = {"splits": SPLITS, "ladders": LADDERS}
TITLES = {
    "splits": "Forward time by how rows split over sequences",
    "ladders": "Forward time by verify rows a sequence",
}


def all_shapes(groups: dict[str, tuple[Shape, ...]] = SPLITS) -> list[Shape]:
    return list(dict.fromkeys(shape for group in groups.values() for shape in group))


def paired_ratios(
    rounds: list[dict[Shape, float]], groups: dict[str, tuple[Shape, ...]] = SPLITS
) -> dict[tuple[str, Shape], list[float]]:
    """Each (group, shape)'s seconds over its group's reference shape's, one ratio per round."""
    out: dict[tuple[str, Shape], list[float]] = {}
    for name, group in groups.items():
        ref = group[0]
        for shape in group:
            out[(name, shape)] = [r[shape] / r[ref] for r in rounds if shape in r and ref in r]
    return out


def summarize(
    rounds: list[dict[Shape, float]], context: int, groups: dict[str, tuple[Shape, ...]]
) -> list[dict]:
    ratios = paired_ratios(rounds, groups)
    rows = []
    for name, group in groups.items():
        for seqs, each in group:
            times = [r[(seqs, each)] for r in rounds if (seqs, each) in r]
            if not times:
                continue
            rs = ratios[(name, (seqs, each))]
            rows.append(
                {
                    "group": name,
                    "seqs": seqs,
                    "rows_each": each,
                    "context": context,
                    "attended": seqs * each * (context + each),
                    "median_ms": 1e3 * median(times),
                    "min_ms": 1e3 * min(times),
                    "max_ms": 1e3 * max(times),
                    "ratio_to_ref_median": median(rs),
                    "ratio_to_ref_min": min(rs),
                    "ratio_to_ref_max": max(rs),
                    "reference": f"{group[0][0]} x {group[0][1]}",
                }
            )
    return rows


def markdown(result: dict) -> str:
    from specdec.evals.environment import provenance_line

    lines = [
        f"# {TITLES[result['groups']]}",
        "",
        f"{provenance_line(result)}, {result['dtype']}, {result['rounds']} rounds of fastest"
        f" of {result['repeats']}, context {result['context']}.",
        "",
        "| group | sequences x rows | median ms | range ms | / reference, median | range |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["shapes"]:
        lines.append(
            f"| {r['group']} | {r['seqs']} x {r['rows_each']} | {r['median_ms']:.1f} |"
            f" {r['min_ms']:.1f}-{r['max_ms']:.1f} | {r['ratio_to_ref_median']:.3f} |"
            f" {r['ratio_to_ref_min']:.2f}-{r['ratio_to_ref_max']:.2f} |"
        )
    lines += ["", "The reference of each group is its first line (one row a sequence)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="write the result here (row_split.*, row_split_ladders.*)",
    )
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="forwards per shape a round (fastest)")
    p.add_argument("--context", type=int, default=128, help="keys before each sequence's rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--seed", type=int, default=0, help="seed of the shapes' order per round")
    p.add_argument("--groups", choices=tuple(GROUPS), default="splits", help="which shapes")
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight target instead")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or args.context < 0:
        p.error("--rounds and --repeats must be >= 1, --context >= 0")

    import torch
    from specdec.engine.calibration import time_forward
    from specdec.engine.config import DEFAULT_TARGET
    from specdec.engine.loader import load_model, resolve_dtype
    from specdec.evals.environment import result_header, write_result
    from specdec.evals.trace_record import plain_engine

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    if args.tiny:
        from specdec.evals.tiny_pair import tiny_pair

        model, loaded, dtype = "tiny", tiny_pair()[0], torch.float32
    else:
        model = DEFAULT_TARGET
        loaded = load_model(model, dtype, device, progress=False)
    engine = plain_engine(loaded, 1.0, 32, 0, str(dtype).removeprefix("torch."))
    runner, allocator = engine.target_runner, engine.allocator
    free_before = allocator.num_free_blocks
    time_forward(runner, allocator, 1, 1, 1, context=args.context)  # one-off allocations

    rng = random.Random(args.seed)
    rounds: list[dict[Shape, float]] = []
    for i in range(args.rounds):
        order = all_shapes(GROUPS[args.groups])
        rng.shuffle(order)
        times = {}
        for seqs, each in order:
            t = time_forward(
                runner,
                allocator,
                seqs,
                each,
                each,
                context=args.context,
                repeats=args.repeats,
                exact_context=True,
            )
            if t is not None:
                times[(seqs, each)] = t
        rounds.append(times)
        print(f"round {i + 1}/{args.rounds}: {len(times)} shapes", file=sys.stderr)
    if allocator.num_free_blocks != free_before:
        raise AssertionError("row_split leaked KV blocks")

    result = result_header(
        "specdec.evals.controller_sweep.row_split", argv, threads=args.threads
    ) | {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "context": args.context,
        "groups": args.groups,
        "shapes": summarize(rounds, args.context, GROUPS[args.groups]),
        "per_round_ms": [{f"{s}x{e}": 1e3 * t for (s, e), t in sorted(r.items())} for r in rounds],
    }
    text = markdown(result)
    print(text)
    if args.output_dir is not None:
        name = "row_split" if args.groups == "splits" else f"row_split_{args.groups}"
        write_result(args.output_dir, name, result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
