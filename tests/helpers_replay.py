"""Synthetic trace sets for replay tests: hand-made acceptance patterns and a linear cost table."""

from __future__ import annotations

import numpy as np
from specdec.evals.traces import TOP_K, RequestTrace, TraceSet


def synthetic_trace(
    rid: str,
    category: str,
    temperature: float,
    matches: list[bool],
    prompt_len: int = 20,
    overlap: float = 0.6,
) -> RequestTrace:
    """A request whose draft top-1 equals the target's token exactly where ``matches`` says;
    at temperature 1 the draft's top tokens overlap the target's by ``overlap`` per position."""
    n = len(matches)
    tokens = np.arange(100, 100 + n, dtype=np.int32)
    draft_ids = np.zeros((n, TOP_K), np.int32)
    for j in range(n):
        draft_ids[j] = 5000 + 10 * j + np.arange(TOP_K)
        if matches[j]:
            draft_ids[j, 0] = tokens[j]
    draft_probs = np.full((n, TOP_K), 0.5 / (TOP_K - 1), np.float32)
    draft_probs[:, 0] = 0.5
    p_of_draft = np.zeros((n, TOP_K), np.float32)
    p_of_draft[:, 0] = overlap if temperature > 0 else 0.9
    return RequestTrace(
        id=rid,
        category=category,
        temperature=temperature,
        seed=None if temperature == 0 else 1,
        prompt_ids=np.arange(7, 7 + prompt_len, dtype=np.int32) + 3 * len(rid),
        tokens=tokens,
        target_prob=np.full(n, 0.9, np.float32),
        draft_ids=draft_ids,
        draft_probs=draft_probs,
        target_probs_of_draft=p_of_draft,
    )


def linear_cost_table() -> dict:
    """A target whose step costs 50 ms + 2 ms a row + 1 ms a sequence, a draft at 8 ms + 1 ms a
    row; attention adds 1 us per row per 1000 context tokens; sampling 0.1 ms a row."""

    def target(s: int, r: int, ctx: int) -> float:
        return 0.05 + 0.002 * r + 0.001 * s + 1e-9 * r * (ctx - 32)

    def draft(s: int, r: int, ctx: int) -> float:
        return 0.008 + 0.001 * r + 1e-10 * r * (ctx - 32)

    def points(fn, shapes, ctxs) -> list[dict]:
        return [
            {"seqs": s, "rows": s * r, "context": c, "seconds": fn(s, s * r, c)}
            for c in ctxs
            for s, r in shapes
        ]

    grid = [(s, r) for s in (1, 2, 4, 8, 16, 32) for r in range(1, 8)] + [(1, 64), (1, 512)]
    dgrid = [(s, r) for s in (1, 2, 4, 8, 16, 32) for r in (1, 2)] + [(1, 64), (1, 512)]
    return {
        "target": points(target, grid, [32]),
        "target_context": points(target, [(1, 1), (4, 7)], [1024, 4000]),
        "draft": points(draft, dgrid, [32]),
        "draft_context": points(draft, [(1, 1), (4, 1)], [1024, 4000]),
        "sampling": [{"rows": r, "seconds": 1e-4 * r} for r in (1, 16, 224)],
    }


def synthetic_trace_set(n_out: int = 24) -> TraceSet:
    """Two code requests at temperature 0 and two open requests at temperature 1."""
    rng = np.random.default_rng(0)
    requests = []
    for i, (cat, temp) in enumerate(
        [
            ("code_generation", 0.0),
            ("code_editing", 0.0),
            ("multi_turn_chat", 1.0),
            ("translation", 1.0),
        ]
    ):
        matches = list(rng.random(n_out) < (0.8 if temp == 0 else 0.5))
        requests.append(synthetic_trace(f"r{i}@t{temp:g}", cat, temp, matches, 20 + 5 * i))
    meta = {
        "cost_table": linear_cost_table(),
        "engine": {
            "num_kv_blocks": 2048,
            "page_size": 16,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 512,
        },
    }
    return TraceSet(requests, meta)
