"""The machine's step-cost table: bare target and draft forwards timed by shape, cached per machine.

Plain decodes (one row per sequence) and uniform verifies (1 + k rows per sequence) are timed at
batch sizes 1, 2, 4, ... up to ``max_num_seqs``, fewest rows first while the time budget lasts,
plus decodes over a long context (so the fit can tell attention from weights) and, for a draft
model, its 1- and 2-row forwards and one-sequence catch-ups up to the step budget. With token
trees of up to N nodes, verifies run up to 1 + N rows per sequence and a tree's draft levels
several rows per sequence, far past a chain's shapes, so those are timed too: a fit of chain
shapes alone would extrapolate to them, and a forward's cost is not linear in its rows that far
(bf16 products change kernel past 32 rows). Each shape runs on temporary sequences whose blocks come from the allocator and go back
to it (the free count returns to where it started); the keys before the timed rows are whatever
the pool holds: the numbers are timings, never text.

A table is keyed by what sets the timings (processor or GPU model, dtype, threads, the model
pair, the spec and the plan of shapes it makes) and cached under ``$SPECDEC_HOME/calibration/``,
so a restart on the same machine reads it instead of spending the budget again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.model_runner import ModelRunner, RunEntry
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence
from specdec.engine.weights.cache import specdec_home

from specdec.controller.step_cost import ForwardShape, StepCostModel

logger = logging.getLogger(__name__)

CALIBRATION_SECONDS = 30.0  # every plain and verify shape up to 16 x 7 rows on a 2-core CPU
SHORT_CONTEXT = 32  # keys each temporary sequence attends over in most shapes
LONG_CONTEXT = 1024  # the long-context shapes: attention's share of a step shows here
MIN_SHAPES = 3  # measured whatever the budget says: one plain, one verify, one more
STEADY_RATIO = 1.5  # a one-row forward re-timed within this factor: the table's machine is this one
STEADY_SLACK = 5e-3  # seconds of timer jitter: a 1 ms forward's ratio would read it as a change
FORMAT_VERSION = 1
Clock = Callable[[], float]


@dataclass(frozen=True)
class CostSample:
    model: str  # "target" or "draft"
    rows: int
    seqs: int
    attended: int
    seconds: float


@dataclass
class CostTable:
    machine: dict
    samples: list[CostSample] = field(default_factory=list)
    seconds: float = 0.0  # time the measurement took

    def seed(self, cost: StepCostModel) -> None:
        """Give the samples to a cost model as its calibration."""
        for model, forward_cost in (("target", cost.target), ("draft", cost.draft)):
            forward_cost.seed(
                [
                    ([ForwardShape(s.rows, s.seqs, s.attended)], s.seconds)
                    for s in self.samples
                    if s.model == model
                ]
            )

    def to_json(self) -> dict:
        return {
            "version": FORMAT_VERSION,
            "machine": self.machine,
            "seconds": self.seconds,
            "samples": [asdict(s) for s in self.samples],
        }

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"cost table format {data.get('version')!r} is not {FORMAT_VERSION}")
        return cls(data["machine"], [CostSample(**s) for s in data["samples"]], data["seconds"])


def machine_description(device: torch.device, dtype: torch.dtype, models: list[str]) -> dict:
    """What sets a forward's time besides its shape."""
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {
        "processor": processor,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # A release can change the kernels (and so every timing) on the same machine; so can an
        # edit in a source tree, whose version does not move.
        "specdec": _package_version(),
        "forward_code": forward_code_digest(),
        "models": models,
    }


_ENGINE_DIR = Path(__file__).resolve().parent
# Every sampled row of a timed step runs these.
_SAMPLING_SOURCES = ("sampling.py", "gpu_sampling.py", "noise.py", "noise_stream.c")


def forward_code_digest(root: Path = _ENGINE_DIR) -> str:
    """sha256 of the sources under ``root`` (the engine) that compute a forward and its sampling:
    the model layers, the weight formats, the attention backends and the sampler with its noise.
    Timings measured with other code are not this code's."""
    digest = hashlib.sha256()
    sources = [
        path
        for folder in ("models", "attention")
        for kind in ("*.py", "*.c", "*.h")
        for path in (root / folder).glob(kind)
    ]
    sources += [root / name for name in _SAMPLING_SOURCES if (root / name).exists()]
    for path in sorted(sources):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "source"


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class CalibrationSpec:
    """What to measure: the batch sizes up to ``max_num_seqs``, verifies up to ``k_max`` drafts,
    no forward over ``max_rows`` rows nor context over ``max_context`` tokens, within
    ``budget_seconds``."""

    max_num_seqs: int
    k_max: int
    max_rows: int
    max_context: int = LONG_CONTEXT + 1
    budget_seconds: float = 30.0
    repeats: int = 2
    tree_nodes: int = 0  # token trees of up to this many nodes: their verifies and draft levels


def cached_or_measured(
    target: ModelRunner,
    draft: ModelRunner | None,
    allocator: BlockAllocator,
    spec: CalibrationSpec,
    machine: dict,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> CostTable:
    """The cached table for this machine and spec, or a fresh measurement stored for next time."""
    # The plan joins the key: a change to the shapes timed (the code, not only the spec) makes
    # a table of other shapes, which a fit would extrapolate where the new plan measures.
    plan = calibration_plan(spec, draft is not None)
    key_parts = {"machine": machine, "spec": asdict(spec), "plan": asdict(plan)}
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:24]
    path = (cache_dir or specdec_home() / "calibration") / f"{key}.json"
    if path.is_file():
        try:
            table = CostTable.from_json(json.loads(path.read_text()))
            if _steady(table, target, draft, allocator, clock):
                logger.info("step-cost table read from %s", path)
                return table
            logger.warning("step-cost table %s was timed on a busier or other machine", path)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            logger.warning("ignoring unreadable step-cost table %s: %s", path, exc)
    table = measure(target, draft, allocator, spec, machine, clock)
    if not _steady(table, target, draft, allocator, clock):
        logger.warning("the machine's speed changed during calibration: table not cached")
        return table
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1))
    tmp.replace(path)
    return table


def _steady(
    table: CostTable,
    target: ModelRunner,
    draft: ModelRunner | None,
    allocator: BlockAllocator,
    clock: Clock,
) -> bool:
    """Whether a one-row forward of each model, timed now, takes what ``table`` says within
    ``STEADY_RATIO`` (or ``STEADY_SLACK`` seconds). A table timed while other work held the
    machine prices every step wrongly, and a draft priced far above its cost is never run, so no
    live step ever corrects it: such a table is measured again rather than kept."""
    for name, runner in (("target", target), ("draft", draft)):
        one_row = (name, 1, 1, 1 + SHORT_CONTEXT)
        recorded = next(
            (s.seconds for s in table.samples if (s.model, s.rows, s.seqs, s.attended) == one_row),
            None,
        )
        if runner is None or recorded is None:
            continue
        # Fastest of three: on a fresh engine the first forward pays one-off allocations.
        now = time_forward(runner, allocator, 1, 1, 1, repeats=3, clock=clock)
        if now is None or abs(now - recorded) <= STEADY_SLACK:
            continue
        if max(now / recorded, recorded / now) > STEADY_RATIO:
            logger.info("%s one-row forward: %.4f s in the table, %.4f s now", name, recorded, now)
            return False
    return True


def measure(
    target: ModelRunner,
    draft: ModelRunner | None,
    allocator: BlockAllocator,
    spec: CalibrationSpec,
    machine: dict,
    clock: Clock = time.perf_counter,
) -> CostTable:
    """Time bare forwards of every shape in the module docstring, within the budget, on
    ``clock`` (wall time unless a replay simulates it)."""
    start = clock()
    table = CostTable(machine)
    free_before = allocator.num_free_blocks
    vocab = target.vocab_size
    with _TempSeqs(allocator, 1, 1, SHORT_CONTEXT, vocab) as warm:
        if warm.fits:  # first forwards pay one-off allocations: keep them out of the samples
            target.run(warm.entries(1))
            if draft is not None:
                draft.run(warm.entries(1))

    def timed(runner: ModelRunner, name: str, seqs: int, rows: int, context: int, logits: int):
        with _TempSeqs(allocator, seqs, rows, context, vocab) as tmp:
            if not tmp.fits:
                return None
            seconds = _fastest(runner, tmp.entries(logits), spec.repeats, clock)
            attended = seqs * rows * (tmp.context + rows)
            table.samples.append(CostSample(name, seqs * rows, seqs, attended, seconds))
            return seconds

    plan = calibration_plan(spec, draft is not None)
    budget_target = spec.budget_seconds * (0.7 if draft is not None else 1.0)
    _run_in_budget(
        plan.target,
        start,
        budget_target,
        lambda s, r, c: timed(target, "target", s, r, c, r),
        clock,
    )
    if draft is not None:
        _run_in_budget(
            plan.draft,
            start,
            spec.budget_seconds,
            lambda s, r, c: timed(draft, "draft", s, r, c, 1),
            clock,
        )
    if allocator.num_free_blocks != free_before:
        raise AssertionError("calibration leaked KV blocks")  # a bug, never expected
    table.seconds = clock() - start
    logger.info("step-cost table: %d shapes timed in %.1f s", len(table.samples), table.seconds)
    return table


Shape = tuple[int, int, int]  # (sequences, rows each, context)


@dataclass(frozen=True)
class CalibrationPlan:
    """The shapes a calibration times, in order, while its budget lasts."""

    target: list[Shape]
    draft: list[Shape]


def calibration_plan(spec: CalibrationSpec, with_draft: bool) -> CalibrationPlan:
    sizes = _batch_sizes(spec.max_num_seqs)
    target = _verify_shapes(sizes, spec.k_max, spec.max_rows)
    # Long-context decodes at the smallest and largest batch: attention against weights.
    long_context = min(LONG_CONTEXT, spec.max_context - 1)
    target += [(1, 1, long_context), (sizes[-1], 1, long_context)]
    # Tree verifies after every chain's shape, so that a budget that runs out costs the fit the
    # rarer shapes, not the chains' or the attention term's.
    trees = _verify_shapes(sizes, max(spec.k_max, spec.tree_nodes), spec.max_rows)
    target += [shape for shape in trees if shape not in target]
    if not with_draft:
        return CalibrationPlan(target, [])
    # Draft forwards of 1-2 rows per sequence, and catch-ups of one sequence up to the step's
    # budget: a draft reading a prompt is compute-bound, its rows several times a decode row's
    # price, and past a few dozen rows not linear in them.
    draft = sorted({(s, r, SHORT_CONTEXT) for s, r in draft_grid(sizes)})
    draft += [(1, r, SHORT_CONTEXT) for r in catch_up_rows(spec.max_rows)]
    levels = sorted({(s, r, SHORT_CONTEXT) for s, r in draft_grid(sizes, spec.tree_nodes)})
    draft += [shape for shape in levels if shape not in draft]
    return CalibrationPlan(target, draft)


def _batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return [*sizes, max_num_seqs]


# Rows a draft forward feeds per sequence: one drafted token, or two after a verify (the bonus
# token and the last accepted draft).
DRAFT_ROWS_PER_SEQUENCE = (1, 2)


def verify_grid(sizes: Iterable[int], k_max: int, max_rows: int) -> list[tuple[int, int]]:
    """(sequences, rows each) of every uniform step, k in 0..k_max drafts per sequence at these
    batch sizes, that fits in ``max_rows``."""
    return [(s, r) for s in sizes for r in range(1, k_max + 2) if s * r <= max_rows]


def draft_grid(sizes: Iterable[int], tree_nodes: int = 0) -> list[tuple[int, int]]:
    """(sequences, rows each) of the draft forwards a step runs at these batch sizes: a chain's
    one or two rows per sequence and, with trees of ``tree_nodes`` nodes, a level's rows: powers
    of two up to half the nodes (a dynamic tree's widest level; the fit interpolates between)."""
    rows = list(DRAFT_ROWS_PER_SEQUENCE)
    while rows[-1] * 2 <= tree_nodes // 2:
        rows.append(rows[-1] * 2)
    return [(s, r) for s in sizes for r in rows]


def catch_up_rows(max_rows: int) -> list[int]:
    """Rows of the draft's one-sequence catch-up reads timed: 16, 64, 256, ... and the budget."""
    rows = [r for r in (4**i for i in range(2, 12)) if r < max_rows]
    return [*rows, max_rows]


def _verify_shapes(sizes: list[int], k_max: int, max_rows: int) -> list[Shape]:
    """(sequences, rows each, context) for every row count of the verify grid, fewest rows
    first; where several share a row count, the most sequences (the plain step when there is
    one, which every speculating choice is weighed against)."""
    by_rows: dict[int, tuple[int, int]] = {}
    for s, r in verify_grid(sizes, k_max, max_rows):
        if s > by_rows.get(s * r, (0, 0))[0]:
            by_rows[s * r] = (s, r)
    return [(*by_rows[n], SHORT_CONTEXT) for n in sorted(by_rows)]


def _run_in_budget(
    shapes: list[Shape],
    start: float,
    deadline: float,
    measure_one: Callable[[int, int, int], float | None],
    clock: Clock,
) -> None:
    """Measure shapes in order until the next one would overrun the budget (after
    ``MIN_SHAPES``), predicting its time from the last one's by rows."""
    last_rows, last_time, done = 0, 0.0, 0
    for s, r, c in shapes:
        rows = s * r
        predicted = last_time * max(1.0, rows / last_rows) if last_rows else 0.0
        if done >= MIN_SHAPES and clock() - start + predicted > deadline:
            break
        t = measure_one(s, r, c)
        if t is not None:
            last_rows, last_time, done = rows, t, done + 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(
    runner: ModelRunner,
    allocator: BlockAllocator,
    num_seqs: int,
    rows: int,
    num_logits: int,
    context: int = SHORT_CONTEXT,
    repeats: int = 2,
    exact_context: bool = False,
    clock: Clock = time.perf_counter,
) -> float | None:
    """Fastest of ``repeats`` forwards of ``num_seqs`` temporary sequences, each feeding ``rows``
    tokens after ``context`` keys and keeping ``num_logits`` logits rows; None when the pool
    cannot hold the shape. Without ``exact_context`` a small pool drops the context first."""
    with _TempSeqs(allocator, num_seqs, rows, context, runner.vocab_size, exact_context) as tmp:
        if not tmp.fits:
            return None
        return _fastest(runner, tmp.entries(num_logits), repeats, clock)


def _fastest(runner: ModelRunner, entries: list[RunEntry], repeats: int, clock: Clock) -> float:
    """Fastest of ``repeats`` forwards: other work on a machine only ever adds time, and what a
    live step adds to a bare forward the live fit learns."""
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
        context: int,
        vocab: int,
        exact_context: bool = False,
    ) -> None:
        self.allocator = allocator
        self.seqs: list[Sequence] = []
        self.context = context
        per_seq = allocator.blocks_needed(context + rows)
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
