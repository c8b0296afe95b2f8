"""Acceptance estimates: per sequence, per draft position, as decayed averages with a prior.

Positions are *conditional*: ``a_j`` is the chance that draft j is accepted given that drafts
1..j-1 were. A verify of k drafts with m accepted observes positions 1..m as accepted and, when
m < k, position m+1 as rejected; later positions were never judged and are left alone. Expected
tokens committed by one verify of k drafts (the bonus or corrected token included)::

    E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i        (= (1 - a^(k+1)) / (1 - a) when all a_i = a)

Each estimate is a decayed count ratio with pseudo-counts at a guess::

    a_j = (hits_j + m * guess_j) / (trials_j + m)

where hits/trials decay by a factor per verify (an exponential moving average that knows how much
data it holds; positions not reached by a verify decay too, so stale evidence fades).

The engine-wide estimate per proposer (the prior) guesses ``initial`` at position 1 and, past it,
its own estimate one position earlier, so a position no verify has reached lately looks like the
deepest one measured, neither stuck at an old value nor at the start-up value.

A sequence's guess at position j is the prior at position j, and its strength ``m`` is chosen
from the data: for every verify, each candidate strength is scored by how well the estimate it
gives would have predicted the positions that verify judged (a decayed Brier score), and the best
scoring one is used. When sequences differ in acceptance for long stretches, small strengths
predict better and each sequence follows its own numbers; when they do not (one workload, or
sampled text whose per-step acceptance is mostly luck), large strengths win and a sequence stays
near the engine's average instead of chasing its last few verifies. Chasing them is costly: a
controller that drafts deep after a lucky streak finds acceptance back at the average (the
estimate it chose on was the high end of its noise), and one that stops drafting after two early
rejections gives up tokens it would have had.
"""

from __future__ import annotations

from collections.abc import Sequence

_MAX_ACCEPTANCE = 0.999  # an estimate never claims certainty: one rejection must still count


def _clip(a: float) -> float:
    return min(max(a, 0.0), _MAX_ACCEPTANCE)


class PositionCounts:
    """Decayed (hits, trials) per draft position (plain lists: k_max is at most 16)."""

    def __init__(self, k_max: int, decay: float) -> None:
        self.decay = decay
        self.hits = [0.0] * k_max
        self.trials = [0.0] * k_max

    def update(self, num_drafted: int, num_accepted: int) -> None:
        # Every position ages on every verify, judged or not: evidence about a position the
        # sequence no longer drafts to fades back to the guess instead of freezing forever.
        hits, trials, decay = self.hits, self.trials, self.decay
        judged = min(num_accepted + 1, num_drafted, len(hits))
        accepted = min(num_accepted, judged)
        for j in range(len(hits)):
            hits[j] = decay * hits[j] + (1.0 if j < accepted else 0.0)
            trials[j] = decay * trials[j] + (1.0 if j < judged else 0.0)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) above for conditional per-position acceptance ``acceptance`` (length >= k)."""
    return expected_tokens_table(acceptance[:k])[-1]


def expected_tokens_table(acceptance: Sequence[float]) -> list[float]:
    """[len + 1]: E(0), E(1), ..., E(len(acceptance))."""
    table, reach, total = [1.0], 1.0, 1.0
    for a in acceptance:
        reach *= a  # chance that every draft up to this one is accepted
        total += reach
        table.append(total)
    return table


# Strengths a sequence's estimate may use (pseudo-counts of the prior's guess); the tracker uses
# the one that has predicted judged positions best lately. A sequence's counts hold about ten
# verifies (decay 0.9), so these run from "mostly its own data" to "mostly the engine's".
STRENGTHS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


class StrengthSelector:
    """Decayed Brier score per candidate strength of the estimates it would have given.

    Before any verify is scored (and on ties) ``default`` is used.
    """

    def __init__(self, candidates: Sequence[float], default: float, decay: float) -> None:
        if default not in candidates:
            raise ValueError(f"default strength {default} is not among {tuple(candidates)}")
        self.candidates = tuple(candidates)
        self.decay = decay
        self.loss = [0.0] * len(self.candidates)
        self._default = self.candidates.index(default)
        self.best = self._default

    @property
    def strength(self) -> float:
        return self.candidates[self.best]

    def score(
        self, counts: PositionCounts | None, prior: list[float], judged: int, accepted: int
    ) -> None:
        """Score every candidate on one verify that judged positions 1..``judged`` of which the
        first ``accepted`` held, from the sequence's ``counts`` before that verify."""
        # Runs for every verify of every sequence, on the step's critical path: plain loops over
        # the judged positions only, the clip spelled out (counts and prior are >= 0).
        hits = counts.hits[:judged] if counts else [0.0] * judged
        trials = counts.trials[:judged] if counts else [0.0] * judged
        outcomes = [1.0] * accepted + [0.0] * (judged - accepted)
        judged_prior = prior[:judged]
        loss, decay = self.loss, self.decay
        best = self._default
        for c, m in enumerate(self.candidates):
            err = 0.0
            for h, t, p, y in zip(hits, trials, judged_prior, outcomes, strict=True):
                a = (h + m * p) / (t + m)
                if a > _MAX_ACCEPTANCE:
                    a = _MAX_ACCEPTANCE
                err += (y - a) * (y - a)
            loss[c] = decay * loss[c] + err
        best_loss = loss[best]
        for c, value in enumerate(loss):  # the lowest loss; the default wins ties
            if value < best_loss:
                best, best_loss = c, value
        self.best = best


class AcceptanceTracker:
    """Per-sequence estimates with an engine-wide prior per proposer.

    Args:
        k_max: longest draft tracked.
        proposer: name of the proposer whose prior new sequences inherit.
        initial: prior acceptance per position before any verify was seen.
        seq_decay: per-observation decay of a sequence's counts (0.9: about the last 10 verifies).
        prior_decay: per-observation decay of the engine-wide counts (slower: many sequences;
            about the last hundred verifies, so a change of workload reaches the prior within
            a few requests even at one sequence).
        score_decay: per-observation decay of the strengths' scores: faster than the prior's,
            so that when the workload changes and the prior lags, the weak strengths that
            follow each sequence's own numbers take over until it has caught up.
        prior_strength: pseudo-counts of the prior's guess in the prior's ratios.
        strengths: candidate pseudo-counts of the prior in a sequence's ratios (one value: fixed).
        default_strength: the strength used until the scores choose one.
    """

    def __init__(
        self,
        k_max: int,
        proposer: str = "draft_model",
        initial: float = 0.7,
        seq_decay: float = 0.9,
        prior_decay: float = 0.99,
        score_decay: float = 0.98,
        prior_strength: float = 2.0,
        strengths: Sequence[float] = STRENGTHS,
        default_strength: float = 2.0,
    ) -> None:
        self.k_max = k_max
        self.proposer = proposer
        self.initial = initial
        self.seq_decay = seq_decay
        self.prior_decay = prior_decay
        self.prior_strength = prior_strength
        self.strengths = StrengthSelector(strengths, default_strength, score_decay)
        self._priors: dict[str, PositionCounts] = {}
        self._seqs: dict[int, PositionCounts] = {}
        # Bumped whenever an estimate can change (observe, forget): callers may cache estimates
        # computed under one version for as long as it holds.
        self.version = 0

    @property
    def strength(self) -> float:
        """Pseudo-counts of the prior in a sequence's estimate, as scored best lately."""
        return self.strengths.strength

    def _prior_counts(self, proposer: str) -> PositionCounts:
        if proposer not in self._priors:
            self._priors[proposer] = PositionCounts(self.k_max, self.prior_decay)
        return self._priors[proposer]

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """Record one verify of ``num_drafted`` drafts of which the first ``num_accepted`` held."""
        if num_drafted <= 0:
            return
        self.version += 1
        counts = self._seqs.get(seq_id)
        judged = min(num_accepted + 1, num_drafted, self.k_max)
        self.strengths.score(counts, self.prior(), judged, min(num_accepted, judged))
        if counts is None:
            counts = self._seqs[seq_id] = PositionCounts(self.k_max, self.seq_decay)
        counts.update(num_drafted, num_accepted)
        self._prior_counts(self.proposer).update(num_drafted, num_accepted)

    def prior(self) -> list[float]:
        """[k_max] engine-wide conditional acceptance per position for this proposer.

        Position 1's guess is ``initial``; position j's is the estimate at j-1, so a position no
        verify has reached yet looks like the deepest one measured rather than like a constant.
        """
        counts = self._prior_counts(self.proposer)
        est, guess, m = [], self.initial, self.prior_strength
        for hits, trials in zip(counts.hits, counts.trials, strict=True):
            guess = (hits + m * guess) / (trials + m)
            est.append(_clip(guess))
        return est

    def estimate(self, seq_id: int, prior: list[float] | None = None) -> list[float]:
        """[k_max] conditional acceptance per position for one sequence (``prior``: a cached
        ``self.prior()``, so a batch computes it once)."""
        prior = self.prior() if prior is None else prior
        counts = self._seqs.get(seq_id)
        if counts is None:
            return list(prior)
        m = self.strength
        return [
            _clip((hits + m * guess) / (trials + m))
            for hits, trials, guess in zip(counts.hits, counts.trials, prior, strict=True)
        ]

    def expected_table(self, seq_id: int, prior: list[float], room: int) -> list[float]:
        """``expected_tokens_table(self.estimate(seq_id, prior)[:room])``, the same arithmetic in
        one loop (the controller asks it for every sequence every step)."""
        counts = self._seqs.get(seq_id)
        table, reach, total = [1.0], 1.0, 1.0
        if counts is None:
            for a in prior[:room]:
                reach *= a
                total += reach
                table.append(total)
            return table
        m = self.strength
        for hits, trials, guess in zip(
            counts.hits[:room], counts.trials[:room], prior, strict=False
        ):
            a = (hits + m * guess) / (trials + m)
            if a < 0.0:  # _clip, spelled out: max(a, 0.0), then min(..., _MAX_ACCEPTANCE)
                a = 0.0
            if a > _MAX_ACCEPTANCE:
                a = _MAX_ACCEPTANCE
            reach *= a
            total += reach
            table.append(total)
        return table

    def has_prior_data(self) -> bool:
        """Whether any verify of this proposer was seen (else the prior is ``initial`` alone)."""
        counts = self._priors.get(self.proposer)
        return counts is not None and counts.trials[0] > 0.0

    def num_trials(self, seq_id: int) -> float:
        counts = self._seqs.get(seq_id)
        return float(counts.trials[0]) if counts is not None else 0.0

    def forget(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self.version += 1

    def tracked(self) -> list[int]:
        return list(self._seqs)
