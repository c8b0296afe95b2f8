"""`specdec generate "prompt"`: stream one completion to the terminal through LLMEngine."""

from __future__ import annotations

import argparse
import sys

from specdec.api.engine_args import add_engine_arguments, config_from_args
from specdec.engine.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--request-seed",
        dest="request_seed",
        type=int,
        default=None,
        help="this request's sampling seed (the engine has --seed)",
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--speculative",
        choices=("auto", "on", "off"),
        default=None,
        help="this request's speculation mode (default: the engine's --speculative-mode)",
    )
    parser.add_argument("--stats", action="store_true", help="print speculation stats at the end")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from specdec.engine.llm_engine import LLMEngine

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.request_seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    engine = LLMEngine(config_from_args(args))
    if args.raw or engine.tokenizer is None or not engine.tokenizer.has_chat_template:
        prompt = (
            args.prompt if engine.tokenizer is not None else [int(t) for t in args.prompt.split()]
        )
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = engine.tokenizer.apply_chat_template(messages)
    engine.add_request("cli", prompt, params, args.speculative)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(
                out.new_text if engine.tokenizer else " ".join(map(str, out.new_token_ids)) + " "
            )
            sys.stdout.flush()
            if out.finished:
                final = out
    sys.stdout.write("\n")
    if args.stats and final is not None:
        s = final.spec_stats
        print(
            f"[{len(final.output_token_ids)} tokens, finish={final.finish_reason}, "
            f"acceptance={s.acceptance_rate:.2f}, mean accepted length={s.mean_accepted_length:.2f}]",
            file=sys.stderr,
        )
    return 0
