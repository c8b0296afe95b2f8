"""Acceptance estimates: per draft position, engine-wide and per sequence, and of a tree's depths.

``a_j`` is the chance that draft j is accepted given that drafts 1..j-1 were; a verify of k
drafts commits ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` tokens. Engine-wide rates come from
counts decayed by ``ACCEPTANCE_DECAY`` per verify and per step that verified nothing; a
sequence's own counts are shrunk towards them with ``PRIOR_STRENGTH`` pseudo-verifies. A tree's
depth j holds with ``a_j + (1 - a_j) s_j`` (``tree_rates``); docs/controller.md.
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
        if num_drafted > 0:
            self.prior_weight *= ACCEPTANCE_DECAY
            # judged: the accepted positions and the first rejected one, if any
            self._fade(min(num_accepted + 1, num_drafted, self.k_max), num_accepted)

    def age(self) -> None:
        """A step that verified nothing: the counts fade as a verify's would and the guess does
        not, so evidence against drafting, which plain decode never renews, gives way to it."""
        self._fade(0, 0)

    def _fade(self, judged: int, num_accepted: int) -> None:
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


def tree_rates(
    chain: Sequence[float], engine: Sequence[float], trees: AcceptanceModel, widths: Sequence[int]
) -> list[float]:
    """A tree's per-depth rates ``a_j + (1 - a_j) s_j`` from a sequence's chain rates ``chain``,
    depth j holding ``widths[j]`` nodes: ``s_j = (T_j - A_j) / (1 - A_j)``, the share of
    first-choice failures that tree verifies (``trees``) carried past depth j, where they held at
    ``T_j`` and chains at the engine-wide ``A_j`` (a rescued path that ends early for want of
    children counts too). Before evidence, ``T_j = A_j + (1 - A_j) A_j`` (``PRIOR_STRENGTH``)."""
    out = []
    for j, (a, w) in enumerate(zip(chain, widths, strict=False)):
        big_a = engine[j] if w > 1 else 1.0
        if big_a >= 1.0:  # one node: no runner-up to count on
            out.append(a)
            continue
        prior = big_a + (1.0 - big_a) * big_a
        held = (trees.hits[j] + PRIOR_STRENGTH * prior) / (trees.judged[j] + PRIOR_STRENGTH)
        out.append(a + (1.0 - a) * min(1.0, max(0.0, (held - big_a) / (1.0 - big_a))))
    return out
