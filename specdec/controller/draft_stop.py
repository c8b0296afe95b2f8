"""Stopping a draft early: how far each sequence drafts this step, from the draft's confidence.

The controller picks each sequence's k before drafting, from its average acceptance per position.
While the draft runs, every drawn token comes with the draft's own probability of it (its
confidence), and that predicts acceptance far better than an average does. On the default pair,
code at temperature 0, drafts the draft gave 0.8 or more were accepted 97-100% of the time and
those below 0.8 about 70%; a draft forward after an unsure token buys little.

``ConfidenceCalibration`` learns acceptance as a function of confidence online: decayed (accepted,
judged) counts per confidence bin, each bin shrunk towards the pooled rate so a bin with little
data says what the average says. ``continuing`` then applies the controller's own objective
to drafting further. Sequence i's next m drafts are worth ``reach_i * (a_1 + a_1 a_2 + ... )``
expected tokens (the chance its drafts so far all hold, from their calibrated confidences, times
what m more positions add at its per-position acceptance); m more forwards for the n most
valuable cost the draft forwards and the verify rows. Going on pays when, for some m, the tokens
it adds per second it adds beat the step's predicted goodput (what the step commits per second
otherwise): the marginal test that maximising tokens per second of the whole step amounts to.

The output distribution is unchanged. Whether position j+1 is drafted depends only on drafts
1..j and the draft's distributions for them; when position j+1 is judged at all, those drafts
were accepted and are part of the prefix, and the rejection sampler gives the target's
distribution at every position whatever decided the draft length from the prefix. A drawn token
is never dropped because of its own probability: that would change the proposal q it was drawn
from.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

# Upper edges of the confidence bins; the last bin is [0.99, 1]. Dense near 1, where a draft
# model's confidences crowd and where "sure" and "nearly sure" differ most in what they buy.
CONFIDENCE_EDGES = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
_RESCALE_BELOW = 1e-200  # renormalise the lazily decayed counts before they underflow


class ConfidenceCalibration:
    """Acceptance of a draft token as a function of the draft's probability of it.

    Args:
        initial: pooled acceptance assumed before any draft was judged.
        decay: weight kept by older evidence per judged draft (an exponential moving average
            over about ``1 / (1 - decay)`` drafts).
        strength: pseudo-counts pulling each bin towards the pooled rate.
    """

    def __init__(self, initial: float = 0.7, decay: float = 0.998, strength: float = 4.0) -> None:
        if not 0.0 <= initial <= 1.0:
            raise ValueError(f"initial acceptance must be in [0, 1], got {initial}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if strength <= 0.0:
            raise ValueError(f"strength must be positive, got {strength}")
        self.initial = initial
        self.decay = decay
        self.strength = strength
        n = len(CONFIDENCE_EDGES) + 1
        # Counts are stored divided by ``_scale`` (the product of all decays so far): decaying
        # every bin is then one multiplication, whatever the number of bins.
        self._hits = [0.0] * n
        self._trials = [0.0] * n
        self._scale = 1.0
        self.num_judged = 0

    def observe(self, confidences: Sequence[float], num_drafted: int, num_accepted: int) -> None:
        """One verify: drafts 1..num_accepted held and, when fewer than num_drafted, the next one
        was rejected; later drafts were never judged and say nothing."""
        judged = min(num_accepted + 1, num_drafted, len(confidences))
        for j in range(judged):
            self._scale *= self.decay
            if self._scale < _RESCALE_BELOW:
                self._hits = [h * self._scale for h in self._hits]
                self._trials = [t * self._scale for t in self._trials]
                self._scale = 1.0
            b = bisect_right(CONFIDENCE_EDGES, confidences[j])
            w = 1.0 / self._scale
            self._trials[b] += w
            if j < num_accepted:
                self._hits[b] += w
        self.num_judged += judged

    def pooled(self) -> float:
        """Acceptance over all bins, shrunk towards ``initial``."""
        s, m = self._scale, self.strength
        return (s * sum(self._hits) + m * self.initial) / (s * sum(self._trials) + m)

    def acceptance(self, confidence: float, pooled: float | None = None) -> float:
        """Calibrated chance that a draft the draft gave ``confidence`` is accepted."""
        pooled = self.pooled() if pooled is None else pooled
        b = bisect_right(CONFIDENCE_EDGES, confidence)
        s, m = self._scale, self.strength
        return (s * self._hits[b] + m * pooled) / (s * self._trials[b] + m)

    def reach(self, confidences: Sequence[float], pooled: float | None = None) -> float:
        """Chance that every draft so far holds, from their confidences."""
        pooled = self.pooled() if pooled is None else pooled
        out = 1.0
        for c in confidences:
            out *= self.acceptance(c, pooled)
        return out

    def table(self) -> list[float]:
        """Calibrated acceptance per bin, lowest confidence first (for stats and logs)."""
        pooled = self.pooled()
        return [self.acceptance(lo, pooled) for lo in (0.0, *CONFIDENCE_EDGES)]


def continuing(
    gains: Sequence[Sequence[float]], added_seconds: Callable[[int, int], float], goodput: float
) -> list[bool]:
    """Which sequences run one more draft forward: the n most valuable, n chosen by net gain.

    ``gains[i][m - 1]`` is the expected tokens sequence i's next m drafts add; ``added_seconds(n,
    m)`` what m more forwards for n sequences add to the step (draft forwards and verify rows);
    ``goodput`` is what the step commits per second otherwise. The n maximises, over the depths
    m it could go on to, ``sum of the top n gains - goodput * added_seconds(n, m)``; none go on
    when nothing gains. Looking past the next forward matters where one more draft alone does
    not pay but two do: a verify of 5 rows can cost less than one of 4.
    """
    order = sorted(range(len(gains)), key=lambda i: gains[i][0] if gains[i] else 0.0, reverse=True)
    depth = max((len(g) for g in gains), default=0)
    totals = [0.0] * depth
    best_n, best_net = 0, 0.0
    next_n = 1
    for n, i in enumerate(order, 1):
        for m, g in enumerate(gains[i]):
            totals[m] += g
        # Every n up to 4, then about every fourth more, and all of them: pricing is the cost
        # (it runs after every draft forward) and a big batch need not stop to the sequence.
        if n < next_n and n < len(order):
            continue
        next_n = n + max(1, n // 4)
        for m in range(depth):
            net = totals[m] - goodput * added_seconds(n, m + 1)
            if net > best_net:
                best_n, best_net = n, net
    keep = [False] * len(gains)
    for i in order[:best_n]:
        keep[i] = True
    return keep
