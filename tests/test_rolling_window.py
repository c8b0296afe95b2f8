"""The rolling window behind /dashboard/data, on a fake clock."""

from __future__ import annotations

import pytest
from specdec.api.rolling_window import ControllerState, RollingWindow, percentile


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(10, 0, -1)]
    assert percentile(values, 50) == 5.0
    assert percentile(values, 90) == 9.0
    assert percentile(values, 99) == 10.0
    assert percentile([2.5], 99) == 2.5
    assert percentile([], 50) is None


def test_bins_per_series_and_rates():
    clock = Clock(1000.0)
    w = RollingWindow(window_s=60, bin_s=5, clock=clock)
    w.first_token("m", "spec", 0.2)
    w.progress("m", "spec", 4, draft_tokens=6, accepted_tokens=3, target_steps=2, emitted_tokens=5)
    w.first_token("m", "plain", 0.1)
    w.progress("m", "plain", 3, draft_tokens=0, accepted_tokens=0, target_steps=3, emitted_tokens=3)
    clock.t = 1003.0
    w.progress("m", "spec", 6, draft_tokens=4, accepted_tokens=4, target_steps=1, emitted_tokens=5)
    w.finished("m", "spec", 0.05)
    clock.t = 1007.0  # next bin
    w.first_token("m", "spec", 0.4)
    w.finished("m", "spec", None)  # a one-token request has no time per output token
    clock.t = 1008.0
    snap = w.snapshot()
    assert (snap["window_s"], snap["bin_s"], snap["now"]) == (60, 5, 1008.0)
    by_arm = {s["arm"]: s for s in snap["series"]}
    assert [s["arm"] for s in snap["series"]] == ["plain", "spec"]
    first, second = by_arm["spec"]["points"]
    assert (first["t"], second["t"]) == (1000.0, 1005.0)
    assert first["output_tokens"] == 10 and first["tokens_per_s"] == 10 / 5
    assert first["acceptance_rate"] == 7 / 10 and first["accepted_length"] == 10 / 3
    assert first["ttft_p50"] == 0.2 and first["tpot_p90"] == 0.05
    assert first["requests_finished"] == 1
    # The current bin has collected for 3 s only.
    assert second["tokens_per_s"] == 0.0 and second["ttft_p99"] == 0.4
    assert second["tpot_p50"] is None and second["acceptance_rate"] is None
    whole = by_arm["spec"]["window"]
    assert whole["requests_finished"] == 2 and whole["ttft_p50"] == 0.2 and whole["ttft_p99"] == 0.4
    assert whole["tokens_per_s"] == 10 / 8  # over the 8 s since the first bin began
    plain = by_arm["plain"]["window"]
    assert plain["acceptance_rate"] is None and plain["accepted_length"] == 1.0


def test_old_bins_expire():
    clock = Clock(1000.0)
    w = RollingWindow(window_s=20, bin_s=5, clock=clock)
    w.first_token("m", "spec", 0.1)
    clock.t = 1012.0
    w.first_token("m", "plain", 0.1)
    clock.t = 1024.0  # the spec bin [1000, 1005) still overlaps the last 20 s
    assert [s["arm"] for s in w.snapshot()["series"]] == ["plain", "spec"]
    clock.t = 1026.0  # now it ended more than 20 s ago
    arms = [s["arm"] for s in w.snapshot()["series"]]
    assert arms == ["plain"]
    clock.t = 1040.0
    assert w.snapshot()["series"] == []


def test_controller_samples_at_speculative_outputs():
    clock = Clock(1000.0)
    state = [ControllerState(6.0, 1.0)]
    w = RollingWindow(window_s=60, bin_s=5, clock=clock, controller=lambda: state[0])
    w.progress("m", "spec", 1, 0, 0, 0, 0)
    w.progress("m", "spec", 1, 0, 0, 0, 0)
    state[0] = ControllerState(0.0, 0.0)
    w.progress("m", "plain", 1, 0, 0, 0, 0)  # plain outputs do not sample
    w.progress("m", "spec", 1, 0, 0, 0, 0)
    clock.t = 1001.0
    state[0] = ControllerState(3.0, 0.5)
    snap = w.snapshot()  # a read does not sample: an idle engine decides nothing
    (point,) = snap["controller_series"]
    assert point == {"t": 1000.0, "mean_k": 4.0, "speculating_fraction": 2 / 3}
    # No policy: nothing is sampled.
    bare = RollingWindow(clock=clock, controller=lambda: None)
    bare.progress("m", "plain", 1, 0, 0, 0, 0)
    assert bare.snapshot()["controller_series"] == []


def test_bad_shape_is_refused():
    with pytest.raises(ValueError):
        RollingWindow(window_s=10, bin_s=0)
    with pytest.raises(ValueError):
        RollingWindow(window_s=1, bin_s=5)
