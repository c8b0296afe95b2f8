"""The corpus a frequency table is counted on: the target's greedy outputs on the built-in prompts.

Stored as JSONL, one record per prompt: ``{"id", "category", "prompt_ids", "output_ids"}``.
Greedy decoding makes the corpus a function of the model pair's weights and the prompts alone
(batched plain decode commits the same tokens as one request at a time: the engine's kernels
compute each row independently of the batch), so anyone can regenerate it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.evals.datasets import Prompt, prompt_token_ids


@dataclass(frozen=True)
class CorpusRecord:
    id: str
    category: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


def generate(engine, prompts: Sequence[Prompt], max_tokens: int) -> list[CorpusRecord]:
    """Greedy outputs of ``engine``'s target for every prompt, decoded as one batch."""
    from specdec.engine.sampling_params import SamplingParams

    vocab = engine.target.arch.vocab_size
    ids = [prompt_token_ids(p, engine.tokenizer, vocab) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = engine.generate(ids, params, speculative="off")
    return [
        CorpusRecord(p.id, p.category, tuple(i), tuple(o.output_token_ids))
        for p, i, o in zip(prompts, ids, outs, strict=True)
    ]


def from_trace(trace_dir: str | Path) -> list[CorpusRecord]:
    """The greedy (temperature 0) requests of a recorded trace set (`specdec trace`; the project
    ships one in evals/data/traces/), whose outputs are the target's own greedy decodes."""
    import numpy as np

    meta = json.loads((Path(trace_dir) / "meta.json").read_text())
    arrays = np.load(Path(trace_dir) / "requests.npz")
    prompts, tokens = arrays["prompt_ids"], arrays["tokens"]
    out = []
    for r in meta["requests"]:
        if r["temperature"] != 0.0:
            continue
        p0, o0 = r["prompt_offset"], r["output_offset"]
        out.append(
            CorpusRecord(
                str(r["id"]),
                str(r["category"]),
                tuple(int(t) for t in prompts[p0 : p0 + r["prompt_len"]]),
                tuple(int(t) for t in tokens[o0 : o0 + r["output_len"]]),
            )
        )
    return out


def write(records: Sequence[CorpusRecord], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            rec = {
                "id": r.id,
                "category": r.category,
                "prompt_ids": list(r.prompt_ids),
                "output_ids": list(r.output_ids),
            }
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def read(path: str | Path) -> list[CorpusRecord]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out.append(
                CorpusRecord(
                    str(r["id"]),
                    str(r["category"]),
                    tuple(int(t) for t in r["prompt_ids"]),
                    tuple(int(t) for t in r["output_ids"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a corpus record ({exc})") from exc
    return out


def fold(records: Sequence[CorpusRecord], index: int) -> list[CorpusRecord]:
    """Every other prompt of each category (``index`` 0 or 1): two disjoint halves, so a table
    counted on one half can be measured on the other."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        i = seen.get(r.category, 0)
        seen[r.category] = i + 1
        if i % 2 == index:
            out.append(r)
    return out
