"""Acceptance estimates: per draft position, engine-wide and per sequence, and of a tree's depths.

``a_j`` is the chance that draft j is accepted given that drafts 1..j-1 were; a verify of k
drafts commits ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` tokens. Engine-wide rates come from
counts decayed by ``ACCEPTANCE_DECAY`` per verify; a sequence's own counts are shrunk towards
them with ``PRIOR_STRENGTH`` pseudo-verifies. A tree's depth j holds with ``a_j + (1 - a_j) s_j``
(``RescueModel``: a runner-up's chance where the first choice fails); docs/controller.md.
"""

from __future__ import annotations

from collections.abc import Sequence

# About 100 verifies: averages out per-step luck, follows a new workload within a few requests.
ACCEPTANCE_DECAY = 0.99
# Pseudo-verifies behind every prior (the initial guess, the engine-wide rates a sequence is
# shrunk towards, a runner-up's chance before any tree ran): requests of one workload differ by
# little more than binomial noise over a few verifies, which this many outweighs.
PRIOR_STRENGTH = 8.0


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
        rates, guess, w = [], self.initial, self.prior_weight
        for hit, n in zip(self.hits, self.judged, strict=True):
            guess = (hit + w * guess) / (n + w) if n + w > 0.0 else guess
            rates.append(guess)  # and the next position's guess
        return rates


class RescueModel:
    """``s_j`` per tree depth: among verifies that reached depth j and rejected the draft's first
    choice there, the share that accepted a runner-up. Before evidence a runner-up is taken to
    hold as often as the first choice does there (``PRIOR_STRENGTH`` pseudo-trials at a_j)."""

    def __init__(self, depth: int) -> None:
        self.hits = [0.0] * depth
        self.trials = [0.0] * depth
        self.version = 0

    def observe(self, depth: int, ranks: Sequence[int]) -> None:
        """One tree verify: ``depth`` levels, the sibling rank of each accepted node."""
        for j in range(min(len(ranks) + 1, depth, len(self.hits))):
            if j == len(ranks) or ranks[j] > 0:  # a runner-up was needed: did one hold?
                self.hits[j] = ACCEPTANCE_DECAY * self.hits[j] + (j < len(ranks))
                self.trials[j] = ACCEPTANCE_DECAY * self.trials[j] + 1.0
        self.version += 1

    def tree_rates(self, chain: Sequence[float], widths: Sequence[int]) -> list[float]:
        """A tree's per-depth rates from the chain's, where depth j holds ``widths[j]`` nodes."""
        return [
            a + (1.0 - a) * (h + PRIOR_STRENGTH * a) / (n + PRIOR_STRENGTH) if w > 1 else a
            for a, h, n, w in zip(chain, self.hits, self.trials, widths, strict=False)
        ]
