"""The machine's measured step-cost table, and the step times the replay reads from it.

Measured (``measure_cost_table``: each shape's median over shuffled rounds) with the policy's own
calibration timer (``specdec.engine.calibration.time_forward``: fastest of a few bare forwards
over temporary sequences from the engine's allocator):

- ``target``: forwards by (sequences, rows) at a short context, every uniform verify shape up to
  ``MAX_K + 1`` rows per sequence at 1-32 sequences and the token trees' verifies at 2-32 (1 + N
  rows per sequence for N in ``TREE_NODES``; every row's logits kept, as a verify does), plus
  single-sequence prefill chunks (the last row's logits only);
- ``target_context``: a few of those shapes again after 256-4000 context tokens per sequence;
- ``target_prefill_context``: a 512-row prefill chunk after 1024-3500 context tokens;
- ``draft``, ``draft_context``, ``draft_prefill_context``: the same for the draft (1-2 rows per
  sequence, a tree level's 4-8, plus catch-ups);
- ``sampling``: the engine's sampling (warp and draw) over the real vocabulary, by rows, greedy
  (temperature 0) and sampled (temperature 1).

``StepCosts`` prices a forward from the table: piecewise-linear in rows for each measured
sequence count (past a count's last point, plus what the longest curve, one sequence's, adds over
the same rows), linear between sequence counts, plus an attention term linear in the keys each
row attends to (``rows x context``, the slope fitted from the context points by least squares),
with one slope for decode and verify entries (up to ``MAX_K + 1`` rows) and one for prefill
entries (the prefill-context points; the decode slope where a table has none).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

MAX_K = 6
TREE_NODES = (8, 16)  # the replay's tree policies and adaptive_trees draft trees of these sizes
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
PREFILL_ROWS = (16, 32, 64, 128, 256, 512)
CONTEXTS = (256, 1024, 2048, 4000)
PREFILL_CONTEXTS = (1024, 2048, 3500)  # keys before a 512-row prefill chunk
CONTEXT_SHAPES = ((1, 1), (1, MAX_K + 1), (4, 1), (4, MAX_K + 1))  # (sequences, rows each)
DRAFT_CATCH_UP_ROWS = (4, 16, 64, 256, 512)
DRAFT_CONTEXT_SHAPES = ((1, 1), (4, 1), (4, 2))
SAMPLING_ROWS = (1, 4, 16, 64, 224)
SHORT_CONTEXT = 32  # what the calibration timer puts before every shape by default


def cpu_flags_summary() -> str:
    """The vector-unit flags that decide CPU matrix speed (AVX2, AVX-512, bf16, AMX)."""
    from specdec.engine.cpu_features import vector_flags_summary

    return vector_flags_summary()


def measure_cost_table(
    target_engine, draft_engine, repeats: int = 2, rounds: int = 5, seed: int = 0
) -> dict:
    """Time every shape above on two plain engines (the target's and the draft's runner and
    allocator) in ``rounds`` rounds, each visiting all shapes once in a fresh shuffled order, and
    keep each shape's median over the rounds (``seconds``; each round's value, the fastest of
    ``repeats`` back-to-back forwards, in ``rounds``). A slow spell of a shared machine lasts
    seconds: in a fixed order it falls on neighbouring shapes of one pass, which then share its
    luck; shuffled, it falls on shapes at random, and the median drops it. The rounds kept show
    how far a shape's time spreads (``controller_sweep.table_noise`` replays on tables drawn
    from them). Shapes the pool cannot hold are skipped."""
    import random

    jobs = _timing_jobs(target_engine, draft_engine)
    samples: list[list[float]] = [[] for _ in jobs]
    order = list(range(len(jobs)))
    shuffle = random.Random(seed).shuffle
    for engine in (target_engine, draft_engine):  # the first forwards pay one-off allocations
        _time_job(engine, (1, 1), SHORT_CONTEXT, 1)
    for _ in range(rounds):
        shuffle(order)
        for i in order:
            t = _time_job(*jobs[i][1:], repeats)
            if t is not None:
                samples[i].append(t)
    table: dict = {kind: [] for kind, *_ in jobs}
    for (kind, _, (seqs, rows), context, _), times in zip(jobs, samples, strict=True):
        if times:
            row = {"seqs": seqs, "rows": seqs * rows, "context": context}
            table[kind].append(dict(row, seconds=statistics.median(times), rounds=times))
    table["sampling"] = _sampling_times(target_engine, repeats)
    return table


def _timing_jobs(target_engine, draft_engine) -> list[tuple]:
    """(table key, engine, (sequences, rows each), context, logits rows) of every shape timed."""
    from specdec.engine.calibration import draft_grid, verify_grid

    max_rows = target_engine.config.max_num_batched_tokens
    verify_rows = {*range(1, MAX_K + 2), *(1 + n for n in TREE_NODES)}
    grid = verify_grid(BATCH_SIZES, MAX_K, max_rows)
    # Trees over two sequences and more: one sequence's curve is the prompt chunks' (one logits
    # row each), and a tree's 1 + N logits rows among them would price the chunks of nearby rows.
    grid += [(s, 1 + n) for s in BATCH_SIZES[1:] for n in TREE_NODES if s * (1 + n) <= max_rows]
    grid += [(1, r) for r in PREFILL_ROWS if r > MAX_K + 1 and r <= max_rows]
    draft_shapes = draft_grid(BATCH_SIZES, max(TREE_NODES)) + [(1, r) for r in DRAFT_CATCH_UP_ROWS]
    by_kind = [
        ("target", target_engine, grid, (SHORT_CONTEXT,), True),
        ("target_context", target_engine, CONTEXT_SHAPES, CONTEXTS, True),
        # Prefill chunks after a long context: attention there is compute-bound, priced apart.
        ("target_prefill_context", target_engine, [(1, 512)], PREFILL_CONTEXTS, False),
        ("draft", draft_engine, draft_shapes, (SHORT_CONTEXT,), False),
        ("draft_context", draft_engine, DRAFT_CONTEXT_SHAPES, CONTEXTS, False),
        ("draft_prefill_context", draft_engine, [(1, 512)], PREFILL_CONTEXTS, False),
    ]
    return [
        # verify shapes keep every row's logits, prefill chunks and drafts only the last
        (kind, engine, shape, c, shape[1] if logits_all and shape[1] in verify_rows else 1)
        for kind, engine, shapes, contexts, logits_all in by_kind
        for c in contexts
        for shape in shapes
        if c + shape[1] <= engine.target.arch.max_position_embeddings
    ]


def _time_job(engine, shape: tuple[int, int], context: int, logits: int, repeats: int = 1):
    from specdec.engine.calibration import time_forward

    seqs, rows = shape
    return time_forward(
        engine.target_runner, engine.allocator, seqs, rows, logits,
        context=context, repeats=repeats, exact_context=True,
    )  # fmt: skip


def _sampling_times(target_engine, repeats: int) -> list[dict]:
    """The engine's sampling over the real vocabulary by rows: warp, then draw (greedy: the
    argmax), the fastest of a few."""
    import time

    import torch
    from specdec.engine.gpu_sampling import probs_for_rows, sample_from_probs
    from specdec.engine.sampling import RowContext, greedy_picks
    from specdec.engine.sampling_params import SamplingParams

    vocab = target_engine.target_runner.vocab_size
    sampling = []
    for temperature in (0.0, 1.0):
        for rows in SAMPLING_ROWS:
            logits = torch.randn(rows, vocab)
            ctx = [RowContext(SamplingParams(temperature=temperature), [1], [])] * rows
            best = float("inf")
            for _ in range(max(repeats, 3)):
                t0 = time.perf_counter()
                if greedy_picks(logits, ctx) is None:  # greedy rows need their picks only
                    probs = probs_for_rows(logits, ctx)
                    sample_from_probs(probs, [False] * rows, [None] * rows, [0] * rows)
                best = min(best, time.perf_counter() - t0)
            sampling.append({"rows": rows, "temperature": temperature, "seconds": best})
    return sampling


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing), extended by the end segments' slopes."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class _RowsBySeqs:
    """Time of a forward by (rows, sequences) from uniform-shape points at a short context.

    Each sequence count has its own curve over rows, measured to a few rows per sequence (verify
    shapes); the one-sequence curve reaches prompt-sized rows. Past a curve's last point a forward
    costs that point plus what the longest curve adds over the same rows: the weights are read
    once whatever the sequences, so rows past a handful cost what they cost one sequence's prompt
    (a 512-row forward over 8 or 16 sequences measured within 10% of one sequence's). Extending
    a few-row curve by its own end slope would carry the steep cost of the first rows (a kernel
    doing per-row work) out to hundreds, pricing a catch-up read or a prompt chunk beside decodes
    2-3 times too high."""

    def __init__(self, points: list[dict]) -> None:
        by_seqs: dict[int, dict[int, float]] = {}
        for p in points:
            by_seqs.setdefault(p["seqs"], {})[p["rows"]] = p["seconds"]
        if not by_seqs:
            raise ValueError("the cost table has no points")
        self.seqs = sorted(by_seqs)
        self.curves = [
            (sorted(by_seqs[s]), [by_seqs[s][r] for r in sorted(by_seqs[s])]) for s in self.seqs
        ]
        self.longest = max(self.curves, key=lambda c: c[0][-1])

    def _on_curve(self, i: int, rows: int) -> float:
        xs, ys = self.curves[i]
        if rows <= xs[-1] or self.longest[0][-1] <= xs[-1]:
            return _interp(xs, ys, rows)
        return ys[-1] + max(0.0, _interp(*self.longest, rows) - _interp(*self.longest, xs[-1]))

    def __call__(self, rows: int, seqs: int) -> float:
        i = bisect.bisect_left(self.seqs, seqs)
        if i < len(self.seqs) and self.seqs[i] == seqs:
            return self._on_curve(i, rows)
        i = min(max(i, 1), len(self.seqs) - 1)
        lo, hi = self.seqs[i - 1], self.seqs[i]
        t_lo, t_hi = self._on_curve(i - 1, rows), self._on_curve(i, rows)
        return max(0.0, t_lo + (t_hi - t_lo) * (seqs - lo) / (hi - lo))


def _attention_slope(base: _RowsBySeqs, points: list[dict]) -> float:
    """Seconds per (row x context token), least squares through the origin on the context points'
    excess over the short-context price of the same shape."""
    num = den = 0.0
    for p in points:
        x = p["rows"] * (p["context"] - SHORT_CONTEXT)
        y = p["seconds"] - base(p["rows"], p["seqs"])
        num += x * y
        den += x * x
    return max(0.0, num / den) if den else 0.0


class StepCosts:
    """Seconds of a target or draft forward, priced from a measured cost table."""

    def __init__(self, table: dict) -> None:
        self.target = _RowsBySeqs(table["target"])
        self.draft = _RowsBySeqs(table["draft"])
        self.target_attention = _attention_slope(self.target, table.get("target_context", []))
        self.draft_attention = _attention_slope(self.draft, table.get("draft_context", []))
        prefill = table.get("target_prefill_context")
        self.target_prefill_attention = (
            _attention_slope(self.target, prefill) if prefill else self.target_attention
        )
        prefill = table.get("draft_prefill_context")
        self.draft_prefill_attention = (
            _attention_slope(self.draft, prefill) if prefill else self.draft_attention
        )
        self._sampling: dict[float, tuple[list[int], list[float]]] = {}
        for temperature in (0.0, 1.0):
            points = sorted(
                (p["rows"], p["seconds"])
                for p in table.get("sampling", [])
                if p.get("temperature", 1.0) == temperature
            )
            if points:
                self._sampling[temperature] = ([r for r, _ in points], [t for _, t in points])

    @staticmethod
    def attended(entries: Sequence[tuple[int, int]], prefill: bool) -> float:
        """Keys attended beyond the short context, summed over the rows of the decode/verify
        entries (or of the prefill entries, more than ``MAX_K + 1`` rows): (rows, start position)
        each; a row at position i attends i + 1 keys."""
        return sum(
            n * max(0.0, start + (n + 1) / 2 - SHORT_CONTEXT)
            for n, start in entries
            if (n > MAX_K + 1) == prefill
        )

    def target_seconds(
        self, entries: Sequence[tuple[int, int]], greedy_rows: int = 0, sampled_rows: int = 0
    ) -> float:
        """A target forward over ``entries`` ((rows, start position) each) and the sampling of
        its ``greedy_rows`` (temperature 0) and ``sampled_rows`` (temperature 1) logits rows."""
        rows = sum(n for n, _ in entries)
        t = self.target(rows, len(entries))
        t += self.target_attention * self.attended(entries, prefill=False)
        t += self.target_prefill_attention * self.attended(entries, prefill=True)
        return t + self.sampling_seconds(greedy_rows, 0.0) + self.sampling_seconds(sampled_rows)

    def draft_seconds(self, entries: Sequence[tuple[int, int]]) -> float:
        rows = sum(n for n, _ in entries)
        t = self.draft(rows, len(entries))
        t += self.draft_attention * self.attended(entries, prefill=False)
        return t + self.draft_prefill_attention * self.attended(entries, prefill=True)

    def sampling_seconds(self, rows: int, temperature: float = 1.0) -> float:
        # A table with one curve prices both kinds of rows by it.
        curve = self._sampling.get(0.0 if temperature == 0 else 1.0) or next(
            iter(self._sampling.values()), None
        )
        if rows <= 0 or curve is None:
            return 0.0
        return _interp(*curve, rows)
