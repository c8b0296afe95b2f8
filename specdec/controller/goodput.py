"""The controller's objective and its search: k per sequence maximising the batch's goodput.

For a batch whose decode-ready sequence i verifies k_i drafts::

    goodput(k) = sum_i E_i(k_i) / (T(n_other + sum_i (1 + k_i), s) - T(n_other) + D(k))

(T(n_other) is the prefill chunks' own time, 0 when the step has none: it is spent whatever the
k's, so the decodes are charged what they add to the step.)

A step that carries prefill chunks is scored differently. There the decodes add little time to a
long step, and a ratio of what they add favours the smallest addition: one plain row beside a
47-row chunk "runs" at 24 tokens/s while drafting it runs at 9, although the drafted step commits
three tokens for the same chunk. What the added time is really worth is what the batch would
commit in it otherwise, its decode-only goodput ``lam`` (the best ratio above with no prefill). So
the decodes maximise ``E - lam * added time`` (tokens committed net of the time's value), reported
on the ratio scale as ``lam + (E - lam * added time) / T_ref`` (``T_ref``: that decode-only step's
time), so that relative margins read as a share of one ordinary step's output.

E_i is sequence i's expected committed tokens (see ``acceptance``), T the target step time for
that many rows, D the draft time. With a draft model, drafting runs one forward per position up to
max_i k_i; forward j carries the n_j sequences with k_i > j, one row each, except that the first
forward reads each drafting sequence's usual one or two rows (rows_0 in all). So::

    D = sum_{j < K} D_fwd(rows_j, n_j) + sum_{i drafting} C_i

with K = max_i k_i, rows_j = n_j for j > 0, and D = 0 when every k_i = 0 (no draft forward runs at
all). C_i is what sequence i's draft catching up on the tokens it has not seen (a prompt, or all
that was decoded plainly since it last drafted) is charged to this step, priced by the caller: such
rows are compute-bound, dearer than decode rows, and bought once for many steps. A lookup proposer
(n-gram) is costed as a single pseudo-forward of sum_i k_i rows. Every term only needs the counts
(histogram of k, rows_0, sum of C_i), so changing one k_i re-evaluates in O(k_max): the search is
coordinate ascent from a few starting points (the held decision, all off, every uniform k), each
sequence in turn moved to its best k given the others, until no move helps.

Evaluation is memoised, never approximated: the added time is a pure function of (histogram,
sum of k, rows_0, catch-up seconds), so it is computed once per distinct value of those; and while
the assignment stands, a move's time depends on the moving sequence only through (its k, its
catch-up rows, its catch-up seconds), so ``best_move`` prices each such class once and only does
the per-sequence division. Every value is the same floating-point expression, evaluated in the
same order, as the plain evaluation (kept behind ``exact_reference=True`` for the equivalence test),
so every comparison, and so every decision, comes out the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specdec.controller.cost_model import CostModel


@dataclass
class SeqTerms:
    """What the objective needs about one decode-ready sequence."""

    gains: list[float]  # E(0), ..., E(k_allowed): expected committed tokens per k
    catchup_rows: float  # rows the first draft forward spends on it (>= 1)
    fixed_k: int | None = None  # forced ('on', 'off', probe); None = free to choose
    catchup_s: float = 0.0  # seconds charged to this step for its draft's catch-up, if it drafts

    @property
    def max_k(self) -> int:
        return len(self.gains) - 1


class BatchGoodput:
    """Incrementally evaluated goodput of one batch under one cost model."""

    def __init__(
        self,
        terms: Sequence[SeqTerms],
        cost: CostModel,
        k_max: int,
        extra_tokens: float = 0.0,
        extra_seqs: float = 0.0,
        per_position_forwards: bool = True,
        exact_reference: bool = False,
    ) -> None:
        self.terms = list(terms)
        # True: every value computed afresh, as before memoisation (the equivalence test's reference)
        self.exact_reference = exact_reference
        # (hist, sum_k, rows0, catchup_s) -> added seconds; pure, so valid for this object's life
        self._added_memo: dict[tuple, float] = {}
        # While the assignment stands: (k, catchup_rows, catchup_s) of a moving sequence -> added
        # seconds per new k; and the current value. Dropped whenever the assignment changes.
        self._move_rows: dict[tuple[int, float, float], list[float]] = {}
        self._current: float | None = None
        self._limits: list[tuple[int | None, int]] | None = None  # (fixed_k, max_k) for clamp
        self._clamped: dict[tuple[int, ...], list[int]] = {}
        self.cost = cost
        self._target = cost.target_curve()  # fixed for the life of this object: one decision
        self._draft = cost.draft
        self.k_max = k_max
        self.extra_tokens = extra_tokens
        self.num_seqs = len(self.terms) + extra_seqs
        self.per_position_forwards = per_position_forwards
        # Prefill chunks in the step run whatever the k's: their time is spent either way, so
        # decodes are charged only what they add to it. (Charging the whole step would make verify
        # rows look nearly free beside a big chunk, however much each of them really adds.)
        self._prefill_alone = self._target(extra_tokens, extra_seqs) if extra_tokens >= 1 else 0.0
        # With prefill in the step: the decode-only goodput prices the time the decodes add.
        self._time_price: float | None = None
        self._time_scale = 1.0
        if self._prefill_alone > 0 and self.terms:
            alone = BatchGoodput(
                self.terms, cost, k_max, 0.0, 0.0, per_position_forwards, exact_reference
            )
            n = len(self.terms)
            _, self._time_price = alone.search([[k] * n for k in range(k_max + 1)], refine=1)
            self._time_scale = max(alone.step_time(), 1e-9)
        self.ks = [0] * len(self.terms)
        self.hist = [0] * (k_max + 1)
        self.hist[0] = len(self.terms)
        self.sum_gain = float(sum(t.gains[0] for t in self.terms))
        self.sum_k = 0
        self.rows0 = 0.0
        self.catchup_s = 0.0

    # ---- evaluation -------------------------------------------------------------------------
    def _forwards(self, hist: list[int], sum_k: int, rows0: float) -> list[tuple[float, int]]:
        """(rows, sequences) of each draft forward for a histogram of k (none: no draft runs)."""
        num_drafting = len(self.terms) - hist[0]
        if num_drafting == 0:
            return []
        if not self.per_position_forwards:  # one forward drafts every position at once
            return [(float(sum_k), num_drafting)]
        # One forward per position: the first reads rows0, forward j a row per sequence with
        # k > j.
        forwards, still = [(rows0, num_drafting)], num_drafting - hist[1]
        for j in range(2, self.k_max + 1):
            if still == 0:
                break
            forwards.append((float(still), still))
            still -= hist[j]
        return forwards

    def _draft_time(self, hist: list[int], sum_k: int, rows0: float, catchup_s: float) -> float:
        forwards = self._forwards(hist, sum_k, rows0)
        if not forwards:
            return 0.0
        d = self._draft
        fit = sum(d(rows, seqs) for rows, seqs in forwards)
        return fit * self.cost.draft_factor(sum(rows for rows, _ in forwards)) + catchup_s

    def draft_rows(self) -> float:
        """Rows the draft forwards of the current assignment read in all (0: no draft runs)."""
        return sum(rows for rows, _ in self._forwards(self.hist, self.sum_k, self.rows0))

    def _added_time(self, hist: list[int], sum_k: int, rows0: float, catchup_s: float) -> float:
        """Seconds the decodes add to the step (the whole step when it carries no prefill)."""
        if self.exact_reference:
            return self._added_time_uncached(hist, sum_k, rows0, catchup_s)
        key = (*hist, sum_k, rows0, catchup_s)
        t = self._added_memo.get(key)
        if t is None:
            t = self._added_memo[key] = self._added_time_uncached(hist, sum_k, rows0, catchup_s)
        return t

    def _added_time_uncached(
        self, hist: list[int], sum_k: int, rows0: float, catchup_s: float
    ) -> float:
        n = self.extra_tokens + len(self.terms) + sum_k
        t = self._target(n, self.num_seqs) - self._prefill_alone
        return max(t + self._draft_time(hist, sum_k, rows0, catchup_s), 1e-9)

    def _value(
        self, sum_gain: float, hist: list[int], sum_k: int, rows0: float, catchup_s: float
    ) -> float:
        t = self._added_time(hist, sum_k, rows0, catchup_s)
        if self._time_price is None:
            return sum_gain / t
        return self._time_price + (sum_gain - self._time_price * t) / self._time_scale

    def value(self) -> float:
        """The objective for the current assignment: predicted committed tokens per second (on
        that scale, net of the added time's value, when the step carries prefill)."""
        if self._current is None or self.exact_reference:
            self._current = self._value(
                self.sum_gain, self.hist, self.sum_k, self.rows0, self.catchup_s
            )
        return self._current

    def step_time(self) -> float:
        """Predicted seconds of the whole step (prefill chunks included) for the assignment."""
        added = self._added_time(self.hist, self.sum_k, self.rows0, self.catchup_s)
        return added + self._prefill_alone

    def tokens_per_s(self) -> float:
        """Expected decode tokens committed per second of the whole step."""
        return self.sum_gain / self.step_time()

    def value_if(self, i: int, k: int) -> float:
        """Goodput if sequence i moved to k, everything else unchanged."""
        old = self.ks[i]
        if k == old:
            return self.value()
        t = self.terms[i]
        sum_gain = self.sum_gain - t.gains[old] + t.gains[k]
        moved = (k > 0) - (old > 0)
        rows0 = self.rows0 + t.catchup_rows * moved
        catchup_s = self.catchup_s + t.catchup_s * moved
        self.hist[old] -= 1
        self.hist[k] += 1
        v = self._value(sum_gain, self.hist, self.sum_k - old + k, rows0, catchup_s)
        self.hist[k] -= 1
        self.hist[old] += 1
        return v

    # ---- mutation ---------------------------------------------------------------------------
    def set(self, i: int, k: int) -> None:
        old = self.ks[i]
        if k == old:
            return
        t = self.terms[i]
        self.sum_gain += t.gains[k] - t.gains[old]
        moved = (k > 0) - (old > 0)
        self.rows0 += t.catchup_rows * moved
        self.catchup_s += t.catchup_s * moved
        self.sum_k += k - old
        self.hist[old] -= 1
        self.hist[k] += 1
        self.ks[i] = k
        self._changed()

    def resum(self) -> None:
        """Recompute the running sums from the assignment, in sequence order.

        ``set`` and ``assign`` keep them by adding and subtracting each move, so after a search
        they carry rounding that depends on the moves that led there: two paths to the same
        assignment (a shortcut and the full search) could price it a few ulps apart. Summed
        afresh, the same assignment always gets the same figure."""
        terms, ks = self.terms, self.ks
        self.sum_gain = sum((t.gains[k] for t, k in zip(terms, ks, strict=True)), 0.0)
        self.rows0 = sum((t.catchup_rows for t, k in zip(terms, ks, strict=True) if k > 0), 0.0)
        self.catchup_s = sum((t.catchup_s for t, k in zip(terms, ks, strict=True) if k > 0), 0.0)
        self._changed()

    def _changed(self) -> None:
        self._current = None
        if self._move_rows:
            self._move_rows = {}

    def assign(self, ks: Sequence[int]) -> float:
        """Set every k (``set`` in turn, inlined: the same additions in the same order)."""
        cur, terms, hist = self.ks, self.terms, self.hist
        sum_gain, rows0, catchup_s, sum_k = self.sum_gain, self.rows0, self.catchup_s, self.sum_k
        changed = False
        for i, k in enumerate(ks):
            old = cur[i]
            if k == old:
                continue
            t = terms[i]
            sum_gain += t.gains[k] - t.gains[old]
            moved = (k > 0) - (old > 0)
            rows0 += t.catchup_rows * moved
            catchup_s += t.catchup_s * moved
            sum_k += k - old
            hist[old] -= 1
            hist[k] += 1
            cur[i] = k
            changed = True
        if changed:
            self.sum_gain, self.rows0, self.catchup_s, self.sum_k = (
                sum_gain,
                rows0,
                catchup_s,
                sum_k,
            )
            self._changed()
        return self.value()

    # ---- search -----------------------------------------------------------------------------
    def best_move(self, i: int) -> int:
        """Best k for sequence i given the others."""
        if self.exact_reference:
            return self._best_move_reference(i)
        t, old = self.terms[i], self.ks[i]
        current = self._current
        if current is None:
            current = self.value()
        times = self._move_rows.get((old, t.catchup_rows, t.catchup_s))
        if times is None:
            times = self._move_times(old, t.catchup_rows, t.catchup_s)
        gains, price = t.gains, self._time_price
        base = self.sum_gain - gains[old]  # value_if's sum, left to right: base + gains[k]
        best_k, best_v = old, current
        for k in range(len(gains)):
            if k == old:
                v = current
            elif price is None:
                v = (base + gains[k]) / times[k]
            else:
                v = price + ((base + gains[k]) - price * times[k]) / self._time_scale
            if v > best_v * (1 + 1e-12):
                best_k, best_v = k, v
        return best_k

    def _move_times(self, old: int, catchup_rows: float, catchup_s: float) -> list[float]:
        """Added seconds if a sequence at ``old`` with these catch-up terms moved to each k
        (``value_if``'s time, the entry at ``old`` unused), cached while the assignment stands."""
        key = (old, catchup_rows, catchup_s)
        times = self._move_rows.get(key)
        if times is not None:
            return times
        hist, times = self.hist, []
        for k in range(self.k_max + 1):
            if k == old:
                times.append(0.0)
                continue
            moved = (k > 0) - (old > 0)
            hist[old] -= 1
            hist[k] += 1
            times.append(
                self._added_time(
                    hist,
                    self.sum_k - old + k,
                    self.rows0 + catchup_rows * moved,
                    self.catchup_s + catchup_s * moved,
                )
            )
            hist[k] -= 1
            hist[old] += 1
        self._move_rows[key] = times
        return times

    def _best_move_reference(self, i: int) -> int:
        best_k, best_v = self.ks[i], self.value()
        for k in range(self.terms[i].max_k + 1):
            v = self.value_if(i, k)
            if v > best_v * (1 + 1e-12):
                best_k, best_v = k, v
        return best_k

    def best_move_with(self, i: int, gains: list[float]) -> int:
        """Best k for sequence i if its expected tokens were ``gains`` (probing asks this)."""
        cur, saved = self.ks[i], self.terms[i]
        self.set(i, 0)
        self.sum_gain += gains[0] - saved.gains[0]
        self.terms[i] = replace(saved, gains=gains)
        self._current, self._limits = (
            None,
            None,
        )  # the sum changed (the move times did not: gains are not in them)
        k = self.best_move(i)
        self.sum_gain += saved.gains[0] - gains[0]
        self.terms[i] = saved
        self._current, self._limits = None, None
        self.set(i, cur)
        return k

    def ascend(self, max_passes: int = 4) -> float:
        """Coordinate ascent over the free sequences from the current assignment."""
        free = [i for i, t in enumerate(self.terms) if t.fixed_k is None]
        for _ in range(max_passes):
            moved = False
            for i in free:
                k = self.best_move(i)
                if k != self.ks[i]:
                    self.set(i, k)
                    moved = True
            if not moved:
                break
        return self.value()

    def clamp(self, ks: Sequence[int]) -> list[int]:
        """Respect fixed k's and per-sequence limits."""
        if self._limits is None:
            self._limits, self._clamped = [(t.fixed_k, t.max_k) for t in self.terms], {}
        key = tuple(ks)  # the same few starts are clamped again and again in one decision
        out = self._clamped.get(key)
        if out is None:
            out = self._clamped[key] = [
                fixed if fixed is not None else max(0, min(k, max_k))
                for (fixed, max_k), k in zip(self._limits, ks, strict=True)
            ]
        return list(out)

    def search(self, starts: Sequence[Sequence[int]], refine: int = 2) -> tuple[list[int], float]:
        """Best assignment found: every start scored, the best ``refine`` of them ascended."""
        scored = []
        for start in starts:
            ks = self.clamp(start)
            scored.append((self.assign(ks), ks))
        scored.sort(key=lambda p: -p[0])
        best_ks, best_v = scored[0][1], scored[0][0]
        for _, ks in scored[:refine]:
            self.assign(ks)
            v = self.ascend()
            if v > best_v:
                best_ks, best_v = list(self.ks), v
        self.assign(best_ks)
        return best_ks, best_v
