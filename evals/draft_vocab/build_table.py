"""Build the draft's frequency table (`specdec.draft_vocab.FrequencyTable`).

A corpus of the target's greedy outputs, then the table, each a subcommand:

    python -m specdec.evals.draft_vocab.build_table from-trace --output CORPUS.jsonl
        the greedy (T=0) requests of a recorded trace set (default evals/data/traces: 21 outputs
        of the default pair, up to 96 tokens, the first three prompts of each built-in category).
    python -m specdec.evals.draft_vocab.build_table generate --output CORPUS.jsonl
        or new ones: the target's greedy outputs (128 tokens) on the built-in prompts
        (evals/data/), decoded --batch at a time by plain decode; needs only the target (fp32:
        about 6 GB of weights plus the 2 GB KV pool).
    python -m specdec.evals.draft_vocab.build_table build --corpus CORPUS.jsonl \
            [--text FILE ...] --output specdec/vocab_tables/qwen2.5.json
        ranks token ids: the tokenizer's added tokens and the model's end-of-sequence ids first,
        then the corpus's output tokens by count, then tokens only the --text files hold (by count
        there); ids no source holds follow in id order when N exceeds the table. Reads only the
        model's config and tokenizer.

The shipped table's own record (its "source" field) names the command and commit that built it.
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.engine.config import DEFAULT_TARGET
from specdec.evals.draft_vocab import corpus as corpus_io

from specdec.draft_vocab import FrequencyTable, rank_tokens, special_token_ids
from specdec.draft_vocab import tokenizer_fingerprint as fingerprint


def table_from(
    outputs: Sequence[Sequence[int]],
    texts: Sequence[Sequence[int]],
    vocab_size: int,
    tokenizer,
    eos_token_ids: Sequence[int],
    source: dict,
) -> FrequencyTable:
    """A table ranking ``outputs`` tokens first, then tokens only ``texts`` hold."""
    ranked = rank_tokens(
        [[t for o in outputs for t in o], [t for x in texts for t in x]],
        special_token_ids(tokenizer, eos_token_ids),
        vocab_size,
    )
    return FrequencyTable(tuple(ranked), vocab_size, fingerprint(tokenizer), source)


def model_vocabulary(name: str):
    """(vocab size, tokenizer or None, eos ids) of a model, from its config and tokenizer files."""
    from specdec.engine.models import model_arch_from_hf_config
    from specdec.engine.weights import load_hf_config, resolve_model

    path = resolve_model(name)
    arch = model_arch_from_hf_config(load_hf_config(path))
    tokenizer = None
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        from specdec.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
    return arch.vocab_size, tokenizer, tuple(arch.eos_token_ids)


def text_files(patterns: Sequence[str]) -> list[Path]:
    files = sorted({Path(f) for p in patterns for f in glob.glob(p, recursive=True)})
    return [f for f in files if f.is_file()]


def run_generate(args: argparse.Namespace) -> int:
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.evals.datasets import load_categories

    config = EngineConfig(
        model=args.model,
        draft_model=None,
        speculative_method="none",
        dtype=args.dtype,
        num_threads=args.num_threads,
        max_num_seqs=args.batch,
        controller_warmup=False,
    )
    engine = LLMEngine(config)
    prompts = load_categories(["all"], args.limit)
    records = corpus_io.generate(engine, prompts, args.max_tokens)
    corpus_io.write(records, args.output)
    print(f"wrote {len(records)} outputs to {args.output}")
    return 0


def run_from_trace(args: argparse.Namespace) -> int:
    records = corpus_io.from_trace(args.trace)
    corpus_io.write(records, args.output)
    print(f"wrote {len(records)} greedy outputs of {args.trace} to {args.output}")
    return 0


def run_build(args: argparse.Namespace) -> int:
    from specdec.evals.environment import git_commit

    vocab, tokenizer, eos = model_vocabulary(args.model)
    records = corpus_io.read(args.corpus) if args.corpus else []
    files = text_files(args.text)
    if tokenizer is None and files:
        raise SystemExit("--text needs a model with a tokenizer")
    texts = [tokenizer.encode(f.read_text(errors="replace")) for f in files]
    source = {
        "model": args.model,
        "corpus": args.corpus,
        "corpus_outputs": len(records),
        "corpus_tokens": sum(len(r.output_ids) for r in records),
        "text_files": len(files),
        "text_tokens": sum(len(t) for t in texts),
        "text_patterns": list(args.text),
        "commit": git_commit(),
        "command": "python -m specdec.evals.draft_vocab.build_table " + " ".join(sys.argv[1:]),
    }
    table = table_from([r.output_ids for r in records], texts, vocab, tokenizer, eos, source)
    table.write(args.output)
    print(f"wrote {len(table.ranked_ids)} ranked ids to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    gen = sub.add_parser("generate", help="the target's greedy outputs on the built-in prompts")
    gen.add_argument("--model", default=DEFAULT_TARGET)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--num-threads", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--limit", type=int, default=None, help="prompts per category")
    gen.add_argument("--batch", type=int, default=32, help="sequences decoded at once")
    gen.add_argument("--output", required=True)
    trace = sub.add_parser("from-trace", help="the greedy outputs of a recorded trace set")
    trace.add_argument("--trace", default="evals/data/traces")
    trace.add_argument("--output", required=True)
    build = sub.add_parser("build", help="rank token ids of a corpus (and text files)")
    build.add_argument("--model", default=DEFAULT_TARGET, help="whose tokenizer and config")
    build.add_argument("--corpus", default=None, help="JSONL of the generate step")
    build.add_argument("--text", nargs="*", default=[], help="glob patterns of text files")
    build.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    steps = {"generate": run_generate, "from-trace": run_from_trace, "build": run_build}
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
