"""The acceptance tracker: per-position estimates, the engine-wide prior, and the strength with
which a sequence's estimate leans on that prior, chosen by how well it predicted."""

from __future__ import annotations

import random

import pytest

from specdec.controller.acceptance import (
    AcceptanceTracker,
    expected_tokens,
    expected_tokens_table,
)

K_MAX = 4


def verify(rng: random.Random, acceptance: list[float], k: int) -> int:
    """Accepted drafts of one verify of ``k`` drafts at conditional ``acceptance`` per position."""
    accepted = 0
    while accepted < k and rng.random() < acceptance[accepted]:
        accepted += 1
    return accepted


def run(
    tracker: AcceptanceTracker,
    acceptance_of: list[list[float]],
    verifies_each: int,
    rng: random.Random,
    first_id: int = 0,
) -> None:
    """Sequences ``first_id``, ``first_id + 1``, ... in turn, one verify of ``K_MAX`` drafts each
    per round, sequence i at conditional acceptance ``acceptance_of[i]``; forgotten after."""
    ids = range(first_id, first_id + len(acceptance_of))
    for _ in range(verifies_each):
        for seq_id, acc in zip(ids, acceptance_of, strict=True):
            tracker.observe(seq_id, K_MAX, verify(rng, acc, K_MAX))
    for seq_id in ids:
        tracker.forget(seq_id)


def test_expected_tokens_matches_the_closed_form() -> None:
    a = 0.7
    for k in range(6):
        assert expected_tokens([a] * 6, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens_table([0.5, 0.5]) == [1.0, 1.5, 1.75]


def test_a_new_sequence_starts_at_the_prior_per_position() -> None:
    """The engine-wide estimate is kept per position (code-like drafts: a deep position accepted
    more often than a shallow one, given that it was reached), and a new sequence inherits it."""
    tracker = AcceptanceTracker(K_MAX, initial=0.7)
    run(tracker, [[0.9, 0.8, 0.85, 0.95]] * 8, 40, random.Random(0))
    prior = tracker.prior()
    assert prior == pytest.approx([0.9, 0.8, 0.85, 0.95], abs=0.05)
    assert tracker.estimate(999) == prior
    table = tracker.expected_table(999, prior, K_MAX)
    assert table == pytest.approx(expected_tokens_table(prior))


def test_a_position_never_reached_looks_like_the_deepest_one_measured() -> None:
    tracker = AcceptanceTracker(K_MAX, initial=0.5)
    rng = random.Random(1)
    for step in range(300):
        tracker.observe(step % 4, 2, verify(rng, [0.9, 0.9], 2))  # k held at 2
    prior = tracker.prior()
    assert prior[2] == pytest.approx(prior[1], abs=0.02)
    assert prior[3] == pytest.approx(prior[1], abs=0.02)


def test_alike_sequences_lean_on_the_prior() -> None:
    """Sequences whose acceptance is the same (a workload of one kind, sampled text whose
    per-verify acceptance is luck) score best with a strong prior: a sequence's two early
    rejections do not turn it into a poor drafter, and a lucky streak does not make it a great
    one."""
    tracker = AcceptanceTracker(K_MAX, initial=0.7)
    rng = random.Random(2)
    for wave in range(10):
        run(tracker, [[0.7] * K_MAX] * 4, 25, rng, first_id=100 * wave)
    assert tracker.strength >= 32
    prior = tracker.prior()
    tracker.observe(7, K_MAX, 0)
    tracker.observe(7, K_MAX, 0)
    # (at the old fixed strength of 2: 0.36)
    assert tracker.estimate(7, prior)[0] > prior[0] - 0.15
    for _ in range(4):
        tracker.observe(8, K_MAX, K_MAX)
    assert tracker.estimate(8, prior)[0] < prior[0] + 0.15  # (at strength 2: 0.88)


def test_different_sequences_follow_their_own_numbers() -> None:
    """Sequences that differ for their whole length (code beside chat) score best with a weak
    prior: each one's estimate moves to its own acceptance."""
    tracker = AcceptanceTracker(K_MAX, initial=0.7)
    rng = random.Random(3)
    for wave in range(10):
        run(tracker, [[0.95] * K_MAX, [0.3] * K_MAX] * 2, 25, rng, first_id=100 * wave)
    assert tracker.strength <= 4
    high, low = [[0.95] * K_MAX] * 2, [[0.3] * K_MAX] * 2
    for _ in range(20):
        for seq_id, acc in enumerate(high + low):
            tracker.observe(seq_id, K_MAX, verify(rng, acc, K_MAX))
    prior = tracker.prior()
    first = [tracker.estimate(i, prior)[0] for i in range(4)]
    assert (first[0] + first[1]) / 2 > 0.85 > prior[0] > 0.5 > (first[2] + first[3]) / 2


def test_the_strength_is_the_default_until_verifies_are_scored() -> None:
    tracker = AcceptanceTracker(K_MAX, default_strength=4.0)
    assert tracker.strength == 4.0
    tracker.observe(0, K_MAX, 2)  # a new sequence's first verify: every strength predicts alike
    assert tracker.strength == 4.0


def test_a_single_strength_is_fixed() -> None:
    tracker = AcceptanceTracker(K_MAX, strengths=(2.0,), default_strength=2.0)
    run(tracker, [[0.7] * K_MAX] * 4, 50, random.Random(4))
    assert tracker.strength == 2.0


def test_a_default_strength_outside_the_candidates_is_refused() -> None:
    with pytest.raises(ValueError, match="default strength"):
        AcceptanceTracker(K_MAX, strengths=(1.0, 8.0), default_strength=2.0)


def test_verifies_bump_the_version_and_forgetting_drops_a_sequence() -> None:
    tracker = AcceptanceTracker(K_MAX)
    v0 = tracker.version
    tracker.observe(0, 0, 0)  # nothing drafted: nothing learned
    assert tracker.version == v0 and tracker.tracked() == []
    tracker.observe(0, 2, 1)
    assert tracker.version == v0 + 1 and tracker.tracked() == [0]
    assert tracker.num_trials(0) == 1.0
    tracker.forget(0)
    assert tracker.tracked() == [] and tracker.version == v0 + 2
    assert tracker.estimate(0) == tracker.prior()


def test_a_change_of_workload_hands_over_to_each_sequences_own_numbers() -> None:
    """After a long run of code (acceptance 0.95) the prior lags a switch to chat (0.6): the
    strong strengths that served the code run now predict worse than weak ones, so the tracker
    turns to weak ones within a few requests, and back to strong ones once the prior caught up."""
    tracker = AcceptanceTracker(K_MAX, initial=0.7)
    rng = random.Random(5)
    for wave in range(10):
        run(tracker, [[0.95] * K_MAX], 40, rng, first_id=wave)
    assert tracker.strength >= 32
    strengths = []
    for wave in range(10):
        run(tracker, [[0.6] * K_MAX], 40, rng, first_id=100 + wave)
        strengths.append(tracker.strength)
    assert min(strengths[:3]) <= 8
    assert strengths[-1] >= 32
    assert tracker.prior()[0] == pytest.approx(0.6, abs=0.1)
