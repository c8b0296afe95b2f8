"""What speculation has paid, measured: committed tokens per second of decode-only steps, per batch
size, plain vs speculating.

The controller decides from predictions (acceptance estimates times a fitted step cost), and it
starts speculating only when the predicted gain clears a bar that covers their errors. Where the
batch has already speculated at this size lately and those steps measured clearly more tokens per
second than its plain steps did, the prediction's errors matter less: the gain was seen, not just
forecast. ``RealizedGoodput`` keeps those measurements so the controller can tell.
"""

from __future__ import annotations

import statistics
from collections import deque


class RealizedGoodput:
    """Recent tokens/s of plain and of speculating decode-only steps, by decode count.

    Args:
        window: newest steps kept per (batch size, plain or speculating).
        max_age: steps older than this many observations do not count (the machine drifts, the
            text changes).
        min_steps: fewer recent steps than this on either side give no verdict.
    """

    def __init__(self, window: int = 32, max_age: int = 512, min_steps: int = 8) -> None:
        self.window = window
        self.max_age = max_age
        self.min_steps = min_steps
        # (decode count, drafted) -> (observation number, tokens / s), newest last
        self._steps: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        self._memo: dict[int, tuple[int, float | None]] = {}  # decode count -> (now, gain)

    def observe(
        self, num_decodes: int, drafted: bool, tokens: int, seconds: float, now: int
    ) -> None:
        """One decode-only step of ``num_decodes`` sequences that committed ``tokens`` in
        ``seconds`` (draft work included); ``drafted``: some sequence verified drafts."""
        if num_decodes <= 0 or seconds <= 0:
            return
        steps = self._steps.get((num_decodes, drafted))
        if steps is None:
            steps = self._steps[(num_decodes, drafted)] = deque(maxlen=self.window)
        steps.append((now, tokens / seconds))
        self._memo.pop(num_decodes, None)

    def gain(self, num_decodes: int, now: int) -> float | None:
        """Median tokens/s of recent speculating steps of exactly ``num_decodes`` decodes over
        that of recent plain ones, minus 1; None unless both sides have ``min_steps``."""
        hit = self._memo.get(num_decodes)
        if hit is not None and hit[0] == now:
            return hit[1]
        rates = []
        for drafted in (False, True):
            steps = self._steps.get((num_decodes, drafted), ())
            recent = [r for t, r in steps if now - t <= self.max_age]
            if len(recent) < self.min_steps:
                rates = []
                break
            rates.append(statistics.median(recent))
        gain = rates[1] / rates[0] - 1.0 if rates else None
        self._memo[num_decodes] = (now, gain)
        return gain
