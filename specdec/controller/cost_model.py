"""Online step-cost model: how long a step takes for a given batch shape, fitted from measurements.

Target part (everything in a step except draft forwards, so sampling and bookkeeping included)::

    T(n, s) = base + per_seq * s + slope_low * min(n, knee) + slope_high * max(0, n - knee)

with ``n`` the rows in the target forward (prefill chunks + decodes + verify rows) and ``s`` the
sequences in it. The knee is where batched rows stop being almost free: on a GPU the forward is
bound by reading the weights until the matrix products fill the device, so ``slope_low`` is tiny
and ``slope_high`` is not; on a CPU the knee sits where the linear-layer kernel turns compute-bound,
at a much smaller ``n``. Which knee fits is chosen from a grid by weighted squared error.

Draft part: a step runs one draft forward per drafted position, each costing::

    D(rows, seqs) = per_forward + per_seq * seqs
                    + per_row * min(rows, knee) + per_row_above_knee * max(0, rows - knee)

(rows > seqs only in the first forward, which catches the draft up on unseen tokens). The knee is
the target's, for the same reason: a draft forward of a few rows reads the weights, one that
catches up on a prompt (hundreds of rows) is compute-bound, and on a two-core CPU such a row cost
the 0.5B draft about ten times a decode row. A line through the many small forwards priced a
four-sequence catch-up of 241 rows at 0.37 s; it ran 1.6 s. The knee is chosen from the grid as
for the target; calibration times one catch-up-sized forward so that it is known from the start.
A step's draft price is the fit times the median measured / fitted ratio of recent live draft
steps with about as many rows (within a factor of two), where that ratio is off 1 by more than
the tolerance below and rests on ``min_measured`` steps within the last ``stale_after``.

Fitting is weighted least squares of *relative* errors (timing noise is multiplicative, and a
short decode step matters as much as a long prefill step) over a window of recent steps, weights
decaying with age, one Huber re-weighting pass against outliers (a shared machine has them),
non-negative coefficients,
and a weak ridge pull towards the prior coefficients so collinear features (rows and seqs move
together when every sequence drafts alike) stay at sensible values. Calibration samples stay in
the fit as anchors with an indicator column of their own, which absorbs the bookkeeping that a bare
forward does not pay, so anchors pin the slopes where live steps have not reached yet without
biasing the intercept.

Measured curve on top: the parametric form is smooth, but a real step time need not be. On a CPU
the linear-layer kernels pick their blocking by row count, so 4 rows can run faster than 1 and 8
slower than 6 (seen with oneDNN on two cores: 1 row 290 ms, 4 rows 185 ms, 8 rows 270 ms). So the
model also keeps, per exact row count, the median of its last few live steps (or, before any live
step, the calibration forward plus the fitted live-vs-bare offset). Only steps of the last
``stale_after`` observations count: a point with none that recent expires and the earlier estimate
returns, so neither one stalled step nor a slow spell of a shared machine (at code c=1, five steps
measured at three times their price while another job ran priced drafts of 3 and 4 out for the
rest of the run) can price a row count out for good; and where ``min_measured`` of its steps are
from the last ``refresh_after`` observations only those count, so a shape measured during a slow
spell and then avoided is priced afresh once the controller's shape probes re-measure it (at code
c=2, four-draft steps measured at 215 ms of draft while the machine was slow were priced there
for two rounds in which the fixed arm ran them at 160); a fresh step well under its point's or
shape's older steps counts alone at once, since other work on a machine only ever adds time. A
point resting on fewer than three steps is also left out at once where it is over ``stall_ratio``
times the price the row count had without them. Where a point is off the parametric fit by more
than its tolerance, the model predicts from the points: exactly at a measured count, linearly between two, and beyond the largest by the
parametric fit's increase. A point is shifted by the fit's per-sequence
slope when asked about another sequence count than it was measured at.
The parametric fit alone answers only where no step of any size was measured yet.

Machine speed: a shared machine runs in spells (on two cores, the same four-draft step took 255 ms
for a while, then 340 ms, then 255 again), and a spell slows every shape alike. The controller
runs a few shapes and prices the others from when they last ran, so in a slow spell the shape it
runs looks dearer than shapes last measured in a fast one, and it leaves its best shape for one
that is not better (at code c=1, four-draft steps measured at 340 ms in a slow spell, 255 before
it, sent it to three and one drafts priced before the spell, which then ran slow too). So every
step is also compared with the median of its own shape's kept steps of the last ``stale_after``
observations: the median of the last ``speed_window`` such ratios is the machine's
``speed_index`` (1 unless it is more than ``speed_deadband`` over 1: never under 1, since other
work only ever adds time), and every live step is stored divided by it. Prices are then at the
reference speed (that of calibration and the first live steps) whatever spell each shape was
measured in; every price of one decision shares the unit, so decisions do not depend on it. A
shape's first live steps have no history to compare with and move no index: a shape that runs
dearer than calibrated is repriced, not taken for a spell.

Exact shapes first: a (rows, sequences) shape with ``min_measured`` live steps within the last
``stale_after`` observations is priced at the median of those where the curve is off that by more
than its tolerance.

The tolerance is ``curve_tolerance`` for a median of ``min_measured`` steps and shrinks as
1 / sqrt(steps) (up to ``measured_window`` of them): a median of few steps is noisy and the fit,
pooling every step, is the better estimate; but the fit's error at one shape is bias, which more
steps do not average away, so a median of many steps a few percent off it is believed. Where
eight or more steps agree closely, their spread gives the median's own standard error, and a
median three of those off the fit is believed too (down to 2%).
The per-row point mixes shapes (16 rows are 16 plain decodes or 8 sequences verifying one draft
each; on a two-core CPU the first measured 540 ms and the second 600 ms, and the shift by the
fit's per-sequence slope priced the plain step at 650 ms), and a decision between exactly those
two shapes is the one the controller makes every step.
"""

from __future__ import annotations

import bisect
import copy
import functools
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np


def _counted(
    steps: Sequence[tuple],
    at: int,
    now: int,
    stale_after: int,
    fresh_after: int,
    enough: int,
    faster_by: float | None = None,
) -> Sequence[tuple]:
    """The steps (oldest first, observation number at index ``at``) that count at observation
    ``now``: those of the last ``fresh_after`` observations where there are ``enough`` of them,
    else those of the last ``stale_after``. Older steps speak for the machine as it was: a shape
    measured during a slow spell and then avoided for its price is re-measured by a shape probe,
    and once enough fresh steps agree the spell's steps no longer outvote them in the median.

    With ``faster_by`` (steps holding their seconds at index 0), fewer fresh steps than
    ``enough`` count alone too where every one of them ran more than that share faster than the
    median of the older ones: other work on a shared machine only ever adds time, so a step
    well under its old price says the old steps were slowed, not that it was lucky (open
    prompts at four sequences: plain priced at 184 ms from a slow round, one cost probe ran at
    138, and speculation went on for the rest of the round on the old price).
    Returned as is when all of them count (the usual case: no copy)."""
    if not steps:
        return steps
    fresh = now - min(fresh_after, stale_after)
    num_fresh = 0
    for step in reversed(steps):
        if step[at] < fresh:
            break
        num_fresh += 1
    oldest = fresh if num_fresh >= enough else now - stale_after
    if faster_by is not None and 0 < num_fresh < enough and num_fresh < len(steps):
        steps = list(steps)
        older = [s[0] for s in steps[:-num_fresh] if s[at] >= oldest]
        newest_slowest = max(s[0] for s in steps[-num_fresh:])
        if older and newest_slowest < (1.0 - faster_by) * statistics.median(older):
            oldest = fresh
    if steps[0][at] >= oldest:
        return steps
    return [s for s in steps if s[at] >= oldest]


# Steps a point or shape needs before the spread of its steps may narrow its tolerance: the
# median absolute deviation of fewer is itself too noisy (of three steps it is often ~0).
NOISE_MIN_STEPS = 8


def _median_spread(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and their median absolute deviation over it."""
    median = statistics.median(values)
    if median <= 0:
        return median, 0.0
    return median, statistics.median(abs(v - median) for v in values) / median


# Knees tried when fitting (rows in the target forward). Beyond the data a knee means "linear".
KNEE_GRID = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
_HUBER_K = 2.5  # residuals beyond this many robust sigmas get down-weighted
_MIN_TIME = 1e-6  # seconds: predicted times never go below this


@dataclass(frozen=True)
class TargetCost:
    """Seconds for the non-draft part of a step; see the module docstring."""

    base: float
    per_seq: float
    slope_low: float
    knee: float
    slope_high: float

    def __call__(self, num_tokens: float, num_seqs: float) -> float:
        low = min(num_tokens, self.knee)
        high = max(0.0, num_tokens - self.knee)
        t = self.base + self.per_seq * num_seqs + self.slope_low * low + self.slope_high * high
        return max(t, _MIN_TIME)


@dataclass(frozen=True)
class DraftCost:
    """Seconds for one draft forward over ``rows`` token rows of ``seqs`` sequences; rows beyond
    ``knee`` cost ``per_row_above_knee`` each (the default knee: none, a line)."""

    per_forward: float
    per_row: float
    per_seq: float
    knee: float = math.inf
    per_row_above_knee: float = 0.0

    def __call__(self, rows: float, seqs: float) -> float:
        high = max(0.0, rows - self.knee)
        return (
            self.per_forward
            + self.per_row * min(rows, self.knee)
            + self.per_row_above_knee * high
            + self.per_seq * seqs
        )


class TargetCurve:
    """Target step seconds from measured row counts, the parametric fit filling the gaps.

    ``points`` are (row count, seconds or None, sequences measured) sorted by row count, None where
    the fit already agrees with the measurement; see the module docstring. A measured point holds
    for the sequences it was measured at: at another count the fit's per-sequence slope shifts it
    (32 rows at 16 sequences cost more than 32 rows at 8, and a batch that grows from 8 to 16
    would otherwise price its verify steps at the smaller batch's time).
    """

    def __init__(
        self,
        points: Sequence[tuple[float, float | None, float]],
        parametric: TargetCost,
        shapes: dict[tuple[int, int], float] | None = None,
    ) -> None:
        self.shapes = shapes or {}  # (rows, sequences) -> seconds measured at exactly that shape
        self.rows = [float(n) for n, _, _ in points]
        self.seconds = [t for _, t, _ in points]
        self.seqs = [float(s) for _, _, s in points]
        self.parametric = parametric
        self._lower: dict[tuple[float, float, float], float | None] = {}  # lower_bound's answers

    def with_shapes(self, shapes: dict[tuple[int, int], float]) -> TargetCurve:
        """This curve plus exact shapes (the points are shared: a curve is never changed)."""
        out = copy.copy(self)
        out.shapes, out._lower = shapes or {}, {}
        return out

    def _at(self, i: int, num_seqs: float) -> float:
        t = self.seconds[i]
        if t is None:
            return self.parametric(self.rows[i], num_seqs)
        return t + self.parametric.per_seq * (num_seqs - self.seqs[i])

    def __call__(self, num_tokens: float, num_seqs: float) -> float:
        if self.shapes:
            exact = self.shapes.get((round(num_tokens), round(num_seqs)))
            if (
                exact is not None
                and num_tokens == round(num_tokens)
                and num_seqs == round(num_seqs)
            ):
                return exact
        return self._smooth(num_tokens, num_seqs)

    def lower_bound(self, lo: float, hi: float, num_seqs: float) -> float | None:
        """A lower bound on this curve over rows in [lo, hi] at ``num_seqs`` sequences (None
        where the fit's row slopes are negative).

        Between measured points the curve is linear, below the first and beyond the last it
        follows the fit, non-decreasing with non-negative slopes: so its least value on the
        interval is at an end or a measured point inside. Exact shapes near the interval are
        included whatever their sequence count (a superset only lowers the bound).
        """
        key = (lo, hi, num_seqs)
        if key in self._lower:  # a curve lives while its data does not change: asked each step
            return self._lower[key]
        if len(self._lower) >= 64:
            self._lower.clear()
        fit = self.parametric
        least: float | None = None
        if fit.slope_low >= 0 and fit.slope_high >= 0:
            xs = [lo, hi, *(r for r in self.rows if lo < r < hi)]
            least = min(self._smooth(x, num_seqs) for x in xs)
            for (rows, _), t in self.shapes.items():
                if lo - 1 <= rows <= hi + 1:
                    least = min(least, t)
        self._lower[key] = least
        return least

    def _smooth(self, num_tokens: float, num_seqs: float) -> float:
        """The curve between exact shapes: measured points, the fit between and beyond."""
        rows, fit = self.rows, self.parametric
        if not rows:
            return fit(num_tokens, num_seqs)
        i = bisect.bisect_left(rows, num_tokens)
        if i < len(rows) and rows[i] == num_tokens:
            return self._at(i, num_seqs)
        if i == 0:  # below the smallest measured count: the fit's shape, at the measured level
            t = self._at(0, num_seqs) + fit(num_tokens, num_seqs) - fit(rows[0], num_seqs)
        elif i == len(rows):  # beyond the largest: the fit's increase from there
            last = len(rows) - 1
            t = self._at(last, num_seqs) + max(
                0.0, fit(num_tokens, num_seqs) - fit(rows[last], num_seqs)
            )
        else:
            w = (num_tokens - rows[i - 1]) / (rows[i] - rows[i - 1])
            lo, hi = self._at(i - 1, num_seqs), self._at(i, num_seqs)
            t = lo + w * (hi - lo)
        return max(t, _MIN_TIME)


# Placeholder coefficients used only until calibration or live steps say otherwise: a draft forward
# about a quarter of a target decode, verify rows cheap up to 64 rows. Weak prior, quickly replaced.
DEFAULT_TARGET = TargetCost(base=0.02, per_seq=2e-4, slope_low=2e-4, knee=64, slope_high=2e-3)
DEFAULT_DRAFT = DraftCost(per_forward=5e-3, per_row=1e-4, per_seq=1e-4)


@dataclass
class TargetSample:
    num_tokens: int
    num_seqs: int
    seconds: float
    calibration: bool = False


@dataclass
class DraftSample:
    """One step's draft work (or one calibration forward): forwards and their summed shapes, and
    each forward's (rows, seqs) where known (else the sums split evenly over the forwards)."""

    num_forwards: int
    rows: int
    seqs: int
    seconds: float
    calibration: bool = False
    forwards: tuple[tuple[int, int], ...] = ()

    def each(self) -> tuple[tuple[float, float], ...]:
        if self.forwards:
            return tuple((float(r), float(s)) for r, s in self.forwards)
        f = max(1, self.num_forwards)
        return ((self.rows / f, self.seqs / f),) * f


def _target_features(samples: Sequence[TargetSample], knee: float) -> np.ndarray:
    return _TargetColumns(samples).features(knee)  # [num_samples, 5]


class _TargetColumns:
    """``_target_features`` for many knees: the columns that do not depend on it built once."""

    def __init__(self, samples: Sequence[TargetSample]) -> None:
        self.n = np.array([s.num_tokens for s in samples], dtype=np.float64)
        self.seqs = np.array([s.num_seqs for s in samples], dtype=np.float64)
        self.calibration = np.array([s.calibration for s in samples], dtype=np.float64)

    def features(self, knee: float) -> np.ndarray:
        n = self.n
        return np.column_stack(
            [
                np.ones_like(n),
                self.seqs,
                np.minimum(n, knee),
                np.maximum(0.0, n - knee),
                self.calibration,
            ]
        )  # [num_samples, 5]


def _draft_features(samples: Sequence[DraftSample], knee: float) -> np.ndarray:
    return _DraftColumns(samples).features(knee)  # [num_samples, 5]


def _draft_features_reference(samples: Sequence[DraftSample], knee: float) -> np.ndarray:
    """``_draft_features`` one sample at a time (what ``_DraftColumns`` must reproduce)."""
    f = np.array([s.num_forwards for s in samples], dtype=np.float64)
    low = [sum(min(r, knee) for r, _ in s.each()) for s in samples]
    high = [sum(max(0.0, r - knee) for r, _ in s.each()) for s in samples]
    return np.column_stack(
        [
            f,
            np.array(low, dtype=np.float64),
            np.array(high, dtype=np.float64),
            np.array([s.seqs for s in samples], dtype=np.float64),
            f * np.array([s.calibration for s in samples], dtype=np.float64),
        ]
    )  # [num_samples, 5]


def _forward_rows(sample: DraftSample) -> tuple[float, ...]:
    """Each forward's rows (``each``), kept on the sample: samples are not changed once made."""
    rows = sample.__dict__.get("_forward_rows")
    if rows is None:
        rows = sample.__dict__["_forward_rows"] = tuple(r for r, _ in sample.each())
    return rows


class _DraftColumns:
    """``_draft_features`` for many knees: per-forward rows in one zero-padded matrix, so a knee
    costs two array operations instead of a Python loop over every forward of every sample.

    Exact where every row count and the knee are whole numbers (or the knee infinite), as they
    are for every sample the model makes: the sums are then of integers, exact in any order.
    Otherwise each sample is summed as ``_draft_features_reference`` does.
    """

    def __init__(self, samples: Sequence[DraftSample]) -> None:
        self.samples = samples
        self.f = np.array([s.num_forwards for s in samples], dtype=np.float64)
        self.seqs = np.array([s.seqs for s in samples], dtype=np.float64)
        self.calibration = self.f * np.array([s.calibration for s in samples], dtype=np.float64)
        rows = [_forward_rows(s) for s in samples]
        width = max(map(len, rows), default=0)
        pad = (0.0,) * width
        self.rows = np.array([r + pad[len(r) :] for r in rows], dtype=np.float64).reshape(
            len(rows), width
        )  # [num_samples, most forwards]
        self.whole = bool(np.all(self.rows == np.floor(self.rows)))

    def features(self, knee: float) -> np.ndarray:
        if self.whole and (math.isinf(knee) or float(knee).is_integer()):
            low = np.minimum(self.rows, knee).sum(axis=1)
            high = np.maximum(0.0, self.rows - knee).sum(axis=1)
        else:
            low = np.array([sum(min(r, knee) for r, _ in s.each()) for s in self.samples])
            high = np.array([sum(max(0.0, r - knee) for r, _ in s.each()) for s in self.samples])
        return np.column_stack(
            [self.f, low.astype(np.float64), high.astype(np.float64), self.seqs, self.calibration]
        )  # [num_samples, 5]


def fit_nonneg_ridge(
    x: np.ndarray,  # [m, p] features
    y: np.ndarray,  # [m] seconds
    w: np.ndarray,  # [m] sample weights
    prior: np.ndarray,  # [p] coefficients pulled towards
    ridge: float,
    nonneg: np.ndarray,  # [p] bool: coefficient must be >= 0
) -> tuple[np.ndarray, float]:
    """Minimise sum_i w_i (y_i - x_i.b)^2 + sum_j lam_j (b_j - c prior_j)^2 with b_j >= 0 where asked.

    c is the scalar that best fits the data with the prior's shape (least squares of y on
    x.prior): with little data the fit keeps the prior's shape at the data's level instead of
    piling a mismatch onto whichever coefficients the ridge finds cheapest. lam_j = ridge *
    (weighted mean of x_j^2): ``ridge`` reads as a number of pseudo-observations sitting at the
    prior, whatever the feature's units. Non-negativity by active set: a negative coefficient is
    pinned at 0 and the rest re-solved. Returns (coefficients, weighted SSE).
    """
    p = x.shape[1]
    sw = float(w.sum()) or 1.0
    shape = x @ prior  # [m]
    denom = float((w * shape * shape).sum())
    if denom > 0:
        prior = prior * min(max(float((w * shape * y).sum()) / denom, 1e-3), 1e3)
    xtwx = x.T @ (x * w[:, None])
    xtwy = x.T @ (w * y)
    lam = ridge * np.maximum(np.diag(xtwx) / sw, 1e-12)
    free = np.ones(p, dtype=bool)
    b = np.zeros(p)
    for _ in range(p + 1):
        b = np.zeros(p)
        idx = np.flatnonzero(free)
        a = xtwx[np.ix_(idx, idx)] + np.diag(lam[idx])
        rhs = xtwy[idx] + lam[idx] * prior[idx]
        try:
            b[idx] = np.linalg.solve(a, rhs)
        except np.linalg.LinAlgError:
            b[idx] = np.linalg.lstsq(a, rhs, rcond=None)[0]
        negative = free & nonneg & (b < 0)
        if not negative.any():
            break
        free &= ~negative
    resid = y - x @ b
    return b, float((w * resid * resid).sum())


def _huber_weights(resid: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Down-weight outliers: weight * min(1, k sigma / |r|), sigma from the median |residual|."""
    a = np.abs(resid)
    sigma = 1.4826 * float(np.median(a)) if a.size else 0.0
    if sigma <= 0:
        return w
    return w * np.minimum(1.0, _HUBER_K * sigma / np.maximum(a, 1e-300))


class CostModel:
    """Predicts step time from batch shape; refitted from observed steps every few observations.

    ``observe_target`` / ``observe_draft`` add live samples to a sliding window (newest weight 1,
    older ones decaying by ``decay`` per sample); ``seed`` adds calibration anchors and refits.

    A refit falls due every ``refit_every`` target observations and runs at once, or, with
    ``defer_refits``, when ``refit_if_due`` is next called (predictions in between use the last
    fit): the controller defers them to the window where the device runs the target forward, so
    on a GPU a refit, milliseconds of host time with a knee search, is off the step's critical
    path.
    """

    def __init__(
        self,
        target: TargetCost = DEFAULT_TARGET,
        draft: DraftCost = DEFAULT_DRAFT,
        window: int = 512,
        decay: float = 0.995,
        ridge: float = 0.5,
        anchor_weight: float = 2.0,
        refit_every: int = 8,
        knee_every: int = 64,
        measured_window: int = 16,
        curve_tolerance: float = 0.1,
        noise_tolerance: float = 3.0,
        min_tolerance: float = 0.02,
        max_measured_sizes: int = 256,
        min_measured: int = 3,
        stale_after: int = 256,
        refresh_after: int = 64,
        stall_ratio: float = 2.0,
        track_speed: bool = True,
        speed_window: int = 7,
        speed_deadband: float = 0.1,
    ) -> None:
        self.defer_refits = False
        self._fit_due = False  # refit_every observations since the last fit
        self.target = target
        self.draft = draft
        self.prior_target = target
        self.prior_draft = draft
        self.calibration_offset = 0.0  # fitted: live step minus bare forward, target side
        self.draft_calibration_offset = 0.0
        self.window = window
        self.decay = decay
        self.ridge = ridge
        self.anchor_weight = anchor_weight
        self.refit_every = refit_every
        self.knee_every = knee_every
        self._target_live: deque[TargetSample] = deque(maxlen=window)
        self._draft_live: deque[DraftSample] = deque(maxlen=window)
        self._target_anchors: list[TargetSample] = []
        self._draft_anchors: list[DraftSample] = []
        self.measured_window = measured_window
        self.curve_tolerance = curve_tolerance
        self.noise_tolerance = noise_tolerance
        self.min_tolerance = min_tolerance
        self.max_measured_sizes = max_measured_sizes
        self.min_measured = min_measured
        self.stale_after = stale_after
        self.refresh_after = refresh_after
        self.stall_ratio = stall_ratio
        self.track_speed = track_speed
        self.speed_deadband = speed_deadband
        # The machine's speed against the reference (see the module doc): > 1 in a slow spell.
        self.speed_index = 1.0
        self._speed_ratios: deque[float] = deque(maxlen=speed_window)
        # row count -> newest live steps with that many rows: (seconds, sequences, observation
        # number); dict order is least recently measured first, at most ``max_measured_sizes``
        self._measured: dict[int, deque[tuple[float, int, int]]] = {}
        # (rows, sequences) -> newest live steps of exactly that shape: (seconds, observation
        # number), bounded and ordered the same way
        self._measured_shapes: dict[tuple[int, int], deque[tuple[float, int]]] = {}
        self._curve: TargetCurve | None = None  # built on demand, dropped when data changes
        # draft rows bucket (rows.bit_length()) -> newest live draft steps in it: (sample,
        # observation number); and the measured / fitted factor per bucket, built on demand
        self._draft_measured: dict[int, deque[tuple[DraftSample, int]]] = {}
        self._draft_factors: dict[int, float] = {}
        self._ratio_memo: dict[int, tuple[tuple, float]] = {}  # bucket -> (inputs, median)
        # The observation count the cached factors judge freshness at: pinned by the first ask
        # (or ``pin_draft_factors``) after they were dropped, so that a factor does not depend on
        # which step first asked for it. ``draft_epoch`` counts the drops (callers' memos).
        self._factors_as_of: int | None = None
        self.draft_epoch = 0
        # target_curve's pieces, recomputed only where their inputs changed: row count ->
        # (newest observation, steps counted, per-seq slope, (seconds, sequences, spread)); the
        # anchors' points under (anchor list, offset); shape -> (newest observation, steps
        # counted, (median, spread))
        self._point_memo: dict[int, tuple[int, int, float, tuple[float, float, float]]] = {}
        self._anchor_memo: tuple[object, float, dict[int, tuple[float, float]]] | None = None
        self._shape_memo: dict[tuple[int, int], tuple[int, int, tuple[float, float]]] = {}
        # the last curve: ((fit, anchors, live points as kept), curve without shapes, curve)
        self._curve_memo: tuple[tuple, TargetCurve, TargetCurve] | None = None
        # True: no memo is used (target curve pieces, the draft fit, the feature columns): the
        # reference an equivalence test compares against. Predictions are identical either way.
        self.exact_reference = False
        # Draft samples added (the draft fit's input changes); the last draft fit by its inputs
        self._draft_data = 0
        self._draft_fit_memo: tuple[tuple, tuple[DraftCost, float]] | None = None
        self.num_observations = 0
        self.num_fits = 0
        self._since_fit = 0

    # ---- prediction -------------------------------------------------------------------------
    def refit_if_due(self) -> None:
        """Run the refit that ``refit_every`` observations made due, if any (see the class doc)."""
        if self._fit_due:
            self.refit(search_knee=self.num_fits % max(1, self.knee_every // self.refit_every) == 0)

    def target_time(self, num_tokens: float, num_seqs: float) -> float:
        return self.target_curve()(num_tokens, num_seqs)

    def target_curve(self) -> TargetCurve:
        """The predictor the controller uses: measured points, the parametric fit between."""
        if self._curve is None:
            if self.exact_reference:
                self._point_memo, self._shape_memo, self._anchor_memo = {}, {}, None
                self._curve_memo = None
            fit = self.target
            anchors = self._anchor_points()  # rows -> (seconds, sequences); same dict until changed
            live: dict[int, tuple[float, float]] = {}
            memo, per_seq = self._point_memo, fit.per_seq
            now = self.num_observations
            oldest_counted = now - self.stale_after
            for n, recent in self._measured.items():
                newest = recent[-1][2]
                if newest < oldest_counted:
                    # No step of this row count lately. Its steps speak for the machine as it
                    # was: a slow spell on a shared machine (or one stalled step) can price a
                    # row count out, and a row count priced out is avoided, so never measured
                    # again, so never corrected. The point expires; the earlier estimate returns.
                    continue
                recent = self._counted(recent, 2, now, timed=True)
                hit = memo.get(n)
                if hit is not None and hit[:3] == (newest, len(recent), per_seq):
                    t, seqs, spread = hit[3]
                else:
                    seqs = statistics.fmean(s for _, s, _ in recent)
                    # The median resists the odd stalled step; steps of this row count at other
                    # sequence counts are first moved to the mean count by the fit's slope.
                    t, spread = _median_spread([t + per_seq * (seqs - s) for t, s, _ in recent])
                    memo[n] = (newest, len(recent), per_seq, (t, seqs, spread))
                if len(recent) < self.min_measured and t > self.stall_ratio * self._unmeasured(
                    n, seqs, anchors
                ):
                    # Too few steps for the median to resist a stall, and far over the price
                    # the row count had without them: taken for a stall until more steps agree
                    # (a row count priced out by a stall is avoided, so never measured again).
                    continue
                live[n] = (t, seqs, len(recent), spread)
            if len(memo) > 2 * self.max_measured_sizes:
                for n in [n for n in memo if n not in self._measured]:
                    del memo[n]
            # The curve is a function of the fit, the anchors and the live points as kept (a
            # point within the fit's noise is dropped, so its seconds do not matter): a step
            # that moved no kept point leaves the curve as it was, and it is reused.
            live_points = tuple(
                sorted(
                    self._curve_point(n, t, seqs, count, spread)
                    for n, (t, seqs, count, spread) in live.items()
                )
            )  # sorted: the same points whichever row count was measured last
            key = (fit, anchors, live_points)
            old = self._curve_memo
            if (
                old is not None
                and old[0][0] is fit
                and old[0][1] is anchors
                and old[0][2] == key[2]
            ):
                base = old[1]
            else:
                points = [
                    self._curve_point(n, t, seqs, self.min_measured)
                    for n, (t, seqs) in anchors.items()
                    if n not in live
                ]
                base = TargetCurve(sorted(points + list(live_points)), fit)
            shapes = self._shape_medians(base)
            if old is not None and old[1] is base and old[2].shapes == shapes:
                self._curve = old[2]
            else:
                self._curve = base.with_shapes(shapes)
            self._curve_memo = (key, base, self._curve)
        return self._curve

    def _unmeasured(self, n: int, seqs: float, anchors: dict[int, tuple[float, float]]) -> float:
        """Seconds for ``n`` rows at ``seqs`` sequences without live steps of that row count: the
        calibration forward there (plus the live offset), else the parametric fit."""
        anchor = anchors.get(n)
        if anchor is None:
            return self.target(n, seqs)
        t, s = anchor
        return max(t + self.target.per_seq * (seqs - s), _MIN_TIME)

    def _curve_point(
        self, n: int, t: float, seqs: float, count: int, spread: float | None = None
    ) -> tuple[int, float | None, float]:
        """(rows, seconds or None, sequences) of a point measured by ``count`` steps (a
        calibration forward counts as ``min_measured``) whose relative spread is ``spread``:
        within ``_tolerance`` of the fit, the fit is the better estimate (it pools every step;
        a point holds a few), so the point keeps its seconds only where the fit is clearly off."""
        fit = self.target(n, seqs)
        return (n, t if abs(t - fit) > self._tolerance(count, spread) * fit else None, seqs)

    def _counted(
        self, steps: Sequence[tuple], at: int, now: int, timed: bool = False
    ) -> Sequence[tuple]:
        """``_counted`` under this model's windows; ``timed``: the steps hold seconds at index 0,
        and fresh ones well under the older ones' median count alone (by ``curve_tolerance``)."""
        faster_by = self.curve_tolerance if timed else None
        return _counted(
            steps, at, now, self.stale_after, self.refresh_after, self.min_measured, faster_by
        )

    def _tolerance(self, count: int, spread: float | None = None) -> float:
        """How far a median of ``count`` live steps must be off the fit to be believed over it:
        ``curve_tolerance`` at ``min_measured`` steps, shrinking as the median's own noise does
        (1 / sqrt(count)). The fit's error at one row count is not noise but bias (its form is
        smooth, the kernels are not), and it does not average away: on the real pair at four
        sequences the fit priced the plain step 7% over the 160 ms that steps of it measured
        all along, within a flat 10%, and the controller speculated for a gain of 3% it
        predicted at 19%.

        Where ``NOISE_MIN_STEPS`` or more steps give their relative ``spread`` (median absolute
        deviation over the median), the median's standard error is estimated from it, and a
        median ``noise_tolerance`` standard errors off the fit is believed too, down to
        ``min_tolerance``: steps that agree closely pin their price well inside the flat rule's
        band (on the real pair at eight sequences, sixteen steps each put the plain step 2.5%
        under the fit and two drafts each 4% over it, and speculating was predicted 11% better
        than plain where it measured 5%, too little to pay for its tails and catch-ups)."""
        tolerance = self.curve_tolerance * math.sqrt(
            self.min_measured / max(count, self.min_measured)
        )
        if spread is not None and count >= NOISE_MIN_STEPS:
            # MAD -> standard deviation (x 1.4826, normal steps), then the median's standard
            # error (x 1.2533 / sqrt(count)).
            noise = 1.4826 * 1.2533 * spread / math.sqrt(count)
            tolerance = max(self.min_tolerance, min(tolerance, self.noise_tolerance * noise))
        return tolerance

    def _anchor_points(self) -> dict[int, tuple[float, float]]:
        """rows -> (seconds, sequences) of the calibration forwards, plus what a live step adds
        to a bare one (the fitted offset); the cheapest where several share a row count."""
        key, offset = self._target_anchors, self.calibration_offset
        if self._anchor_memo is None or self._anchor_memo[:2] != (key, offset):
            measured: dict[int, tuple[float, float]] = {}
            for a in self._target_anchors:  # a bare forward, plus what a live step adds to it
                t = max(a.seconds - offset, _MIN_TIME)
                if t < measured.get(a.num_tokens, (float("inf"), 0))[0]:
                    measured[a.num_tokens] = (t, a.num_seqs)
            self._anchor_memo = (key, offset, measured)
        return self._anchor_memo[2]

    def _shape_medians(self, curve: TargetCurve) -> dict[tuple[int, int], float]:
        """Median seconds of each (rows, sequences) shape with enough recent live steps, where
        the curve is off it by more than ``_tolerance`` for their count (within that, the curve
        pools more steps and jitters less: two shapes' medians of a few steps each, a few percent
        apart, would flip decisions)."""
        out, memo = {}, self._shape_memo
        for (n, s), recent in self._measured_shapes.items():
            newest = recent[-1][1]
            recent = self._counted(recent, 1, self.num_observations, timed=True)
            if len(recent) >= self.min_measured:
                hit = memo.get((n, s))
                if hit is not None and hit[:2] == (newest, len(recent)):
                    t, spread = hit[2]
                else:
                    t, spread = _median_spread([t for t, _ in recent])
                    memo[(n, s)] = (newest, len(recent), (t, spread))
                c = curve(n, s)
                if abs(t - c) > self._tolerance(len(recent), spread) * c:
                    out[(n, s)] = t
        if len(memo) > 2 * self.max_measured_sizes:
            for shape in [k for k in memo if k not in self._measured_shapes]:
                del memo[shape]
        return out

    def draft_time(self, forwards: Sequence[tuple[int, int]]) -> float:
        """Seconds for these draft forwards, each (rows, seqs); no forwards cost nothing.

        The linear fit, scaled by what recent live steps with about as many draft rows measured
        against it (``_draft_factor``)."""
        if not forwards:
            return 0.0
        fit = sum(self.draft(rows, seqs) for rows, seqs in forwards)
        return fit * self.draft_factor(sum(rows for rows, _ in forwards))

    def draft_factor(self, rows: float) -> float:
        """What a draft step of ``rows`` rows in all costs over the linear fit: the median of
        measured / fitted seconds of recent live draft steps with about as many rows (the same
        power of two), where that is off 1 by more than ``_tolerance`` for their count; else 1.

        One line through every draft step is dominated by the many small ones and misprices
        the rest: on a two-core CPU, 16 sequences' two draft forwards (about 46 rows) ran 25%
        over it for a whole run, and a 16-sequence catch-up of 808 rows took twice its price.
        That is the speculating side of the very decision the fit is for, so its own steps
        price it, as measured points price the target side (``target_curve``).

        Factors are cached until the next draft step or refit; "recent" is judged at the
        observation count pinned by the first ask after that (``pin_draft_factors``), so a
        factor does not depend on which decision first asked for its row count."""
        bucket = int(rows).bit_length()
        factor = self._draft_factors.get(bucket)
        if factor is None:
            factor = 1.0
            recent = self._draft_measured.get(bucket, ())
            self.pin_draft_factors()
            recent = self._counted(recent, 1, self._factors_as_of)
            if len(recent) >= self.min_measured:
                # The same samples under the same fit give the same median: keep it per bucket
                # until either changes (the newest sample object and the count stand for the
                # bucket's steps: they are only ever appended, each a new object).
                key = (recent[-1][0], len(recent), self.draft)  # every sample is a new object
                hit = self._ratio_memo.get(bucket)
                if (
                    hit is not None
                    and not self.exact_reference
                    and hit[0][0] is key[0]
                    and hit[0][1] == key[1]
                    and hit[0][2] is key[2]
                ):
                    ratio = hit[1]
                else:
                    ratio = statistics.median(
                        s.seconds / max(sum(self.draft(r, n) for r, n in s.each()), _MIN_TIME)
                        for s, _ in recent
                    )
                    self._ratio_memo[bucket] = (key, ratio)
                if abs(ratio - 1.0) > self._tolerance(len(recent)):
                    factor = ratio
            self._draft_factors[bucket] = factor
        return factor

    def pin_draft_factors(self) -> None:
        """Judge the freshness of draft factors computed from now until they are next dropped
        at the current observation count (the controller calls this before each decision)."""
        if self._factors_as_of is None:
            self._factors_as_of = self.num_observations

    def _drop_draft_factors(self) -> None:
        self._draft_factors.clear()
        self._factors_as_of = None
        self.draft_epoch += 1

    def draft_bound(self, per_position_forwards: bool) -> tuple[float, float] | None:
        """(a, b) such that a step drafting K tokens in all, kappa per-position forwards (one
        forward in all without ``per_position_forwards``), spends at least a kappa + b K seconds
        in draft forwards (None where a draft coefficient is negative: no such bound holds).

        Each forward costs at least its fixed part, each drafted token a row at the cheaper row
        price (and, per-position, a sequence) in some forward; catch-up only adds; the factor is
        the smallest any row count has (1 where none was measured).
        """
        d = self.draft
        if min(d.per_forward, d.per_row, d.per_seq, d.per_row_above_knee, d.knee) < 0:
            return None
        factor = 1.0  # row counts without measured steps
        for bucket in self._draft_measured:
            factor = min(factor, self.draft_factor((1 << bucket) >> 1))
        # rows = min(rows, knee) + max(0, rows - knee) for a knee >= 0; none beyond an infinite one
        per_row = d.per_row if math.isinf(d.knee) else min(d.per_row, d.per_row_above_knee)
        if per_position_forwards:
            per_row += d.per_seq
        return factor * d.per_forward, factor * per_row

    # ---- data -------------------------------------------------------------------------------
    def seed(self, target: Sequence[TargetSample], draft: Sequence[DraftSample]) -> None:
        """Install calibration samples as anchors and refit, choosing the knee from scratch."""
        self._target_anchors = [replace(s, calibration=True) for s in target]
        self._draft_anchors = [replace(s, calibration=True) for s in draft]
        self._draft_data += 1
        self.refit(search_knee=True)
        self.prior_target, self.prior_draft = self.target, self.draft

    def observe_speed(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Update ``speed_index`` from one step's measured target seconds (as measured; call it
        before ``observe_draft`` and ``observe_target`` for the same step, which store their
        seconds divided by the index)."""
        if not self.track_speed:
            return
        oldest = self.num_observations - self.stale_after
        kept = [
            t for t, at in self._measured_shapes.get((num_tokens, num_seqs), ()) if at >= oldest
        ]
        if len(kept) < self.min_measured:
            return  # no history: a first step at a shape is its price, not a spell
        reference = statistics.median(kept)  # at the reference speed
        # One stalled step is one vote in the median, however long it stalled.
        self._speed_ratios.append(min(max(seconds / max(reference, _MIN_TIME), 1 / 3), 3.0))
        index = statistics.median(self._speed_ratios)
        # Never under 1: other work on a machine only ever adds time, so steps faster than their
        # shape's history say the history was slowed (in a spell before the index saw one, which
        # the curve's fresh-step rules then price afresh), not that the machine outran itself.
        self.speed_index = index if index > 1.0 + self.speed_deadband else 1.0

    def observe_target(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        seconds /= self.speed_index
        self._target_live.append(TargetSample(num_tokens, num_seqs, seconds))
        recent = self._measured.pop(num_tokens, None) or deque(maxlen=self.measured_window)
        recent.append((seconds, num_seqs, self.num_observations))
        self._measured[num_tokens] = recent  # re-inserted: the dict's order is recency
        if len(self._measured) > self.max_measured_sizes:
            # A long-running server sees many prefill sizes once; forget the least recent.
            del self._measured[next(iter(self._measured))]
        shape = (num_tokens, num_seqs)
        same = self._measured_shapes.pop(shape, None) or deque(maxlen=self.measured_window)
        same.append((seconds, self.num_observations))
        self._measured_shapes[shape] = same
        if len(self._measured_shapes) > self.max_measured_sizes:
            del self._measured_shapes[next(iter(self._measured_shapes))]
        self._curve = None
        self._tick()

    def observe_draft(self, forwards: Sequence[tuple[int, int]], seconds: float) -> None:
        seconds /= self.speed_index
        if forwards:
            rows = sum(r for r, _ in forwards)
            seqs = sum(s for _, s in forwards)
            sample = DraftSample(len(forwards), rows, seqs, seconds, forwards=tuple(forwards))
            self._draft_live.append(sample)
            self._draft_data += 1
            bucket = int(rows).bit_length()
            recent = self._draft_measured.get(bucket) or deque(maxlen=self.measured_window)
            recent.append((sample, self.num_observations))
            self._draft_measured[bucket] = recent
            self._drop_draft_factors()

    def has_plain_sample(self, lo: float, hi: float, recent: int = 256) -> bool:
        """Whether ``min_measured`` live plain steps (one row per sequence) with a row count in
        [lo, hi] are among the ``recent`` newest live steps: tells the controller whether the
        model has measured the plain side of its choice at this batch size lately (enough steps
        for the curve to take them at face value). Calibration forwards do not count: they are
        bare forwards, and what a live step adds to one grows with the batch."""
        found = 0
        for sample in itertools.islice(reversed(self._target_live), max(0, recent)):
            if sample.num_tokens == sample.num_seqs and lo <= sample.num_tokens <= hi:
                found += 1
                if found >= self.min_measured:
                    return True
        return found >= self.min_measured

    def fastest_at(self, num_tokens: int, num_seqs: int) -> float | None:
        """Seconds of the fastest kept live step of exactly this shape, or None if none is kept:
        a floor under its price that no slow spell raises (other work on the machine only ever
        adds time)."""
        steps = self._measured_shapes.get((num_tokens, num_seqs))
        return min(seconds for seconds, _ in steps) if steps else None

    def num_live_at(self, num_tokens: int, recent: int = 256) -> int:
        """Live steps with exactly ``num_tokens`` rows among the ``recent`` newest observations
        (at most ``measured_window``): how much the curve's point there rests on live data rather
        than on a bare calibration forward or the fit."""
        samples = self._measured.get(num_tokens, ())
        return sum(self.num_observations - idx <= recent for _, _, idx in samples)

    def num_live_draft_at(self, rows: float, recent: int = 256) -> int:
        """Live draft steps among the ``recent`` newest observations whose rows in all fall in
        the same power-of-two bucket as ``rows`` (at most ``measured_window``): how much the
        draft price of such a step rests on its own measurements (``draft_factor``) rather
        than on the line through every draft step."""
        samples = self._draft_measured.get(int(rows).bit_length(), ())
        return sum(self.num_observations - idx <= recent for _, idx in samples)

    def _tick(self) -> None:
        self.num_observations += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._fit_due = True
            if not self.defer_refits:
                self.refit_if_due()

    def _weights(self, n_live: int, n_anchor: int) -> np.ndarray:
        live = self.decay ** np.arange(n_live - 1, -1, -1, dtype=np.float64)  # newest = 1
        return np.concatenate([np.full(n_anchor, self.anchor_weight), live])

    # ---- fitting ----------------------------------------------------------------------------
    def refit(self, search_knee: bool = False) -> None:
        self._fit_due = False
        self._since_fit = 0
        self._curve = None
        self._drop_draft_factors()
        self.num_fits += 1
        self._refit_target(search_knee)
        self._refit_draft(search_knee)

    def _refit_target(self, search_knee: bool) -> None:
        samples = self._target_anchors + list(self._target_live)
        if not samples:
            return
        p = self.prior_target
        max_rows = max(s.num_tokens for s in samples)
        knee, b = self._fit_with_knee(
            _TargetColumns(samples).features,
            samples, len(self._target_anchors),
            np.array([p.base, p.per_seq, p.slope_low, p.slope_high, 0.0]),
            self.target.knee, max_rows if search_knee else None,
        )  # fmt: skip
        self.target = TargetCost(
            base=float(b[0]),
            per_seq=float(b[1]),
            slope_low=float(b[2]),
            knee=float(knee),
            slope_high=float(b[3]),
        )
        self.calibration_offset = float(b[4])

    def _refit_draft(self, search_knee: bool) -> None:
        # The fit is a function of the samples, the prior, the knee it starts from and the
        # knobs: when none changed since the last fit (no draft ran lately), it is that fit.
        key = (
            self._draft_data, self._draft_anchors, len(self._draft_live), self.prior_draft,
            self.draft.knee, search_knee, self.ridge, self.decay, self.anchor_weight,
        )  # fmt: skip
        if (
            not self.exact_reference
            and self._draft_fit_memo is not None
            and self._draft_fit_memo[0] == key
        ):
            self.draft, self.draft_calibration_offset = self._draft_fit_memo[1]
            return
        self._fit_draft(search_knee)
        self._draft_fit_memo = (key, (self.draft, self.draft_calibration_offset))

    def _fit_draft(self, search_knee: bool) -> None:
        samples = self._draft_anchors + list(self._draft_live)
        if not samples:
            return
        p = self.prior_draft
        high = p.per_row_above_knee if math.isfinite(p.knee) else p.per_row
        max_rows = max(r for s in samples for r, _ in s.each())
        features = (
            functools.partial(_draft_features_reference, samples)
            if self.exact_reference
            else _DraftColumns(samples).features
        )
        knee, b = self._fit_with_knee(
            features,
            samples, len(self._draft_anchors),
            np.array([p.per_forward, p.per_row, high, p.per_seq, 0.0]),
            self.draft.knee, max_rows if search_knee else None,
        )  # fmt: skip
        self.draft = DraftCost(
            per_forward=float(b[0]),
            per_row=float(b[1]),
            per_seq=float(b[3]),
            knee=float(knee),
            per_row_above_knee=float(b[2]),
        )
        self.draft_calibration_offset = float(b[4])

    def _fit_with_knee(
        self,
        features: Callable[[float], np.ndarray],
        samples: Sequence[TargetSample | DraftSample],
        num_anchors: int,
        prior: np.ndarray,
        knee: float,
        search_below: float | None,
    ) -> tuple[float, np.ndarray]:
        """Weighted relative least squares (one Huber pass) of ``samples`` (calibration anchors
        first) at ``knee``; with ``search_below``, also at every grid knee under it (a knee past
        every sample is the same line), moving the knee only for a clear gain so that it does not
        wander on noise. Every coefficient is non-negative but the last (the calibration offset).
        Returns (knee, coefficients)."""
        y = np.maximum(np.array([s.seconds for s in samples], dtype=np.float64), _MIN_TIME)
        w0 = self._weights(len(samples) - num_anchors, num_anchors) / y**2
        nonneg = np.ones(len(prior), dtype=bool)
        nonneg[-1] = False

        def fit(knee: float) -> tuple[np.ndarray, float]:
            x = features(knee)
            b, _ = fit_nonneg_ridge(x, y, w0, prior, self.ridge, nonneg)
            w = _huber_weights((y - x @ b) / y, w0)
            return fit_nonneg_ridge(x, y, w, prior, self.ridge, nonneg)

        best_b, best_sse = fit(knee)
        if search_below is not None:
            for cand in KNEE_GRID:
                if cand == knee or cand >= search_below:
                    continue
                b, sse = fit(cand)
                if sse < 0.98 * best_sse:
                    knee, best_b, best_sse = cand, b, sse
        return knee, best_b

    def to_dict(self) -> dict[str, float]:
        t, d = self.target, self.draft
        return {
            "target_base_s": t.base,
            "target_per_seq_s": t.per_seq,
            "target_per_token_s": t.slope_low,
            "target_knee_tokens": t.knee,
            "target_per_token_above_knee_s": t.slope_high,
            "draft_per_forward_s": d.per_forward,
            "draft_per_row_s": d.per_row,
            "draft_per_seq_s": d.per_seq,
            "draft_knee_rows": d.knee if math.isfinite(d.knee) else 0.0,
            "draft_per_row_above_knee_s": d.per_row_above_knee,
            "num_observations": float(self.num_observations),
            "speed_index": self.speed_index,
        }
