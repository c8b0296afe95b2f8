"""Acceptance estimates: per draft position, engine-wide and per sequence, and by draft confidence.

``a_j`` is the chance that draft j is accepted given that drafts 1..j-1 were; a verify of k
drafts commits ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` tokens. Engine-wide rates come from
counts decayed by ``ACCEPTANCE_DECAY`` per verify; a sequence's own counts are shrunk towards
them with ``PRIOR_STRENGTH`` pseudo-verifies. ``ConfidenceBins`` maps the draft's probability of
the token it drew to that token's acceptance (docs/controller.md).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

# About 100 verifies: averages out per-step luck, follows a new workload within a few requests.
ACCEPTANCE_DECAY = 0.99
# Pseudo-verifies behind every prior (the initial guess, the engine-wide rates a sequence is
# shrunk towards, the pooled rate behind each confidence bin): requests of one workload differ by
# little more than binomial noise over a few verifies, which this many outweighs.
PRIOR_STRENGTH = 8.0
# Upper edges of the confidence bins, dense near 1 where a draft model's confidences crowd.
CONFIDENCE_EDGES = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def expected_tokens_table(acceptance: Sequence[float]) -> list[float]:
    """``[len + 1]``: E(0), E(1), ..., E(len(acceptance)) for conditional rates."""
    table, reach, total = [1.0], 1.0, 1.0
    for a in acceptance:
        reach *= a  # chance that every draft up to this one is accepted
        total += reach
        table.append(total)
    return table


def judged_positions(num_drafted: int, num_accepted: int) -> int:
    """Positions a verify judged: the accepted ones and the first rejected one, if any."""
    return min(num_accepted + 1, num_drafted)


class AcceptanceModel:
    """Engine-wide conditional acceptance per draft position, and each sequence's estimate."""

    def __init__(self, k_max: int, initial: float) -> None:
        if not 0.0 <= initial < 1.0:
            # Below 1, every estimate shrunk towards it stays below 1: one rejection still counts.
            raise ValueError(f"initial acceptance must be in [0, 1), got {initial}")
        self.k_max = k_max
        self.initial = initial
        self.hits = [0.0] * k_max
        self.judged = [0.0] * k_max
        # The initial guess is a pseudo-observation: it ages with the counts, so that a long run
        # is judged by what it measured, not by the guess it started from.
        self.prior_weight = PRIOR_STRENGTH
        self.version = 0  # moves with every verify observed: estimates derived from it go stale
        self._rates = self._compute_rates()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One verify of ``num_drafted`` drafts of which the first ``num_accepted`` held."""
        if num_drafted <= 0:
            return
        judged = min(judged_positions(num_drafted, num_accepted), self.k_max)
        self.prior_weight *= ACCEPTANCE_DECAY
        for j in range(self.k_max):
            self.hits[j] *= ACCEPTANCE_DECAY
            self.judged[j] *= ACCEPTANCE_DECAY
            if j < judged:
                self.judged[j] += 1.0
                self.hits[j] += 1.0 if j < num_accepted else 0.0
        self.version += 1
        self._rates = self._compute_rates()

    def rates(self) -> list[float]:
        """Engine-wide ``a_1..a_kmax``."""
        return self._rates

    def seq_rates(self, accepted: Sequence[int], judged: Sequence[int]) -> list[float]:
        """A sequence's ``a_1..a_kmax`` from its lifetime (accepted, judged) counts per position,
        shrunk towards the engine-wide rates."""
        out = []
        for j, prior in enumerate(self._rates):
            hit = accepted[j] if j < len(accepted) else 0
            n = judged[j] if j < len(judged) else 0
            out.append((hit + PRIOR_STRENGTH * prior) / (n + PRIOR_STRENGTH))
        return out

    def _compute_rates(self) -> list[float]:
        rates, guess = [], self.initial
        for hit, n in zip(self.hits, self.judged, strict=True):
            w = self.prior_weight
            a = (hit + w * guess) / (n + w) if n + w > 0.0 else guess
            rates.append(a)
            guess = a
        return rates


class ConfidenceBins:
    """Acceptance of a drawn draft token as a function of the draft's probability of it."""

    def __init__(self, initial: float) -> None:
        self.pooled_hits = PRIOR_STRENGTH * initial
        self.pooled_n = PRIOR_STRENGTH
        self.hits = [0.0] * (len(CONFIDENCE_EDGES) + 1)
        self.judged = [0.0] * (len(CONFIDENCE_EDGES) + 1)

    def observe(self, confidences: Sequence[float], num_accepted: int) -> None:
        """The confidences of one verify's drafts; the judged ones update their bins."""
        judged = judged_positions(len(confidences), num_accepted)
        for j in range(judged):
            b = bisect_right(CONFIDENCE_EDGES, confidences[j])
            hit = 1.0 if j < num_accepted else 0.0
            self.hits[b] = ACCEPTANCE_DECAY * self.hits[b] + hit
            self.judged[b] = ACCEPTANCE_DECAY * self.judged[b] + 1.0
            self.pooled_hits = ACCEPTANCE_DECAY * self.pooled_hits + hit
            self.pooled_n = ACCEPTANCE_DECAY * self.pooled_n + 1.0

    def table(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(bin upper edges, acceptance per bin): plain data a proposer can apply."""
        pooled = self.pooled_hits / self.pooled_n
        rates = tuple(
            (h + PRIOR_STRENGTH * pooled) / (n + PRIOR_STRENGTH)
            for h, n in zip(self.hits, self.judged, strict=True)
        )
        return CONFIDENCE_EDGES, rates


def calibrated(table: tuple[Sequence[float], Sequence[float]], confidence: float) -> float:
    """Acceptance of a token drawn with ``confidence``, read off a ``ConfidenceBins.table()``."""
    edges, rates = table
    return rates[bisect_right(edges, confidence)]
