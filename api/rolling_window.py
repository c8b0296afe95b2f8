"""A rolling window of per-request measurements, binned in time, for the live A/B page.

Prometheus counters and histograms answer "how much since start"; the page wants "how did each arm
do over the last few minutes", with exact percentiles. This window keeps, per series (served model
and A/B arm) and per time bin of ``bin_s`` seconds, the raw latencies of the requests seen in that
bin and sums of their tokens and speculation counters; bins older than ``window_s`` are dropped,
so memory is bounded by the window, not by uptime.

What lands in which bin (wall-clock time of the event):
- time to first token: the bin where the first token reached the handler;
- time per output token: the bin where the request finished (its whole-request mean, as the
  Prometheus histogram of the same name);
- generated tokens, draft and accepted tokens, target steps and their committed tokens: the bin
  where each output reached the handler, so tokens/s follows the real rate, not finish times.

It also samples the speculation controller's latest decision (mean k, fraction of sequences that
drafted) at every output of a speculative-arm request; a bin shows the mean of its samples, so
it is the decision the controller made while speculative requests ran (an idle engine decides
nothing, and its bins stay empty).

Not thread-safe: it is fed and read on the server's event loop.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_WINDOW_S = 300.0
DEFAULT_BIN_S = 5.0


@dataclass
class _Bin:
    start: float
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    finished: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_steps: int = 0
    emitted_tokens: int = 0


@dataclass
class _ControllerBin:
    start: float
    mean_k: float = 0.0
    speculating_fraction: float = 0.0
    samples: int = 0


@dataclass(frozen=True)
class ControllerState:
    """The controller's latest decision as the engine publishes it."""

    mean_k: float
    speculating_fraction: float


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least ``q`` percent of the values at or
    below it (None for no values)."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class RollingWindow:
    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        bin_s: float = DEFAULT_BIN_S,
        clock: Callable[[], float] = time.time,
        controller: Callable[[], ControllerState | None] | None = None,
    ) -> None:
        if not (bin_s > 0 and window_s >= bin_s):
            raise ValueError(f"need 0 < bin_s <= window_s, got {bin_s} and {window_s}")
        self.window_s = window_s
        self.bin_s = bin_s
        self.clock = clock
        self.controller = controller
        self._series: dict[tuple[str, str], deque[_Bin]] = {}
        self._controller_bins: deque[_ControllerBin] = deque()

    # ---- feeding (RequestTracker calls these) -----------------------------------------------
    def first_token(self, model: str, arm: str, ttft_s: float) -> None:
        self._bin(model, arm).ttft.append(ttft_s)

    def progress(
        self,
        model: str,
        arm: str,
        new_tokens: int,
        draft_tokens: int,
        accepted_tokens: int,
        target_steps: int,
        emitted_tokens: int,
    ) -> None:
        """Counts of one output (deltas since the request's previous output)."""
        b = self._bin(model, arm)
        b.output_tokens += new_tokens
        b.draft_tokens += draft_tokens
        b.accepted_tokens += accepted_tokens
        b.target_steps += target_steps
        b.emitted_tokens += emitted_tokens
        if arm == "spec":
            self.sample_controller()

    def finished(self, model: str, arm: str, tpot_s: float | None) -> None:
        b = self._bin(model, arm)
        b.finished += 1
        if tpot_s is not None:
            b.tpot.append(tpot_s)

    def sample_controller(self) -> None:
        """Record the controller's latest decision in the current bin."""
        state = self.controller() if self.controller is not None else None
        if state is None:
            return
        now = self.clock()
        start = self._bin_start(now)
        bins = self._controller_bins
        if not bins or bins[-1].start != start:
            bins.append(_ControllerBin(start))
        self._expire(bins, now)
        b = bins[-1]
        b.mean_k += state.mean_k
        b.speculating_fraction += state.speculating_fraction
        b.samples += 1

    # ---- reading ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every series' points (one per non-empty bin, oldest first) and whole-window totals,
        plus the controller's sampled decisions; JSON-ready."""
        now = self.clock()
        series = []
        for (model, arm), bins in sorted(self._series.items()):
            self._expire(bins, now)
            if not bins:
                continue
            points = [self._point(b, self._bin_seconds(b, now)) for b in bins]
            whole = self._merge(bins)
            span = max(self.bin_s, now - bins[0].start)
            series.append(
                {
                    "model": model,
                    "arm": arm,
                    "points": points,
                    "window": self._point(whole, span),
                }
            )
        self._expire(self._controller_bins, now)
        controller = [
            {
                "t": b.start,
                "mean_k": b.mean_k / b.samples,
                "speculating_fraction": b.speculating_fraction / b.samples,
            }
            for b in self._controller_bins
        ]
        return {
            "now": now,
            "window_s": self.window_s,
            "bin_s": self.bin_s,
            "series": series,
            "controller_series": controller,
        }

    # ---- internals --------------------------------------------------------------------------
    def _bin_start(self, now: float) -> float:
        return math.floor(now / self.bin_s) * self.bin_s

    def _bin(self, model: str, arm: str) -> _Bin:
        now = self.clock()
        start = self._bin_start(now)
        bins = self._series.setdefault((model, arm), deque())
        if not bins or bins[-1].start != start:
            bins.append(_Bin(start))
        self._expire(bins, now)
        return bins[-1]

    def _expire(self, bins: deque, now: float) -> None:
        while bins and bins[0].start + self.bin_s <= now - self.window_s:
            bins.popleft()

    def _bin_seconds(self, b: _Bin, now: float) -> float:
        """How long the bin has been collecting: ``bin_s``, or less for the current one."""
        return max(1e-3, min(self.bin_s, now - b.start))

    @staticmethod
    def _merge(bins: deque[_Bin]) -> _Bin:
        total = _Bin(bins[0].start)
        for b in bins:
            total.ttft.extend(b.ttft)
            total.tpot.extend(b.tpot)
            total.finished += b.finished
            total.output_tokens += b.output_tokens
            total.draft_tokens += b.draft_tokens
            total.accepted_tokens += b.accepted_tokens
            total.target_steps += b.target_steps
            total.emitted_tokens += b.emitted_tokens
        return total

    @staticmethod
    def _point(b: _Bin, seconds: float) -> dict[str, Any]:
        return {
            "t": b.start,
            "requests_finished": b.finished,
            "first_tokens": len(b.ttft),
            "ttft_p50": percentile(b.ttft, 50),
            "ttft_p90": percentile(b.ttft, 90),
            "ttft_p99": percentile(b.ttft, 99),
            "tpot_p50": percentile(b.tpot, 50),
            "tpot_p90": percentile(b.tpot, 90),
            "tpot_p99": percentile(b.tpot, 99),
            "output_tokens": b.output_tokens,
            "tokens_per_s": b.output_tokens / seconds,
            "draft_tokens": b.draft_tokens,
            "accepted_tokens": b.accepted_tokens,
            "acceptance_rate": b.accepted_tokens / b.draft_tokens if b.draft_tokens else None,
            "accepted_length": b.emitted_tokens / b.target_steps if b.target_steps else None,
        }
