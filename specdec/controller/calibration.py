"""Start-up calibration: time a few bare target and draft forwards to seed the cost model.

Plain decodes (1 row per sequence) and verifies (1 + k rows per sequence, every k up to k_max)
are timed at a few batch sizes, plus draft forwards of 1-2 rows per sequence and two longer
catch-ups (16 and 64 rows). Each shape runs on temporary sequences whose blocks come from the engine's allocator and
go back to it afterwards (the free count returns to where it started). The keys before
``start_pos`` are whatever the pool holds (zeros at start-up): the numbers are timings, never used
as text. Shapes are measured fewest rows first while a time budget lasts, at least three of each
kind, so a slow machine gets fewer, smaller points and the live fit fills in the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.model_runner import ModelRunner, RunEntry
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from specdec.controller.cost_model import DraftSample, TargetSample

if TYPE_CHECKING:
    from engine.block_allocator import BlockAllocator
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 32  # keys each temporary sequence attends over (a short prompt's worth)


@dataclass
class CalibrationResult:
    target: list[TargetSample] = field(default_factory=list)
    draft: list[DraftSample] = field(default_factory=list)
    seconds: float = 0.0


def _batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return [*sizes, max_num_seqs]


def _target_shapes(sizes: list[int], k_max: int, max_rows: int) -> list[tuple[int, int]]:
    """(sequences, rows each) for every row count a uniform k in 0..k_max gives at these batch
    sizes, fewest rows first so a short budget still covers plain and verify at small batches.

    Every row count, not just plain and k_max: step time need not be smooth in the row count
    (see ``cost_model``), so the points in between are measured rather than interpolated. Where
    several shapes share a row count the one with the most sequences is kept: it is the plain step
    when there is one, which the controller compares every speculating choice against.
    """
    by_rows: dict[int, tuple[int, int]] = {}
    for s in sizes:
        for r in range(1, k_max + 2):
            n = s * r
            if n <= max_rows and s > by_rows.get(n, (0, 0))[0]:
                by_rows[n] = (s, r)
    return [by_rows[n] for n in sorted(by_rows)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_run(
    runner: ModelRunner,
    entries: list[RunEntry],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Fastest of ``repeats`` forwards (results synchronised before the clock stops).

    The minimum, not the mean: other work on the machine only ever adds time, and what the live
    steps add on top of a bare forward is fitted separately (the calibration offset).
    """
    times = []
    for _ in range(repeats):
        _sync(runner.device)
        t0 = clock()
        runner.run(entries)
        _sync(runner.device)
        times.append(clock() - t0)
    return min(times)


class _TempSeqs:
    """Temporary sequences holding blocks for ``context + rows`` slots each; freed on exit."""

    def __init__(
        self,
        allocator: BlockAllocator,
        num_seqs: int,
        rows: int,
        vocab: int,
        context: int = CONTEXT_TOKENS,
        exact_context: bool = False,
    ) -> None:
        self.allocator = allocator
        self.seqs: list[Sequence] = []
        per_seq = allocator.blocks_needed(context + rows)
        self.context = context
        if per_seq * num_seqs > allocator.num_free_blocks and not exact_context:
            self.context = 0  # a small pool: drop the context before giving up on the shape
            per_seq = allocator.blocks_needed(rows)
        self.fits = per_seq * num_seqs <= allocator.num_free_blocks
        self.num_seqs, self.rows, self.vocab = num_seqs, rows, vocab

    def __enter__(self) -> _TempSeqs:
        if not self.fits:
            return self
        for i in range(self.num_seqs):
            prompt = [(7 * i + j) % self.vocab for j in range(max(1, self.context))]
            seq = Sequence(-1 - i, f"calibration-{i}", prompt, SamplingParams(), "off")
            self.allocator.allocate(seq, self.context + self.rows)
            self.seqs.append(seq)
        return self

    def __exit__(self, *exc: object) -> None:
        for seq in self.seqs:
            self.allocator.free(seq)
        self.seqs.clear()

    def entries(self, num_logits: int) -> list[RunEntry]:
        return [
            RunEntry(
                s,
                [(s.seq_id * -3 + r) % self.vocab for r in range(self.rows)],
                self.context,
                num_logits,
            )
            for s in self.seqs
        ]


def time_forward(
    runner: ModelRunner,
    allocator: BlockAllocator,
    num_seqs: int,
    rows: int,
    num_logits: int,
    context: int = CONTEXT_TOKENS,
    repeats: int = 2,
    exact_context: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """Fastest of ``repeats`` forwards of ``num_seqs`` temporary sequences, each feeding ``rows``
    tokens after ``context`` keys and keeping ``num_logits`` logits rows; None when the pool cannot
    hold the shape. Without ``exact_context`` a small pool drops the context before giving up."""
    with _TempSeqs(allocator, num_seqs, rows, runner.vocab_size, context, exact_context) as tmp:
        if not tmp.fits:
            return None
        return _timed_run(runner, tmp.entries(num_logits), repeats, clock)


def calibrate(
    engine: LLMEngine, k_max: int, time_budget: float = 30.0, repeats: int = 2
) -> CalibrationResult:
    """Time target (and draft, if the proposer has a model) forwards; see the module docstring.
    Times are read from ``engine.clock`` (wall time unless a replay simulates it)."""
    clock = getattr(engine, "clock", time.perf_counter)
    start = clock()
    result = CalibrationResult()
    cfg = engine.config
    sizes = _batch_sizes(cfg.max_num_seqs)
    target_shapes = _target_shapes(sizes, k_max, cfg.max_num_batched_tokens)
    draft_runner = getattr(engine.proposer, "runner", None)
    draft_shapes: list[tuple[int, int]] = []
    if draft_runner is not None:
        # Plus two catch-ups of one sequence: a draft reading a prompt is compute-bound, and
        # its rows cost several times a decode row (the cost model's draft knee).
        draft_shapes = sorted({(s, r) for s in sizes for r in (1, 2)} | {(1, 16), (1, 64)})

    free_before = engine.allocator.num_free_blocks
    vocab = engine.target_runner.vocab_size
    with _TempSeqs(engine.allocator, 1, 1, vocab) as warm:
        if warm.fits:  # first forwards pay one-off allocations: keep them out of the samples
            engine.target_runner.run(warm.entries(1))
            if draft_runner is not None:
                draft_runner.run(warm.entries(1))

    def measure(runner: ModelRunner, num_seqs: int, rows: int, logits: int) -> float | None:
        return time_forward(
            runner, engine.allocator, num_seqs, rows, logits, repeats=repeats, clock=clock
        )

    _run_shapes(
        target_shapes,
        start,
        time_budget * (0.7 if draft_shapes else 1.0),
        lambda s, r: measure(engine.target_runner, s, r, r),
        lambda s, r, t: result.target.append(TargetSample(s * r, s, t)),
        repeats,
        clock,
    )
    if draft_runner is not None:
        _run_shapes(
            draft_shapes,
            start,
            time_budget,
            lambda s, r: measure(draft_runner, s, r, 1),
            lambda s, r, t: result.draft.append(DraftSample(1, s * r, s, t)),
            repeats,
            clock,
        )
    if engine.allocator.num_free_blocks != free_before:
        raise AssertionError("calibration leaked KV blocks")  # a bug, never expected
    result.seconds = clock() - start
    logger.info(
        "controller calibration: %d target and %d draft shapes timed in %.1f s",
        len(result.target),
        len(result.draft),
        result.seconds,
    )
    return result


MIN_SHAPES = 3  # measured whatever the budget says: one plain, one verify, one more


def _run_shapes(shapes, start, deadline, measure, record, repeats, clock) -> None:
    """Measure shapes in order until the budget would be overrun (after ``MIN_SHAPES``)."""
    last_rows, last_time, done = 0, 0.0, 0
    for s, r in shapes:
        elapsed = clock() - start
        rows = s * r
        predicted = last_time * max(1.0, rows / last_rows) * repeats if last_rows else 0.0
        if done >= MIN_SHAPES and elapsed + predicted > deadline:
            break
        t = measure(s, r)
        if t is None:
            continue
        record(s, r, t)
        last_rows, last_time, done = rows, t, done + 1
