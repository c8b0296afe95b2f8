"""`specdec eval`: offline acceptance-rate evals of a target/draft pair (see docs/evals.md)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from specdec.api.engine_args import add_engine_arguments, config_from_args
from specdec.engine.config import MAX_SPECULATIVE_TOKENS, MAX_TREE_NODES, EngineConfig
from specdec.engine.errors import ConfigError
from specdec.evals.cli_args import parse_choices, parse_floats, parse_ints
from specdec.evals.datasets import (
    limit_per_category,
    load_categories,
    load_prompt_file,
    parse_categories,
)
from specdec.evals.offline import PROPOSERS, EvalSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("eval")
    g.add_argument(
        "--proposers",
        default=",".join(PROPOSERS),
        help="proposers to evaluate, comma-separated (default: %(default)s)",
    )
    g.add_argument("--ks", default="1,2,4,8", help="draft lengths k (default: %(default)s)")
    g.add_argument(
        "--tree-nodes",
        default="",
        help="token-tree sizes, comma-separated: every proposer and k also runs drafting trees "
        "of N nodes, k deep, reported as rows beside its chain (default: chains only)",
    )
    g.add_argument(
        "--temperatures", default="0,1", help="sampling temperatures (default: %(default)s)"
    )
    g.add_argument(
        "--categories", default="all", help="built-in prompt categories, comma-separated, or all"
    )
    g.add_argument(
        "--dataset",
        default=None,
        help="a JSONL prompt file to use instead of the built-in sets (--categories is ignored)",
    )
    g.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)")
    g.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    g.add_argument(
        "--baselines",
        action="store_true",
        help="also run transformers generate (plain and assisted) on the same prompts",
    )
    g.add_argument(
        "--baseline-limit",
        type=int,
        default=None,
        help="prompts per category for the baselines (default: all eval prompts); transformers "
        "is slow on CPU, so the baselines can run on a subset",
    )
    g.add_argument("--output-dir", default="eval-results", help="where results are written")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)
    # The grid sets method, k and mode per engine; a small pool is plenty for one request at a
    # time, and with speculation forced on the controller's start-up calibration buys nothing.
    parser.set_defaults(kv_cache_memory=1.0, controller_warmup=False)


class PairEngines:
    """Builds one engine per (method, k) over models loaded once, so the grid pays one load."""

    def __init__(self, config: EngineConfig, draft_model: str | None, need_draft: bool) -> None:
        from specdec.engine.loader import load_model, resolve_device, resolve_dtype

        self.config = config
        self.draft_name = draft_model
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.target = load_model(config.model, self.dtype, self.device)
        self.draft = None
        if need_draft and draft_model:
            self.draft = load_model(draft_model, self.dtype, self.device)

    def eos_token_ids(self) -> list[int]:
        """What ends generation for the target, as the engine decides it (config + tokenizer)."""
        ids = set(self.target.arch.eos_token_ids)
        if self.target.tokenizer is not None:
            ids |= set(self.target.tokenizer.eos_token_ids)
        return sorted(ids)

    def __call__(self, method: str, k: int, tree_nodes: int = 0):
        from specdec.engine.llm_engine import LLMEngine

        config = dataclasses.replace(
            self.config,
            speculative_method=method,
            num_speculative_tokens=max(1, k),
            speculative_mode="auto",
            draft_model=self.draft_name if method == "draft_model" else None,
            spec_tree_max_nodes=tree_nodes,
            # trees are the fixed policy's; chains keep the configured policy
            speculative_policy="fixed" if tree_nodes else self.config.speculative_policy,
        )
        draft = self.draft if method == "draft_model" else None
        return LLMEngine(config, target=self.target, draft=draft, progress=False)

    def release(self) -> None:
        """Drop the models (the transformers baselines load their own copies next)."""
        self.target = self.draft = None


def settings_from_args(args: argparse.Namespace) -> EvalSettings:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.baseline_limit is not None and args.baseline_limit < 1:
        raise ConfigError(f"--baseline-limit must be >= 1, got {args.baseline_limit}")
    return EvalSettings(
        proposers=tuple(parse_choices(args.proposers, "--proposers", PROPOSERS)),
        ks=tuple(parse_ints(args.ks, "--ks", 1, MAX_SPECULATIVE_TOKENS)),
        tree_nodes=tuple(parse_ints(args.tree_nodes, "--tree-nodes", 1, MAX_TREE_NODES))
        if args.tree_nodes
        else (),
        temperatures=tuple(parse_floats(args.temperatures, "--temperatures")),
        max_tokens=args.max_tokens,
        seed=args.seed,
        baseline_limit=args.baseline_limit,
    )


def run(args: argparse.Namespace) -> int:
    from specdec.engine.weights import resolve_model
    from specdec.evals.baselines import HFGenerateBaseline
    from specdec.evals.environment import command_line, environment_info
    from specdec.evals.offline import evaluate

    settings = settings_from_args(args)
    draft_name = args.draft_model if args.draft_model not in (None, "", "none") else None
    if "draft_model" in settings.proposers and draft_name is None:
        raise ConfigError("--proposers includes draft_model but no --draft-model was given")
    if args.dataset:
        prompts = limit_per_category(load_prompt_file(args.dataset), args.limit)
    else:
        prompts = load_categories(parse_categories(args.categories), args.limit)
    config = config_from_args(argparse.Namespace(**{**vars(args), "speculative_method": "none"}))
    factory = PairEngines(config, draft_name, "draft_model" in settings.proposers)
    eos_token_ids = factory.eos_token_ids()

    def baselines() -> HFGenerateBaseline:
        draft_dir = resolve_model(draft_name) if draft_name else None
        return HFGenerateBaseline(
            resolve_model(config.model), draft_dir, eos_token_ids, factory.dtype, factory.device
        )

    meta = {
        "target": config.model,
        "draft": draft_name,
        "command": command_line(),
        "environment": environment_info(),
    }
    report = evaluate(
        prompts,
        factory,
        settings,
        baselines=baselines if args.baselines else None,
        progress=not args.no_progress,
        meta=meta,
    )
    return finish(report, args.output_dir)


def finish(report, output_dir: str) -> int:
    """Write the outputs, print the all-categories table, and say FAILURE loudly on any greedy
    mismatch. Returns the exit status: 1 when speculative and plain greedy outputs differ."""
    from specdec.evals.eval_report import category_table, write_eval_outputs

    paths = write_eval_outputs(report, output_dir)
    print(category_table(report, "all"))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    for failure in report.failures:
        print(
            f"FAILURE: {failure['proposer']} k={failure['k']} {failure['prompt_id']}: greedy "
            f"speculative output differs from plain at output token {failure['position']}",
            file=sys.stderr,
        )
    if report.failures:
        print(
            f"FAILURE: {len(report.failures)} greedy output(s) differ; speculative decoding "
            "was not lossless on this run",
            file=sys.stderr,
        )
    return 0 if report.ok else 1
