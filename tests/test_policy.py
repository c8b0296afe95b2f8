"""The speculation policy's pieces: acceptance estimates, the step cost fit, the goodput choice."""

from __future__ import annotations

import random

import pytest
import torch
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence

from specdec.controller.estimates import (
    AcceptanceModel,
    expected_tokens_table,
    tree_rates,
)
from specdec.controller.policy import (
    EXPLORE_INTERVAL,
    MARGIN,
    AdaptivePolicy,
    DraftStop,
    FixedPolicy,
    PrefillShape,
    SeqOutcome,
    SpecDecision,
    StepObservation,
    _Candidate,
    draft_value,
    drafts_to_continue,
)
from specdec.controller.step_cost import ForwardShape, StepCostModel
from specdec.tree_proposal import GrowingTree, TreeShape, level_widths


def make_seqs(n: int, mode: str = "auto", context: int = 64) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(i, f"r{i}", list(range(context)), SamplingParams(), mode)
        s.num_computed_tokens = context - 1
        s.num_draft_computed_tokens = context - 1
        seqs.append(s)
    return seqs


def test_expected_tokens_table_sums_reach():
    assert expected_tokens_table([0.5, 0.5]) == [1.0, 1.5, 1.75]
    assert expected_tokens_table([]) == [1.0]


def test_acceptance_model_learns_rates_and_carries_unjudged_positions():
    model = AcceptanceModel(4, initial=0.5)
    rng = random.Random(0)
    for _ in range(2000):  # position 1 holds 90% of the time, position 2 60%; k = 2 only
        m = 0
        if rng.random() < 0.9:
            m = 1 + (rng.random() < 0.6)
        model.observe(2, m)
    a = model.rates()
    assert a[0] == pytest.approx(0.9, abs=0.05)
    assert a[1] == pytest.approx(0.6, abs=0.08)
    # Never judged: looks like the deepest measured position, not like the start-up guess.
    assert a[2] == pytest.approx(a[1], abs=0.01) and a[3] == pytest.approx(a[1], abs=0.01)


def test_sequence_estimate_shrinks_towards_engine_wide():
    model = AcceptanceModel(2, initial=0.8)
    prior = model.rates()[0]
    few = model.seq_rates([0, 0], [2, 0])  # two rejections at position 1
    many = model.seq_rates([0, 0], [200, 0])
    assert prior > few[0] > many[0]
    assert many[0] < 0.1  # a long, distinct request follows its own numbers
    assert few[0] > 0.5  # two unlucky verifies move it little


def test_steps_that_verify_nothing_age_the_evidence_back_towards_the_guess():
    model = AcceptanceModel(2, initial=0.8)
    for i in range(60):
        model.observe(1, 1 if i % 3 == 0 else 0)  # a third held
    low, weight = model.rates()[0], model.prior_weight
    assert low < 0.5
    aged = []
    for _ in range(600):
        model.age()
        aged.append(model.rates()[0])
    assert model.prior_weight == weight  # the guess itself does not fade
    assert all(b >= a for a, b in zip([low, *aged], aged, strict=False))
    assert aged[-1] == pytest.approx(0.8, abs=0.02)


def _machine(rows: int, seqs: int, attended: int = 0) -> float:
    """Memory-bound up to 16 rows, then linear: the CPU shape of a decoder forward."""
    return 0.1 + 0.004 * max(0, rows - 16) + 0.001 * seqs + 1e-9 * attended


def test_cost_fit_recovers_a_knee_and_interpolates_unmeasured_rows():
    cost = StepCostModel()
    measured = [(1, 1), (2, 2), (5, 1), (8, 8), (32, 8), (64, 16), (128, 16)]
    for _ in range(20):
        for rows, seqs in measured:
            cost.observe(ForwardShape(rows, seqs), _machine(rows, seqs), [], 0.0)
    for rows, seqs in [(4, 4), (12, 4), (48, 12), (96, 16)]:  # never measured
        assert cost.target_time(ForwardShape(rows, seqs)) == pytest.approx(
            _machine(rows, seqs), rel=0.08
        )


def test_cost_pace_carries_a_slow_spell_to_unmeasured_shapes_and_ignores_a_stall():
    cost = StepCostModel()
    for _ in range(30):
        for rows in (1, 64):
            cost.observe(ForwardShape(rows, 1), _machine(rows, 1), [], 0.0)
    before = cost.target_time(ForwardShape(64, 1))
    for _ in range(20):  # a 30% slow spell while only plain steps run
        cost.observe(ForwardShape(1, 1), 1.3 * _machine(1, 1), [], 0.0)
    assert cost.target_time(ForwardShape(64, 1)) == pytest.approx(1.3 * before, rel=0.05)
    pace = cost.speed
    cost.observe(ForwardShape(1, 1), 10 * _machine(1, 1), [], 0.0)  # one stalled step
    assert cost.speed == pytest.approx(pace, rel=0.02)
    assert cost.target_time(ForwardShape(1, 1)) == pytest.approx(1.3 * _machine(1, 1), rel=0.05)


def test_a_stall_in_a_shape_never_measured_stays_out_of_the_fit():
    # A catch-up read makes most speculative steps' shapes new; a stall in one of them must not
    # price every later draft forward (neither the target's part nor the draft's).
    cost = StepCostModel()
    for _ in range(30):
        for rows in (1, 2, 4, 8):
            cost.observe(ForwardShape(rows, 1), _machine(rows, 1), [ForwardShape(rows, 1)], 0.02)
    draft_before = cost.draft_time([ForwardShape(4, 4)])
    target_before = cost.target_time(ForwardShape(6, 3))
    cost.observe(ForwardShape(6, 3), 10 * _machine(6, 3), [ForwardShape(3, 3)], 0.5)
    assert cost.draft_time([ForwardShape(4, 4)]) == pytest.approx(draft_before, rel=0.05)
    assert cost.target_time(ForwardShape(6, 3)) == pytest.approx(target_before, rel=0.05)
    # A new shape the fit can take (past the rows measured) is a price, not a stall.
    cost.observe(ForwardShape(64, 1), _machine(64, 1), [], 0.0)
    assert cost.target_time(ForwardShape(64, 1)) == pytest.approx(_machine(64, 1), rel=0.05)


def test_start_up_forwards_timed_in_a_busy_spell_stay_out_of_the_fit():
    """A calibration whose middle shapes ran while other work held the cores (3.5x their
    neighbours' times) prices those shapes as the machine runs them, not as the spell did."""
    shapes = [(rows, seqs) for seqs in (1, 4, 8, 16) for rows in (seqs, 2 * seqs, 4 * seqs)]
    spell = {(8, 8), (16, 4), (16, 8)}

    def calibrated(spell_factor: float) -> StepCostModel:
        cost = StepCostModel()
        cost.target.seed(
            [
                ([ForwardShape(r, s)], _machine(r, s) * (spell_factor if (r, s) in spell else 1))
                for r, s in shapes
            ]
        )
        return cost

    busy, quiet = calibrated(3.5), calibrated(1.0)
    for rows, seqs in spell | {(24, 8), (12, 4)}:
        assert busy.target_time(ForwardShape(rows, seqs)) == pytest.approx(
            quiet.target_time(ForwardShape(rows, seqs)), rel=0.05
        )


def test_cost_fit_weighs_relative_errors_so_big_steps_do_not_swamp_small_ones():
    # Per-sequence work that the fit's one per-sequence term cannot carry out to prompt-sized
    # steps: a misfit the fit must place somewhere. In absolute seconds the prompt steps' share of
    # it would outweigh the decodes', whose prices would then miss by up to 20%.
    def machine(rows: int, seqs: int) -> float:
        return 0.05 + 0.0008 * rows + 0.003 * seqs * (rows < 64)

    small = [(4, 1), (4, 4), (16, 4), (16, 16)]
    cost = StepCostModel()
    for _ in range(40):
        for rows, seqs in [*small, (512, 1), (512, 16)]:
            cost.observe(ForwardShape(rows, seqs), machine(rows, seqs), [], 0.0)
    for rows, seqs in small:
        assert cost.target_time(ForwardShape(rows, seqs)) == pytest.approx(
            machine(rows, seqs), rel=0.05
        )


def test_one_catch_up_read_does_not_reprice_the_drafts_sampled_rows():
    # The calibration times bare draft forwards (no sampled rows). A live step whose first draft
    # forward reads hundreds of prompt rows for sampled requests, costlier than the fit
    # extrapolates, must not move a kept-pace draft forward's price: the draft has no term of
    # its own for sampled rows that could take up that misfit.
    cost = StepCostModel()
    calibration = [
        ([ForwardShape(r * s, s, r * s * 32)], 0.008 + 0.0005 * r * s)
        for s in (1, 2, 4, 8)
        for r in (1, 2)
    ]
    calibration += [([ForwardShape(r, 1, r * (32 + r))], 0.008 + 0.0004 * r) for r in (16, 64)]
    cost.draft.seed(calibration)
    kept_pace = [ForwardShape(8, 4, 8 * 150, 4)]
    before = cost.draft_time(kept_pace)
    catch_up = [ForwardShape(505, 4, 4 * 126 * 126, 4), ForwardShape(4, 4, 4 * 130, 4)]
    cost.observe(ForwardShape(8, 4, 8 * 130, 8), 0.1, catch_up, 0.5)
    assert cost.draft_time(kept_pace) == pytest.approx(before, rel=0.25)


def _run(policy, seqs, acceptance: float, draft_cost: float, steps: int, rng) -> list[list[int]]:
    """Steps of a synthetic machine: geometric acceptance, target cost `_machine`, each draft
    forward ``draft_cost`` seconds."""
    decisions = []
    for _ in range(steps):
        decision = policy.decide(seqs, PrefillShape())
        decisions.append(decision.ks)
        outcomes, forwards = [], []
        for s, k in zip(seqs, decision.ks, strict=True):
            m = 0
            while m < k and rng.random() < acceptance:
                m += 1
            outcomes.append(SeqOutcome(k, m))
            s.spec_stats.record(k, m, m + 1)
        kmax = max(decision.ks)
        for f in range(kmax):
            n = sum(1 for k in decision.ks if k > f)
            forwards.append(ForwardShape(n, n))
        rows = sum(1 + k for k in decision.ks)
        policy.observe(
            StepObservation(
                ForwardShape(rows, len(seqs)),
                _machine(rows, len(seqs)),
                forwards,
                draft_cost * len(forwards),
                outcomes,
            )
        )
    return decisions


def test_adaptive_speculates_where_it_pays_and_stays_plain_where_it_does_not():
    rng = random.Random(2)
    cheap = AdaptivePolicy(6, initial_acceptance=0.7, stop_drafts_early=False)
    seqs = make_seqs(1)
    ks = _run(cheap, seqs, acceptance=0.85, draft_cost=0.01, steps=200, rng=rng)
    assert sum(k[0] >= 3 for k in ks[-50:]) >= 45

    dear = AdaptivePolicy(6, initial_acceptance=0.7, stop_drafts_early=False)
    seqs = make_seqs(1)
    ks = _run(dear, seqs, acceptance=0.2, draft_cost=0.08, steps=200, rng=rng)
    assert sum(k[0] == 0 for k in ks[-50:]) >= 48  # exploration may run the runner-up once


def test_plain_decode_held_on_poor_acceptance_tries_drafting_again_in_time():
    # Plain decode measures no acceptance, and a one-step exploration adds little to firm
    # evidence: without ageing, poor verifies early on (one request's, say) could hold plain
    # for every request after them.
    for seed in range(3):
        rng = random.Random(seed)
        policy = AdaptivePolicy(6, initial_acceptance=0.7, stop_drafts_early=False)
        for i in range(40):
            policy.acceptance.observe(1, int(i % 5 == 0))
        ks = _run(policy, make_seqs(1), acceptance=0.9, draft_cost=0.05, steps=500, rng=rng)
        assert not any(k[0] for k in ks[:32])
        assert all(k[0] for k in ks[-100:])


def test_adaptive_goes_plain_for_a_large_batch_on_a_compute_bound_machine():
    rng = random.Random(3)
    policy = AdaptivePolicy(6, initial_acceptance=0.7, stop_drafts_early=False)
    seqs = make_seqs(64)
    ks = _run(policy, seqs, acceptance=0.6, draft_cost=0.05, steps=150, rng=rng)
    # Apart from at most one exploration step, every sequence decodes plain.
    assert sum(1 for step in ks[-40:] if any(step)) <= 1


def test_pinned_modes_and_fixed_policy():
    seqs = make_seqs(3)
    seqs[0].spec_mode, seqs[1].spec_mode = "on", "off"
    policy = AdaptivePolicy(5, initial_acceptance=0.7)
    ks = policy.decide(seqs, PrefillShape()).ks
    assert ks[0] == 5 and ks[1] == 0
    assert FixedPolicy(3).decide(seqs, PrefillShape()).ks == [3, 0, 3]


def test_queued_prefills_push_towards_shorter_steps():
    def chosen(prefill: PrefillShape) -> int:
        policy = AdaptivePolicy(6, initial_acceptance=0.6, stop_drafts_early=False)
        for _ in range(12):
            for rows in (1, 7, 64, 256):
                policy.cost.observe(ForwardShape(rows, 1), 0.1 + 0.001 * rows, [], 0.0)
            policy.cost.observe(ForwardShape(1, 1), 0.1, [ForwardShape(1, 1)], 0.05)
        return policy.decide(make_seqs(1), prefill).ks[0]

    assert chosen(PrefillShape()) > 0
    assert chosen(PrefillShape(rows=256, seqs=4, attended=256 * 128)) == 0


def test_hysteresis_holds_a_decision_against_small_changes_and_exploration_runs_the_runner_up():
    rng = random.Random(4)
    policy = AdaptivePolicy(6, initial_acceptance=0.7, stop_drafts_early=False)
    seqs = make_seqs(2)
    ks = _run(policy, seqs, acceptance=0.8, draft_cost=0.02, steps=3 * EXPLORE_INTERVAL, rng=rng)
    tail = ks[EXPLORE_INTERVAL:]
    switches = sum(1 for a, b in zip(tail, tail[1:], strict=False) if a != b)
    # An exploration step switches away and back once per interval; a held decision otherwise
    # changes at most a couple of times as the estimates settle.
    assert switches <= 2 * len(tail) // EXPLORE_INTERVAL + 2


def test_an_exploration_trial_is_charged_its_drafts_whole_catch_up():
    """A trial runs for one step, so a draft that must first read a long unread history makes it
    dear, however cheap that history would be spread over the sequence's remaining steps."""

    def explores(lag: int) -> bool:
        # Drafting priced 6% below plain: outside the tie margin, inside the trial band.
        decisions = _explore_decisions(initial_acceptance=0.25, lag=lag, steps=EXPLORE_INTERVAL + 1)
        assert not any(decisions[0])  # plain is held; speculation is a plausible runner-up
        return any(any(ks) for ks in decisions)

    assert explores(lag=1)
    assert not explores(lag=1000)


def test_exploration_breaks_a_tie_towards_the_draft_length_not_being_measured():
    """Drafting priced within the margin of the held plain decision (its lag spread over the
    sequence's steps, as for any kept decision) becomes the held decision at an exploration step,
    so that its acceptance gets measured; a one-step trial would have paid the whole lag."""
    decisions = _explore_decisions(initial_acceptance=0.35, lag=1000, steps=EXPLORE_INTERVAL + 3)
    assert not any(decisions[0])
    assert all(any(ks) for ks in decisions[-3:])  # held from the exploration step on


def test_the_first_decode_only_step_takes_the_best_candidate_outright():
    """Plain decode held through the prompts was never chosen, so the band does not guard it:
    drafting priced above plain by less than the margin drafts from the first decode-only step
    on. The same prices after a decision was made keep that decision."""
    seqs = make_seqs(1, context=1024)
    seqs[0].params = SamplingParams(max_tokens=3000)
    for acceptance in (0.30 + 0.01 * i for i in range(40)):
        policy = _priced_policy(acceptance)
        plain = policy._evaluate_held(seqs, [0], policy._tables(seqs), [0], PrefillShape())
        decision = policy.decide(seqs, PrefillShape())
        if any(decision.ks):
            break
    assert decision.predicted_goodput < (1.0 + MARGIN) * plain.goodput  # inside the band
    assert all(any(policy.decide(seqs, PrefillShape()).ks) for _ in range(5))

    policy = _priced_policy(acceptance)
    seqs[0].num_draft_computed_tokens = 24  # a lag of 1000 to repay within two tokens
    seqs[0].params = SamplingParams(max_tokens=2)
    assert not any(policy.decide(seqs, PrefillShape()).ks)  # plain, chosen on evidence
    seqs[0].num_draft_computed_tokens = 1023
    seqs[0].params = SamplingParams(max_tokens=3000)
    assert not any(any(policy.decide(seqs, PrefillShape()).ks) for _ in range(5))


def test_a_step_with_prompt_chunks_starts_no_lagging_draft():
    """A lagging draft's catch-up is priced spread over the sequence's steps, which next to a
    step's prompt chunks looks cheap whatever it costs: only a decode-only step starts it. A
    draft that kept pace drafts in such a step as the held decision says."""
    policy = _priced_policy(0.9)
    seqs = make_seqs(2, context=256)
    for s in seqs:
        s.params = SamplingParams(max_tokens=3000)
    assert all(policy.decide(seqs, PrefillShape()).ks)  # drafting held for both
    seqs[1].num_draft_computed_tokens = 256 - 40
    prompt = PrefillShape(rows=64, seqs=1, attended=64 * 64)
    ks = policy.decide(seqs, prompt).ks
    assert ks[0] > 0 and ks[1] == 0
    assert all(policy.decide(seqs, PrefillShape()).ks)
    seqs[1].num_draft_computed_tokens = 256 - 40
    lookup = AdaptivePolicy(6, initial_acceptance=0.9, has_draft_model=False)
    assert all(lookup.decide(seqs, PrefillShape()).ks)
    assert all(lookup.decide(seqs, prompt).ks)  # a lookup proposer reads no history


def _priced_policy(initial_acceptance: float) -> AdaptivePolicy:
    """A policy on a machine where a draft forward costs 30% of a target forward."""
    policy = AdaptivePolicy(6, initial_acceptance=initial_acceptance, stop_drafts_early=False)
    for _ in range(12):
        for rows in (1, 2, 4, 8, 16, 64):
            draft = [ForwardShape(rows, 1)]
            policy.cost.observe(
                ForwardShape(rows, 1), 0.1 + 0.004 * rows, draft, 0.03 + 0.0005 * rows
            )
    return policy


def _explore_decisions(initial_acceptance: float, lag: int, steps: int) -> list[list[int]]:
    """Decisions over ``steps`` steps for one sequence 1024 tokens in whose draft lags by ``lag``,
    on ``_priced_policy``'s machine."""
    policy = _priced_policy(initial_acceptance)
    seqs = make_seqs(1, context=1024)
    seqs[0].num_draft_computed_tokens = 1024 - lag
    seqs[0].params = SamplingParams(max_tokens=2)  # a catch-up to repay within two tokens
    first = policy.decide(seqs, PrefillShape()).ks  # so the first decision is plain, on evidence
    seqs[0].params = SamplingParams(max_tokens=3000)  # spread over ~2,000 steps: ~1 row
    return [first] + [policy.decide(seqs, PrefillShape()).ks for _ in range(steps - 1)]


def test_a_lagging_draft_is_charged_the_seconds_of_its_catch_up_spread_over_its_steps():
    """The draft reads a lag in one forward, so the step is charged that forward's seconds (beyond
    a kept-pace read) divided by the steps the sequence has left, not a few rows' worth of a small
    forward, which a flat cost curve would price at next to nothing."""
    policy = AdaptivePolicy(2, initial_acceptance=0.5, stop_drafts_early=False)
    for _ in range(8):
        for rows in (1, 2, 4, 8, 16, 512, 1024):
            draft_seconds = 0.02 if rows <= 16 else 0.001 * rows  # flat, then per row
            policy.cost.observe(ForwardShape(1, 1), 0.1, [ForwardShape(rows, 1)], draft_seconds)
    seqs = make_seqs(1, context=1024)
    seqs[0].params = SamplingParams(max_tokens=20)  # E(1) = 1.5 tokens a step: 13.3 steps left
    policy.decide(seqs, PrefillShape())  # fills the sequence's E(k) table

    def step_seconds(lag: int) -> float:
        seqs[0].num_draft_computed_tokens = 1024 - lag
        drafting_k1 = _Candidate(1, 1.0, 0.0, 0.0, pinned=[0], drafting=[0])
        return policy._step(seqs, drafting_k1, PrefillShape())[0]

    lag_forward = policy.cost.draft_time([ForwardShape(1000, 1)])
    kept_pace = policy.cost.draft_time([ForwardShape(2, 1)])
    assert lag_forward > 20 * kept_pace  # the fit kept the curve's shape
    extra = step_seconds(1000) - step_seconds(2)
    assert extra == pytest.approx((lag_forward - kept_pace) / (20 / 1.5), rel=0.02)


def test_draft_forwards_are_priced_with_the_keys_they_attend_to():
    """A draft row attends to its sequence's whole context, as a verify row does: a step drafting
    for long sequences is priced dearer by the attention its draft forwards do."""
    policy = AdaptivePolicy(2, initial_acceptance=0.7, stop_drafts_early=False)
    per_pair = 2e-6  # seconds per (query, key) pair in the draft; the target's are free
    for _ in range(8):
        for context in (64, 1024, 4096):
            for rows in (1, 2, 4):
                drafts = [ForwardShape(rows, rows, rows * context)]
                seconds = 0.01 + per_pair * rows * context
                policy.cost.observe(ForwardShape(rows, rows), 0.1, drafts, seconds)

    def step_seconds(context: int) -> float:
        seqs = make_seqs(2, context=context)  # each draft one token behind: kept pace
        policy.decide(seqs, PrefillShape())
        both_k2 = _Candidate(2, 1.0, 0.0, 0.0, pinned=[0, 0], drafting=[0, 1])
        return policy._step(seqs, both_k2, PrefillShape())[0]

    # Forward 0 reads each sequence's last token, forward 1 its first draft: 4 rows in all, each
    # attending to about the whole context.
    expected = per_pair * 4 * (4096 - 64)
    assert step_seconds(4096) - step_seconds(64) == pytest.approx(expected, rel=0.1)


def test_decisions_are_a_function_of_their_inputs():
    def trace(seed: int) -> list[list[int]]:
        policy = AdaptivePolicy(6, initial_acceptance=0.7)
        return _run(policy, make_seqs(4), 0.7, 0.03, 100, random.Random(seed))

    assert trace(5) == trace(5)


def test_draft_value_is_the_chance_the_drafts_so_far_hold_times_the_next_ones():
    stop = DraftStop((0.8, 0.8, 0.8), goodput=10.0, marginal_seconds=(0.1,))
    assert draft_value([0.9, 0.9], 2, stop) == pytest.approx(0.9**2 * 0.8)
    assert draft_value([0.9, 0.2], 2, stop) == pytest.approx(0.9 * 0.2 * 0.8)
    assert draft_value([], 0, stop) == pytest.approx(0.8)


def test_a_draft_forward_runs_only_if_the_sequences_in_it_pay_for_it_together():
    # One more position: a 0.1 s draft forward whatever its rows, plus 1 ms a sequence.
    marginal = tuple(0.1 + 0.001 * m for m in range(1, 9))
    stop = DraftStop((0.9,) * 6, goodput=10.0, marginal_seconds=marginal)
    assert drafts_to_continue([0.9], 0, stop) == 0  # 0.9 tokens < 10 tok/s * 0.101 s
    assert drafts_to_continue([0.9] * 8, 0, stop) == 8  # 7.2 tokens > 10 * 0.108
    assert drafts_to_continue([0.9, 0.9, 0.005], 0, stop) == 2  # the unsure one is not worth 1 ms
    assert drafts_to_continue([0.9], 1, stop) == 1  # a pinned sequence pays the forward already
    assert drafts_to_continue([], 0, stop) == 0


def test_adaptive_draft_stop_keeps_sure_drafts_going_within_the_chosen_k():
    policy = AdaptivePolicy(6, initial_acceptance=0.7)
    rng = random.Random(6)
    seqs = make_seqs(1)
    _run(policy, seqs, acceptance=0.85, draft_cost=0.01, steps=60, rng=rng)
    decision = policy.decide(seqs, PrefillShape())
    assert decision.ks[0] >= 3 and decision.stop is not None
    sure = draft_value([0.99] * 2, 2, decision.stop)
    assert drafts_to_continue([sure], 0, decision.stop) == 1  # sure drafts go on to the cap
    assert drafts_to_continue([0.01], 0, decision.stop) == 0  # a hopeless one stops


def test_the_proposer_never_drafts_past_the_chosen_k():
    from tiny_models import make_engine, noisy_copy, tiny_hf_model

    target = tiny_hf_model(seed=0)
    engine = make_engine(target, noisy_copy(target, 0.01), num_speculative_tokens=6)
    stop = DraftStop((0.99,) * 6, 0.0, (0.0,))  # always go on

    class CapAtTwo:
        def decide(self, seqs, prefill):
            return SpecDecision([2] * len(seqs), stop)

        def observe(self, obs):
            pass

        def stats(self):
            return {}

    engine.policy = CapAtTwo()
    out = engine.generate([[3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert len(out.spec_stats.drafted_per_pos) == 2


# ---- token trees ------------------------------------------------------------------------------


class _Prices(StepCostModel):
    """Fixed prices: a target forward costs ``base`` plus ``per_row`` a row, a draft forward
    ``draft`` seconds; nothing is learned."""

    def __init__(self, per_row: float, base: float = 0.1, draft: float = 0.005) -> None:
        super().__init__()
        self.per_row, self.base, self.draft = per_row, base, draft

    def target_time(self, shape: ForwardShape) -> float:
        return self.base + self.per_row * shape.rows

    def draft_time(self, forwards) -> float:
        return self.draft * len(forwards)

    def observe(self, *args) -> None:
        pass


def _tree_policy(per_row: float, acceptance: float = 0.6, rescue: float = 0.8) -> AdaptivePolicy:
    """Trees of 16 nodes (dynamic growth), chain acceptance ``acceptance`` at every depth, and
    tree verifies that carried a share ``rescue`` of the first choice's failures at every depth,
    as many verifies would have taught it."""
    policy = AdaptivePolicy(
        4, initial_acceptance=acceptance, cost=_Prices(per_row), stop_drafts_early=False,
        tree_nodes=16, tree_widths=lambda k: level_widths(16, k, TreeShape()),
    )  # fmt: skip
    trees = policy.tree_acceptance
    trees.judged = [1000.0] * 4
    trees.hits = [1000.0 * (acceptance + (1.0 - acceptance) * rescue)] * 4
    trees.version += 1
    return policy


def test_tree_rates_price_what_tree_verifies_carried_beyond_the_chain():
    engine = [0.9, 0.5, 0.5]
    fresh = AcceptanceModel(3, 0.7)
    # No tree verify yet: a runner-up is taken to hold as often as the first choice.
    assert tree_rates(engine, engine, fresh, [4, 4, 4]) == pytest.approx(
        [0.9 + 0.1 * 0.9, 0.5 + 0.5 * 0.5, 0.5 + 0.5 * 0.5]
    )
    trees = AcceptanceModel(3, 0.7)
    for _ in range(500):
        trees.observe(3, 2)  # every tree verify held at depths 0 and 1, never at depth 2
    rates = tree_rates(engine, engine, trees, [4, 4, 4])  # the prior still weighs 8 of ~108
    assert rates[0] == pytest.approx(1.0, abs=0.025)
    assert rates[1] == pytest.approx(1.0, abs=0.025)  # every failure at depth 1 was carried
    assert rates[2] == pytest.approx(0.5)  # none at depth 2: the chain's rate, no less
    assert tree_rates(engine, engine, trees, [4, 1])[1] == 0.5  # one node: no runner-up
    # A sequence whose own chain rate is lower gains the same share of its failures.
    carried = (rates[1] - 0.5) / 0.5
    assert tree_rates([0.9, 0.2], engine, trees, [4, 4])[1] == pytest.approx(0.2 + 0.8 * carried)


def test_tree_verifies_that_hold_no_more_than_chains_price_no_rescue():
    """A runner-up that holds but whose path then ends (no children grown below it) carries
    nothing: tree verifies measured at the chain's own rates price the tree as the chain."""
    engine = [0.8, 0.6]
    trees = AcceptanceModel(2, 0.7)
    trees.judged, trees.hits = [1000.0, 1000.0], [800.0, 600.0]  # held at the chain's rates
    assert tree_rates(engine, engine, trees, [4, 4]) == pytest.approx(engine, abs=0.01)


def test_adaptive_prices_trees_against_chains_by_their_rows_and_rescues():
    seqs = make_seqs(1)
    tree = _tree_policy(per_row=0.001).decide(seqs, PrefillShape())
    assert tree.tree_nodes == [16] and tree.stop is None
    dear = _tree_policy(per_row=0.02).decide(seqs, PrefillShape())
    assert dear.tree_nodes is None and dear.ks[0] > 0  # a chain: 16 rows cost more than they add
    rare = _tree_policy(per_row=0.001, rescue=0.05).decide(seqs, PrefillShape())
    assert rare.tree_nodes is None and rare.ks[0] > 0  # runners-up seldom hold: not worth rows


def test_adaptive_trees_shrink_to_chains_then_plain_as_the_batch_grows():
    """Rows that cost little one at a time add up: the same prices draft a tree for one
    sequence, chains for eight and nothing for a large batch."""
    chosen = {}
    for n in (1, 8, 128):
        d = _tree_policy(per_row=0.002).decide(make_seqs(n), PrefillShape())
        chosen[n] = (
            "tree" if d.tree_nodes and any(d.tree_nodes) else "chain" if any(d.ks) else "plain"
        )
    assert chosen == {1: "tree", 8: "chain", 128: "plain"}


def test_a_tree_verify_teaches_chain_acceptance_its_first_choices_only():
    policy = _tree_policy(per_row=0.001)
    before = policy.acceptance.rates()[1]
    outcome = SeqOutcome(4, 4, tree_ranks=[0, 1, 1, 0])  # four accepted, two by runners-up
    for _ in range(50):
        policy.observe(StepObservation(ForwardShape(17, 1), 0.1, [], 0.0, [outcome]))
    rates = policy.acceptance.rates()
    assert rates[0] > 0.9 and rates[1] < before  # depth 1's first choice kept failing


@pytest.mark.parametrize("growth, branching", [("dynamic", 2), ("static", 2), ("static", 3)])
@pytest.mark.parametrize("nodes, depth", [(8, 4), (16, 5), (16, 2), (3, 4)])
def test_level_widths_are_the_levels_a_tree_grows(growth, branching, nodes, depth):
    shape = TreeShape(growth, branching)
    seq = make_seqs(1)[0]
    seq.params = SamplingParams(temperature=0.0)
    tree = GrowingTree(seq, depth, nodes, 50, shape)
    gen = torch.Generator().manual_seed(0)
    frontier = 1
    while not tree.done:
        tree.grow(torch.randn(frontier, 50, generator=gen), None)
        frontier = len(tree._level)
    depths = tree.tree.depths
    grown = [sum(1 for d in depths if d == level) for level in range(1, depth + 1)]
    assert level_widths(nodes, depth, shape) == [w for w in grown if w]
