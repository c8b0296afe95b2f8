"""`specdec` command line: one sub-command per module, each with add_arguments() and run()."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from specdec.engine.errors import SpecdecError

# Sub-command -> module providing `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("specdec.api.commands.serve", "run the OpenAI-compatible server"),
    "cluster": (
        "specdec.api.cluster.command",
        "run the server with N engine replicas on Ray Serve (needs the cluster extra)",
    ),
    "generate": (
        "specdec.api.commands.generate",
        "generate text for one prompt, streamed to the terminal",
    ),
    "pull": (
        "specdec.api.commands.pull",
        "download, verify and convert the embedded default models",
    ),
    "eval": ("specdec.evals.commands.eval", "offline acceptance-rate evals of a target/draft pair"),
    "bench": ("specdec.evals.commands.bench", "load-test a running server (spec vs plain arms)"),
    "trace": ("specdec.evals.commands.trace", "record acceptance traces and the step-cost table"),
    "replay": ("specdec.evals.commands.replay", "replay speculation policies on recorded traces"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except SpecdecError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
