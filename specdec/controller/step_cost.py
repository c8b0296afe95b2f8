"""Step cost: predicted seconds of a target forward and of a step's draft forwards, fitted online.

``t(r, s, A, m) = speed * (W(r) + c_seq * s + c_attn * A + c_samp * m)`` for a forward of ``r``
rows over ``s`` sequences attending to ``A`` (query, key) pairs with ``m`` sampled rows; ``W`` is
piecewise linear and non-decreasing between knots at powers of two. A non-negative least squares
of relative errors over recent live steps and the start-up calibration fits it; ``speed`` is the
machine's current pace. docs/controller.md states the model and the reason for each constant.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

COST_WINDOW = 256  # live steps kept for the fit: minutes of serving, every recent shape in it
CALIBRATION_WEIGHT = 0.25  # a bare forward counts a quarter of a live step where both exist
SPEED_WINDOW = 9  # steps in the pace median: robust to a few outliers, follows a spell in seconds
STALL_RATIO = 2.0  # a forward over twice its fitted time is a stall, not a price
_SMOOTHNESS = 0.1  # weight of the slope-change penalty against one observation
_ATTN_SCALE = 1e-6  # attention pairs are counted in millions to keep the system well scaled
_KNOTS = tuple(2**i for i in range(17))  # 1 .. 65536 rows
_NUM_PARAMS = len(_KNOTS) + 3  # the knots' values, c_seq, c_attn, c_samp


@dataclass(frozen=True)
class ForwardShape:
    """One forward: rows computed, sequences in it, (query, key) pairs attended, and the rows
    whose next token is sampled from a warped distribution."""

    rows: int
    seqs: int
    attended: int = 0
    sampled: int = 0

    def __add__(self, o: ForwardShape) -> ForwardShape:  # field by field: astuple deep-copies
        return ForwardShape(self.rows + o.rows, self.seqs + o.seqs, self.attended + o.attended,
                            self.sampled + o.sampled)  # fmt: skip


def _knot(rows: int) -> tuple[int, float]:
    """(i, w): ``rows`` lies a share w of the way from knot i to knot i + 1."""
    r = min(max(rows, 1), _KNOTS[-1])
    i = min(bisect_right(_KNOTS, r) - 1, len(_KNOTS) - 2)
    return i, (r - _KNOTS[i]) / (_KNOTS[i + 1] - _KNOTS[i])


def features(shapes: Iterable[ForwardShape]) -> np.ndarray:
    """Linear features of a sum of forwards (a step's draft forwards, or one target forward):
    interpolation weights on the knots, sequences, attention pairs, sampled rows."""
    x = np.zeros(_NUM_PARAMS)
    for s in shapes:
        i, w = _knot(s.rows)
        x[i : i + 2] += (1.0 - w, w)
        x[-3:] += (s.seqs, s.attended * _ATTN_SCALE, s.sampled)
    return x


class ForwardCost:
    """The fitted time of one model's forwards (see the module docstring)."""

    def __init__(self, prior_seconds: float, prices_sampling: bool = True) -> None:
        # Until something is measured, a forward costs ``prior_seconds`` whatever its rows: a
        # weak guess that the first observations replace.
        self._prior = prior_seconds
        self._prices_sampling = prices_sampling  # else sampled rows cost what other rows do
        self._live_x: deque[np.ndarray] = deque(maxlen=COST_WINDOW)
        self._live_y: deque[float] = deque(maxlen=COST_WINDOW)
        self._cal_x: list[np.ndarray] = []
        self._cal_y: list[float] = []
        self._theta = np.zeros(_NUM_PARAMS)
        self._theta[: len(_KNOTS)] = prior_seconds
        self._knot_values = self._theta[: len(_KNOTS)].tolist()
        self._c_seq = self._c_attn = self._c_samp = 0.0
        self._dirty = False

    def seed(self, samples: Sequence[tuple[Sequence[ForwardShape], float]]) -> None:
        """Calibration: (forwards, seconds) measured on bare forwards."""
        for shapes, seconds in samples:
            self._cal_x.append(features(shapes))
            self._cal_y.append(seconds)
        self._dirty = True

    def add(self, x: np.ndarray, seconds: float) -> None:
        """A live measurement, already divided by the machine's pace."""
        self._live_x.append(x)
        self._live_y.append(seconds)
        self._dirty = True

    def base_of(self, shape: ForwardShape) -> float:
        """Seconds at pace 1 of one forward (without arrays: the policy prices many a step)."""
        if self._dirty:
            self._refit()
        knots, c_seq, c_attn, c_samp = self._knot_values, self._c_seq, self._c_attn, self._c_samp
        i, w = _knot(shape.rows)
        return (
            knots[i] * (1.0 - w)
            + knots[i + 1] * w
            + c_seq * shape.seqs
            + c_attn * shape.attended * _ATTN_SCALE
            + c_samp * shape.sampled
        )

    @property
    def num_live(self) -> int:
        return len(self._live_y)

    def _solve(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
        prior = np.eye(_NUM_PARAMS)[0] * self._prior  # W(1) only
        a = np.vstack([x * w[:, None], _SLOPE_PENALTY, np.diag(_RIDGE)])
        b = np.concatenate([y * w, np.zeros(len(_SLOPE_PENALTY)), prior * _RIDGE])
        return nnls(a, b)[0]

    def _refit(self) -> None:
        self._dirty = False
        rows, live = [*self._live_x, *self._cal_x], len(self._live_y)
        if not rows:
            return
        x = np.stack(rows)
        if not self._prices_sampling:
            x[:, -1] = 0.0
        x = x @ _MONOTONE  # columns: W(1), the rises between knots, the coefficients
        y = np.array([*self._live_y, *self._cal_y])
        # Relative errors: decisions compare goodputs, so a 60 ms decode's 10% miss matters as
        # much as a 2 s prompt step's, which in absolute seconds would dominate the fit.
        w = np.sqrt([1.0] * live + [CALIBRATION_WEIGHT] * len(self._cal_y)) / np.maximum(y, 1e-6)
        beta = self._solve(x, y, w)
        # A forward the fit misses by more than STALL_RATIO, live or timed at start-up, was
        # interference, not a price (whatever its shape, seen before or not): solved again
        # without it.
        kept = y <= STALL_RATIO * (x @ beta)
        self._theta = _MONOTONE @ (beta if kept.all() else self._solve(x[kept], y[kept], w[kept]))
        self._knot_values = self._theta[: len(_KNOTS)].tolist()
        self._c_seq, self._c_attn, self._c_samp = (float(v) for v in self._theta[-3:])


def _monotone_basis() -> np.ndarray:
    """Maps (W(1), rise to knot 2, ..., rise to the last knot, c_seq, c_attn, c_samp) to the knot
    values and the coefficients: non-negative rises make W non-decreasing."""
    m = np.eye(_NUM_PARAMS)
    m[: len(_KNOTS), : len(_KNOTS)] = np.tril(np.ones((len(_KNOTS), len(_KNOTS))))
    return m


def _slope_penalty() -> np.ndarray:
    """Rows penalising the change of slope at each inner knot, scaled by the knot's rows so
    that a change costs the same relative error at every scale."""
    n = len(_KNOTS)
    pen = np.zeros((n - 2, _NUM_PARAMS))
    for i in range(1, n - 1):
        # slope left of knot i = rise_i / width_left; right = rise_{i+1} / width_right
        pen[i - 1, i] = -_KNOTS[i] / (_KNOTS[i] - _KNOTS[i - 1]) * _SMOOTHNESS
        pen[i - 1, i + 1] = _KNOTS[i] / (_KNOTS[i + 1] - _KNOTS[i]) * _SMOOTHNESS
    return pen


_MONOTONE = _monotone_basis()
_SLOPE_PENALTY = _slope_penalty()
# A faint pull towards the prior keeps directions without data defined; next to none on the
# rises, so that rows past the data extrapolate along the last measured slope.
_RIDGE = np.full(_NUM_PARAMS, 1e-6)
_RIDGE[0] = 1e-3
_RIDGE[-3:] = 1e-3


class StepCostModel:
    """Target and draft forward costs sharing one measure of the machine's pace."""

    def __init__(self, prior_target_seconds: float = 0.1, prior_draft_seconds: float = 0.03):
        self.target = ForwardCost(prior_target_seconds)
        # A draft row's sampling is a small share of its forward: the row term carries it. No
        # calibration sample measures a term of its own, so one catch-up step could load it.
        self.draft = ForwardCost(prior_draft_seconds, prices_sampling=False)
        self._ratios: deque[float] = deque(maxlen=SPEED_WINDOW)
        self.speed = 1.0
        # (target rows, sequences, draft rows) measured: a first one shows fit error, not pace
        self._seen_shapes: set[tuple[int, int, int]] = set()

    def target_time(self, shape: ForwardShape) -> float:
        # A forward is never free: a fit pinned at zero by odd measurements must not make a
        # step's goodput infinite.
        return self.speed * max(self.target.base_of(shape), 1e-9)

    def draft_time(self, forwards: Sequence[ForwardShape]) -> float:
        return self.speed * sum(self.draft.base_of(f) for f in forwards)

    def observe(
        self,
        target: ForwardShape,
        target_seconds: float,
        draft_forwards: Sequence[ForwardShape],
        draft_seconds: float,
    ) -> None:
        """One live step: the target forward (with the step's host work) and its draft forwards."""
        parts = [(self.target, [target], target_seconds)]
        if draft_forwards:
            parts.append((self.draft, draft_forwards, draft_seconds))
        predicted = sum(cost.base_of(f) for cost, shapes, _ in parts for f in shapes)
        measured = target_seconds + draft_seconds
        if predicted <= 0.0 or measured <= 0.0:
            return
        key = (target.rows, target.seqs, sum(f.rows for f in draft_forwards))
        if key in self._seen_shapes:
            self._ratios.append(measured / predicted)
            if len(self._ratios) >= SPEED_WINDOW:
                self.speed = statistics.median(self._ratios)
        self._seen_shapes.add(key)
        for cost, shapes, seconds in parts:
            cost.add(features(shapes), seconds / self.speed)
