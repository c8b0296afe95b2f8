"""Recorded traces of a target/draft pair: what the replay needs to re-run speculation offline.

A trace set is a directory with two files:

- ``requests.npz``: per request, the prompt's token ids and, per output position along the
  target's path, the target's token and its probability, the draft's top-``TOP_K`` tokens and
  their probabilities given the true prefix, and the target's probability of each of those draft
  tokens. Probabilities are float16 at temperature 1 (no top-p/top-k), token ids int32; the
  requests' arrays are concatenated and ``meta.json`` holds each one's offsets.
- ``meta.json``: the requests (id, category, temperature, seed, lengths, offsets), the pair and
  how the set was recorded, and the machine's step-cost table (see ``specdec.evals.cost_table``).

Greedy replay of any chain length is exact from these: a chain of k drafts accepts
min(k, leading positions where the draft's top-1 equals the target's token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOP_K = 8  # draft tokens kept per position
REQUESTS_FILE = "requests.npz"
META_FILE = "meta.json"
DEFAULT_TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"
# the meta.json keys that describe a cost table and where it was measured
COST_TABLE_KEYS = ("cost_table", "cost_table_command", "cost_table_commit", "cost_table_machine")


@dataclass
class RequestTrace:
    """One request along the target's path (``n`` output positions)."""

    id: str
    category: str
    temperature: float
    seed: int | None
    prompt_ids: np.ndarray  # [prompt_len] int32
    tokens: np.ndarray  # [n] int32: the target's token at each output position
    target_prob: np.ndarray  # [n] float: the target's probability of that token
    draft_ids: np.ndarray  # [n, TOP_K] int32: the draft's top tokens given the true prefix
    draft_probs: np.ndarray  # [n, TOP_K] float: their draft probabilities
    target_probs_of_draft: np.ndarray  # [n, TOP_K] float: the target's probability of each

    @property
    def num_output(self) -> int:
        return int(self.tokens.shape[0])

    def greedy_match(self) -> np.ndarray:
        """[n] bool: whether the draft's top-1 equals the target's token (greedy acceptance)."""
        return self.draft_ids[:, 0] == self.tokens

    def overlap(self) -> np.ndarray:
        """[n] float: sum over the draft's top tokens x of min(p(x), q(x)), a lower bound of the
        probability that the standard rejection rule accepts a draft sampled from q."""
        p = self.target_probs_of_draft.astype(np.float64)
        q = self.draft_probs.astype(np.float64)
        return np.minimum(p, q).sum(axis=1).clip(0.0, 1.0)


@dataclass
class TraceSet:
    requests: list[RequestTrace]
    meta: dict  # everything in meta.json except the per-request offsets

    @property
    def cost_table(self) -> dict:
        return self.meta["cost_table"]


def save_traces(directory: str | Path, requests: list[RequestTrace], meta: dict) -> None:
    """Write ``requests.npz`` and ``meta.json`` (keys sorted, so equal inputs give equal bytes)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = []
    prompt_off = out_off = 0
    for r in requests:
        index.append(
            {
                "id": r.id,
                "category": r.category,
                "temperature": r.temperature,
                "seed": r.seed,
                "prompt_offset": prompt_off,
                "prompt_len": int(r.prompt_ids.shape[0]),
                "output_offset": out_off,
                "output_len": r.num_output,
            }
        )
        prompt_off += int(r.prompt_ids.shape[0])
        out_off += r.num_output

    def cat(name: str, dtype: type) -> np.ndarray:
        parts = [getattr(r, name).astype(dtype) for r in requests]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    np.savez_compressed(
        directory / REQUESTS_FILE,
        prompt_ids=cat("prompt_ids", np.int32),
        tokens=cat("tokens", np.int32),
        target_prob=cat("target_prob", np.float16),
        draft_ids=cat("draft_ids", np.int32),
        draft_probs=cat("draft_probs", np.float16),
        target_probs_of_draft=cat("target_probs_of_draft", np.float16),
    )
    body = dict(meta, requests=index)
    (directory / META_FILE).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def load_traces(directory: str | Path | None = None) -> TraceSet:
    """Read a trace set (the committed one by default)."""
    from specdec.engine.errors import SpecdecError

    directory = Path(directory) if directory is not None else DEFAULT_TRACES_DIR
    if not (directory / META_FILE).is_file() or not (directory / REQUESTS_FILE).is_file():
        raise SpecdecError(
            f"{str(directory)!r} holds no trace set (needs {META_FILE} and {REQUESTS_FILE}; "
            f"record one with `specdec trace --output-dir DIR`)",
            param="traces",
        )
    meta = json.loads((directory / META_FILE).read_text())
    with np.load(directory / REQUESTS_FILE) as z:
        arrays = {k: z[k] for k in z.files}
    requests = []
    for e in meta.pop("requests"):
        p0, pn = e["prompt_offset"], e["prompt_len"]
        o0, on = e["output_offset"], e["output_len"]
        out = slice(o0, o0 + on)
        requests.append(
            RequestTrace(
                id=e["id"],
                category=e["category"],
                temperature=float(e["temperature"]),
                seed=e["seed"],
                prompt_ids=arrays["prompt_ids"][p0 : p0 + pn],
                tokens=arrays["tokens"][out],
                target_prob=arrays["target_prob"][out].astype(np.float32),
                draft_ids=arrays["draft_ids"][out],
                draft_probs=arrays["draft_probs"][out].astype(np.float32),
                target_probs_of_draft=arrays["target_probs_of_draft"][out].astype(np.float32),
            )
        )
    return TraceSet(requests, meta)


def load_cost_table(source: str | Path) -> dict:
    """The cost-table keys of a trace set's meta.json, its directory, or a file holding just those
    keys: a table measured on another machine or in another format, to price the same traces."""
    from specdec.engine.errors import SpecdecError

    path = Path(source)
    path = path / META_FILE if path.is_dir() else path
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecdecError(
            f"cannot read a cost table from {str(path)!r}: {e}", param="cost_table"
        ) from e
    if not isinstance(meta, dict) or not isinstance(meta.get("cost_table"), dict):
        raise SpecdecError(
            f"{str(path)!r} holds no cost table (a JSON object with a 'cost_table' key; "
            "measure one with `specdec trace --cost-table-only`)",
            param="cost_table",
        )
    out = {k: meta[k] for k in COST_TABLE_KEYS if k in meta}
    out.setdefault("cost_table_machine", meta.get("machine", {}))
    return out


def priced_by(traces: TraceSet, cost_table: dict) -> TraceSet:
    """The same requests with the step costs of ``cost_table`` (``load_cost_table``'s keys)."""
    meta = {k: v for k, v in traces.meta.items() if k not in COST_TABLE_KEYS}
    return TraceSet(traces.requests, dict(meta, **cost_table))
