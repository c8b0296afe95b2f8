"""`specdec trace`: record a trace set of a target/draft pair and the machine's cost table.

The replay (`specdec replay`) reads what this writes; see docs/evals.md, "Traces and replay".
"""

from __future__ import annotations

import argparse
import logging
import time

from specdec.engine.config import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DRAFT_QUANTIZATIONS,
    QUANTIZATIONS,
)
from specdec.engine.errors import ConfigError
from specdec.evals.cli_args import parse_floats
from specdec.evals.datasets import load_categories, parse_categories, prompt_token_ids

logger = logging.getLogger(__name__)

# The pool the replay gives its engine: the engine's default CPU KV budget for this pair.
REPLAY_KV_GIB = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace")
    g.add_argument("--output-dir", required=True, help="where requests.npz and meta.json go")
    g.add_argument("--model", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    g.add_argument("--draft-model", default=DEFAULT_DRAFT, help="draft (default: %(default)s)")
    g.add_argument("--categories", default="all", help="prompt categories, comma-separated")
    g.add_argument("--limit", type=int, default=4, help="prompts per category (default: 4)")
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=1024,
        help="skip prompts longer than this (default: %(default)s)",
    )
    g.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    g.add_argument("--temperatures", default="0,1", help="temperatures (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampled paths")
    g.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="dtype of both models, resolved as the engine resolves it (default: %(default)s); "
        "verify rows cost differently per format, so a cost table is per format",
    )
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="the target's weight format, as the engine's flag (default: %(default)s)",
    )
    g.add_argument(
        "--draft-quantization",
        choices=DRAFT_QUANTIZATIONS,
        default="auto",
        help="the draft's weight format, as the engine's flag (default: %(default)s); it changes "
        "the draft's top tokens and its forwards' cost",
    )
    g.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="rows of the draft's head, as the engine's flag (default: the engine's)",
    )
    g.add_argument("--max-num-seqs", type=int, default=16, help="batch while generating paths")
    g.add_argument("--no-cost-table", action="store_true", help="skip the step-cost table")
    g.add_argument(
        "--cost-table-only",
        action="store_true",
        help="keep the requests already in --output-dir and measure only a new cost table",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from specdec.engine.config import EngineConfig
    from specdec.engine.kv_cache import GIB, num_blocks_for_budget
    from specdec.engine.loader import load_model, resolve_draft_quantization, resolve_dtype
    from specdec.engine.sampling_params import SamplingParams
    from specdec.evals.cost_table import cpu_flags_summary, measure_cost_table
    from specdec.evals.environment import command_line, environment_info, git_commit
    from specdec.evals.trace_record import draft_side, plain_engine, record_requests
    from specdec.evals.traces import load_traces, save_traces

    if args.max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 0:
        raise ConfigError(
            f"--draft-vocab-size must be >= 0 (0: the full vocabulary), got {args.draft_vocab_size}"
        )
    temperatures = parse_floats(args.temperatures, "--temperatures")
    if any(t not in (0.0, 1.0) for t in temperatures):
        raise ConfigError("--temperatures: the replay models temperatures 0 and 1 only")
    categories = parse_categories(args.categories)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    draft_format = resolve_draft_quantization(args.draft_quantization, device)
    target = load_model(args.model, dtype, device, progress=False, quantization=args.quantization)
    draft = load_model(
        args.draft_model, dtype, device, progress=False, quantization=draft_format, role="draft"
    )
    # Pools big enough for the batch and for four 4k contexts of the cost table, no more (the
    # draft's pool is a speculative engine's: it holds the target's layers too).
    target_engine = plain_engine(
        target, 1.2, args.max_num_seqs, args.seed, dtype_name, args.quantization
    )
    draft_engine = draft_side(
        target, draft, 1.2, args.seed, dtype_name, args.quantization, args.draft_vocab_size
    )
    head = draft_engine.target_runner.output_token_ids
    formats = {
        "dtype": dtype_name,
        "quantization": args.quantization,
        "draft_quantization": draft_format,
        "draft_vocab_size": draft.arch.vocab_size if head is None else int(head.numel()),
        "threads": args.threads,
    }
    if args.cost_table_only:
        existing = load_traces(args.output_dir)
        meta = dict(existing.meta)
        meta["cost_table"] = measure_cost_table(target_engine, draft_engine)
        meta["cost_table_command"] = command_line()
        meta["cost_table_commit"] = git_commit()
        meta["cost_table_machine"] = dict(
            environment_info(), cpu_flags=cpu_flags_summary(), **formats
        )
        save_traces(args.output_dir, existing.requests, meta)
        print(f"measured a new cost table into {args.output_dir}")
        return 0

    prompts = load_categories(categories)
    requests = []
    counts: dict[str, int] = {}
    for p in prompts:
        ids = prompt_token_ids(p, target.tokenizer, target.arch.vocab_size)
        if len(ids) > args.max_prompt_tokens or counts.get(p.category, 0) >= args.limit:
            continue
        counts[p.category] = counts.get(p.category, 0) + 1
        for t in temperatures:
            seed = None if t == 0 else args.seed + len(requests)
            params = SamplingParams(temperature=t, max_tokens=args.max_tokens, seed=seed)
            requests.append((f"{p.id}@t{t:g}", p.category, ids, params))
    logger.info("recording %d requests (%s)", len(requests), counts)
    traces = record_requests(target_engine, draft_engine, requests)

    defaults = EngineConfig()
    meta = {
        "command": command_line(),
        "commit": git_commit(),
        "target": args.model,
        "draft": args.draft_model,
        "max_tokens": args.max_tokens,
        "vocab_size": target.arch.vocab_size,
        "machine": dict(environment_info(), cpu_flags=cpu_flags_summary(), **formats),
        # the engine the replay simulates: this pair's default KV pool and batch limits
        "engine": {
            "page_size": defaults.page_size,
            "num_kv_blocks": num_blocks_for_budget(
                [target.arch, draft.arch],
                defaults.page_size,
                dtype,
                int(REPLAY_KV_GIB * GIB),
            ),
            "max_num_seqs": defaults.max_num_seqs,
            "max_num_batched_tokens": defaults.max_num_batched_tokens,
        },
        "cost_table": {},
    }
    if not args.no_cost_table:
        t0 = time.perf_counter()
        meta["cost_table"] = measure_cost_table(target_engine, draft_engine)
        logger.info("cost table measured in %.0f s", time.perf_counter() - t0)
    meta["record_seconds"] = round(time.perf_counter() - start, 1)
    save_traces(args.output_dir, traces, meta)
    print(f"wrote {len(traces)} request traces to {args.output_dir} in {meta['record_seconds']} s")
    return 0
