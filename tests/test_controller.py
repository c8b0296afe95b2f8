"""The adaptive speculation controller on synthetic costs and acceptance, and on a tiny engine."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from helpers_controller import simulate
from tiny_models import make_engine, tiny_hf_model

from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from evals.controller_sim import draft_forwards, make_seqs, verify_step
from specdec.controller import (
    AcceptanceTracker,
    AdaptiveController,
    AdaptiveParams,
    CostModel,
    DraftCost,
    TargetCost,
    TargetSample,
    build_controller,
    calibrate,
    expected_tokens,
)
from specdec.controller import adaptive as adaptive_module
from specdec.controller.goodput import BatchGoodput, SeqTerms
from specdec.controller.realized import RealizedGoodput
from specdec.controller_base import SeqOutcome, StepObservation

K_MAX = 4
# A GPU-like step: verify rows almost free up to 64 batched rows, then 1 ms each.
GPU_TARGET = TargetCost(base=0.010, per_seq=1e-4, slope_low=5e-5, knee=64, slope_high=1e-3)
GPU_DRAFT = DraftCost(per_forward=0.002, per_row=1e-5, per_seq=1e-5)


def controller(
    initial: float,
    target: TargetCost = GPU_TARGET,
    draft: DraftCost = GPU_DRAFT,
    **params: float,
) -> AdaptiveController:
    """A controller on known costs. ``plain_first`` is off unless asked for: these tests check
    what a decision is worth on prices taken as given, and it would make every first few
    decisions plain (it has its own tests). So is ``stop_drafts_early``, which hands every
    drafting sequence k_max and lets the draft's confidence stop it (``test_draft_stop``): these
    tests check the k the average acceptance gives."""
    params.setdefault("plain_first", False)
    params.setdefault("stop_drafts_early", False)
    return AdaptiveController(
        K_MAX,
        cost=CostModel(target, draft),
        acceptance=AcceptanceTracker(K_MAX, initial=initial),
        params=AdaptiveParams(**params),
    )


def flat_target(base: float) -> TargetCost:
    """A step that costs ``base`` seconds whatever its rows: verification is free."""
    return TargetCost(base=base, per_seq=0.0, slope_low=0.0, knee=64, slope_high=0.0)


def run_one_seq(
    ctrl: AdaptiveController,
    acceptance: float,
    target: TargetCost,
    draft: DraftCost,
    steps: int,
    seed: int,
    seqs: list | None = None,
) -> AdaptiveController:
    """Run one sequence (``make_seqs(1)`` unless given) at a fixed acceptance; returns ``ctrl``."""
    seqs = seqs or make_seqs(1)
    simulate(ctrl, seqs, lambda s, t: acceptance, target, draft, steps, random.Random(seed))
    return ctrl


def test_expected_tokens_matches_closed_form() -> None:
    for a in (0.0, 0.3, 0.9):
        for k in range(5):
            closed = (1 - a ** (k + 1)) / (1 - a)
            assert expected_tokens([a] * k, k) == pytest.approx(closed)
    assert expected_tokens([0.5, 1.0, 0.0], 3) == pytest.approx(1 + 0.5 + 0.5)


# ---- decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "acceptance, draft_ratio",
    [(0.1, 0.2), (0.3, 0.3), (0.5, 0.6), (0.6, 0.1), (0.8, 0.3), (0.9, 0.2), (0.95, 0.5)],
)
def test_single_sequence_k_maximises_goodput(acceptance: float, draft_ratio: float) -> None:
    """One sequence: k is the argmax of E(k) / (T + k D) computed independently here."""
    base = 0.010
    target = TargetCost(base=base, per_seq=0.0, slope_low=0.0, knee=64, slope_high=0.0)
    draft = DraftCost(per_forward=draft_ratio * base, per_row=0.0, per_seq=0.0)
    ctrl = controller(acceptance, target, draft)
    [k] = ctrl.choose_k(make_seqs(1))

    def goodput(j: int) -> float:
        return (1 - acceptance ** (j + 1)) / (1 - acceptance) / (base + j * draft_ratio * base)

    best = max(range(K_MAX + 1), key=goodput)
    clearly_better = goodput(best) > goodput(0) * (1 + AdaptiveParams().plain_margin)
    assert k == (best if clearly_better else 0)


def test_speculates_only_when_clearly_better_than_plain() -> None:
    """k = 1 would be 4% faster than plain here: within the prediction's errors, so plain. Turned
    off, the margin no longer holds it back; at a higher acceptance (23% faster) it speculates."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0)
    assert controller(0.35, target, draft).choose_k(make_seqs(1)) == [0]
    assert controller(0.35, target, draft, plain_margin=0.0).choose_k(make_seqs(1)) == [1]
    assert controller(0.6, target, draft).choose_k(make_seqs(1))[0] > 0


def test_a_batch_already_speculating_keeps_on_within_the_hysteresis_band() -> None:
    """k = 1 predicted 5% faster than plain: not enough to start (plain_margin 8%), enough to go
    on (plain_keep_margin 2%), so a gain hovering near one bar does not switch speculation on
    and off every few steps. A decision made beside a prefill chunk does not count as being on."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0)
    seqs = make_seqs(1)
    assert controller(0.365, target, draft).choose_k(seqs) == [0]

    def after(first: float, prefill: bool, **params: float) -> list[int]:
        # The fresh tracker below stands for acceptance falling, not for an engine that has
        # seen no verify: no probe for want of data.
        ctrl = controller(first, target, draft, cost_probe_every=10**9, cold_probe=False, **params)
        if prefill:
            ctrl.expect_prefill(40, 1)
        assert ctrl.choose_k(seqs)[0] > 0
        ctrl.acceptance = AcceptanceTracker(K_MAX, initial=0.365)  # the gain falls to 5%
        return ctrl.choose_k(seqs)

    assert after(0.9, prefill=False) == [1]
    assert after(0.9, prefill=False, plain_keep_margin=0.08) == [0]  # no band: off
    assert after(0.9, prefill=True) == [0]


def test_a_new_batch_after_a_speculating_one_must_clear_the_start_bar() -> None:
    """The band is for a batch that is speculating: requests that arrive after the drafting ones
    finished (a new wave) have read nothing into the draft and start at the start bar, whatever
    the last batch did. A batch that keeps one of the drafting sequences is still in the band."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0)

    def second_batch(start: int) -> list[int]:
        ctrl = controller(0.9, target, draft, cost_probe_every=10**9, plain_first=False)
        assert ctrl.choose_k(make_seqs(1))[0] > 0  # the first wave speculates
        ctrl.acceptance = AcceptanceTracker(K_MAX, initial=0.365)  # k = 1 now 5% faster
        return ctrl.choose_k(make_seqs(1, start=start))

    assert second_batch(start=1) == [0]  # a new request: 5% does not clear the 8% start bar
    assert second_batch(start=0) == [1]  # the same request: within the band, it goes on


def measured_plain_then_drafting(
    seqs: list, accepted: int, speculating: bool, **params: object
) -> AdaptiveController:
    """A controller on a 10 ms target step and a 3 ms draft forward that has seen ``seqs[0]``
    run 8 plain decode steps and then 8 that draft one token with ``accepted`` of it accepted,
    priced as the model says; then its acceptance falls to where k = 1 is predicted 5% faster
    than plain. ``speculating``: the controller itself chose those drafts (its acceptance set
    high while they ran), so its batch is speculating; else they overrule its decisions."""
    never = 10**9
    ctrl = controller(
        0.365,
        flat_target(0.010),
        DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0),
        probe_every=never,
        cost_probe_every=never,
        shape_probe_every=never,
        **params,
    )
    for drafted in (0, 1):
        for _ in range(8):
            if drafted and speculating:  # it speculates, whatever the last verify held
                ctrl.acceptance = AcceptanceTracker(K_MAX, initial=0.9)
            chose = ctrl.choose_k(seqs)[0] > 0
            if speculating:
                assert chose == bool(drafted)
            outcome = SeqOutcome(seqs[0], drafted, accepted if drafted else 0)
            t_draft = 0.003 * drafted
            forwards = [(1, 1)] if drafted else []
            ctrl.observe(
                StepObservation(
                    0.010 + t_draft, t_draft, 0.010, 1 + drafted, 1, forwards, [outcome]
                )
            )
    ctrl.acceptance = AcceptanceTracker(K_MAX, initial=0.365)  # k = 1 predicted 5% faster
    return ctrl


def test_a_batch_size_that_measured_speculation_paying_starts_at_the_keep_bar() -> None:
    """k = 1 predicted 5% faster than plain: a new request does not start at the 8% bar. Where
    requests of its batch size ran speculating decode steps lately that measured clearly more
    tokens/s than their plain steps (all drafts accepted: +54%), the gain was seen, not just
    predicted, and it starts at the 2% keep bar. Speculating steps that measured less (no draft
    accepted), the switch off, or steps of an A/B arm ('on' requests) leave the bar at 8%."""

    def new_request_after(accepted: int, mode: str = "auto", **params: object) -> list[int]:
        seqs = make_seqs(1, mode=mode)
        ctrl = measured_plain_then_drafting(seqs, accepted, speculating=False, **params)
        return ctrl.choose_k(make_seqs(1, start=1))

    assert new_request_after(accepted=1) == [1]
    assert new_request_after(accepted=0) == [0]
    assert new_request_after(accepted=1, measured_gain_lowers_start_bar=False) == [0]
    assert new_request_after(accepted=1, mode="on") == [0]


def test_a_speculating_batch_whose_size_measured_a_loss_must_clear_the_start_bar() -> None:
    """A speculating batch goes on while k = 1 is predicted 5% faster than plain (inside the
    band between the 2% keep bar and the 8% start bar). Where its batch size ran speculating
    decode steps lately that measured fewer tokens/s than its plain steps (no draft accepted:
    -23%), the gain predicted inside the band was measured to be a loss: it must clear the start
    bar, and the batch goes plain (counted in the stats). Steps that measured a gain (all
    accepted), or the switch off, keep it speculating."""

    def decision_after(accepted: int, **params: object) -> tuple[list[int], int]:
        seqs = make_seqs(1)
        ctrl = measured_plain_then_drafting(
            seqs, accepted, speculating=True, cold_probe=False, **params
        )
        return ctrl.choose_k(seqs), ctrl.stats()["num_measured_stops"]

    assert decision_after(accepted=1) == ([1], 0)
    assert decision_after(accepted=0) == ([0], 1)  # counted: a stop the measurement made
    assert decision_after(accepted=0, measured_loss_raises_keep_bar=False) == ([1], 0)


def test_a_probes_step_is_not_taken_for_what_speculation_pays() -> None:
    """A probe drafts for one sequence one step, to learn its acceptance: its tokens/s say
    nothing of what speculating the batch pays, so it is not measured as a speculating step
    (else a batch probed now and then would read its probes, mostly losses, as speculation
    losing, or lucky ones as it paying)."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0)
    ctrl = controller(
        0.365,
        target,
        draft,
        probe_every=1,
        probe_max_interval=2,
        probe_budget=1.0,
        cost_probe_every=10**9,
    )
    seqs = make_seqs(1)
    probes = 0
    for _ in range(40):
        drafted = ctrl.choose_k(seqs)[0]
        probes += drafted > 0
        t_draft = 0.003 * (drafted > 0)
        outcome = SeqOutcome(seqs[0], drafted, 0)
        forwards = [(1, 1)] * drafted
        ctrl.observe(
            StepObservation(0.010 + t_draft, t_draft, 0.010, 1 + drafted, 1, forwards, [outcome])
        )
    assert probes >= ctrl.realized.min_steps  # enough probes to give a verdict, were they counted
    assert ctrl.realized.gain(1, ctrl._num_observed) is None


def test_a_step_whose_draft_only_caught_up_is_not_taken_for_a_plain_step() -> None:
    """A sequence whose draft lags more than the token budget reads a chunk of it and decodes
    plainly: that step's time includes a draft forward, so it prices neither arm."""
    ctrl = controller(0.365, flat_target(0.010), cost_probe_every=10**9, probe_every=10**9)
    seqs = make_seqs(1)
    for _ in range(20):
        ctrl.choose_k(seqs)
        catchup = StepObservation(0.060, 0.050, 0.010, 1, 1, [(32, 1)], [SeqOutcome(seqs[0], 0, 0)])
        ctrl.observe(catchup)
    assert (1, False) not in ctrl.realized._steps
    for _ in range(2):
        ctrl.choose_k(seqs)
        ctrl.observe(StepObservation(0.010, 0.0, 0.010, 1, 1, [], [SeqOutcome(seqs[0], 0, 0)]))
    assert len(ctrl.realized._steps[(1, False)]) == 2


def test_realized_goodput_needs_enough_recent_steps_of_that_very_size() -> None:
    realized = RealizedGoodput(window=32, max_age=100, min_steps=8)
    for t in range(7):
        realized.observe(4, False, 4, 0.4, t)  # 10 tokens/s plain
        realized.observe(4, True, 6, 0.5, t)  # 12 tokens/s speculating
        realized.observe(4, True, 6, 0.0, t)  # no time measured: ignored
    assert realized.gain(4, 7) is None  # 7 steps a side
    realized.observe(4, False, 4, 0.4, 7)
    realized.observe(4, True, 6, 0.5, 7)
    assert realized.gain(4, 8) == pytest.approx(0.2)
    assert realized.gain(8, 8) is None  # no steps of 8 decodes
    assert realized.gain(4, 107) is None  # the oldest step is too old: 7 recent ones a side
    realized.observe(4, True, 2, 0.5, 8)  # a slow speculating step: the median moves little
    assert realized.gain(4, 9) == pytest.approx(0.2)


def test_a_long_draft_catch_up_must_pay_off_within_a_few_steps() -> None:
    """Verify rows are free and a draft row costs 5 ms against a 300 ms step (CPU-like): at
    acceptance 0.5 drafting one token is 34% faster than plain once the draft is caught up. A
    sequence whose draft has not read its 400-token prompt would pay two seconds of catch-up for a
    reply that may be cut short by the next decision: spread over 16 steps, that does not pay.
    """
    target = flat_target(0.3)
    draft = DraftCost(per_forward=0.03, per_row=0.005, per_seq=0.0)
    caught_up = make_seqs(1, prompt_len=401)
    assert controller(0.5, target, draft).choose_k(caught_up)[0] > 0
    unread = make_seqs(1, prompt_len=401)
    unread[0].num_draft_computed_tokens = 0
    assert controller(0.5, target, draft).choose_k(unread) == [0]
    # At a high acceptance the same catch-up is worth paying.
    assert controller(0.9, target, draft).choose_k(unread)[0] > 0


def test_decision_inputs_show_the_bar_and_each_uniform_k_with_its_catch_up() -> None:
    """What a trace records beside a decision: a new batch faces the start bar; tokens/s per
    uniform k at the model's prices (k = 0: one token per plain step), the unread prompt's
    catch-up charged to every k > 0 and nothing charged where the draft is caught up."""
    target = flat_target(0.3)
    draft = DraftCost(per_forward=0.03, per_row=0.005, per_seq=0.0)
    for unread in (False, True):
        ctrl = controller(0.5, target, draft)
        seqs = make_seqs(1, prompt_len=401)
        if unread:
            seqs[0].num_draft_computed_tokens = 0
        assert (ctrl.choose_k(seqs)[0] > 0) == (not unread)  # the catch-up does not pay
        weighed = ctrl.decision_inputs(seqs)
        assert weighed["bar"] == AdaptiveParams().plain_margin and weighed["realized_gain"] is None
        plain, one = weighed["goodput_by_k"][:2]
        assert plain == pytest.approx(1 / 0.3)
        (catchup,) = weighed["catchup_s"]
        assert (catchup > 0.1) == unread and catchup >= 0
        rows = 2 if unread else 1  # the first draft forward: the catch-up's usual two rows, or one
        assert one == pytest.approx(1.5 / (0.3 + 0.03 + 0.005 * rows + catchup))


def test_low_acceptance_gives_k0_high_gives_k_positive() -> None:
    # Draft forward = 30% of a target step: at a = 0.2 a draft token costs more than it yields.
    draft = DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0)
    assert controller(0.2, GPU_TARGET, draft).choose_k(make_seqs(4)) == [0, 0, 0, 0]
    ks = controller(0.85, GPU_TARGET, draft).choose_k(make_seqs(4))
    assert all(k > 0 for k in ks)


def test_on_and_off_modes_override_the_objective() -> None:
    low = controller(0.0)
    seqs = make_seqs(2, mode="on") + make_seqs(2, start=2, mode="off")
    assert low.choose_k(seqs) == [K_MAX, K_MAX, 0, 0]
    high = controller(0.95)
    assert high.choose_k(make_seqs(2, mode="off")) == [0, 0]


def test_turns_off_past_the_knee_and_back_on_when_batch_shrinks() -> None:
    """Acceptance stays 0.8 throughout; only the batch size (hence verify cost) changes."""
    rng = random.Random(0)
    ctrl = controller(0.8)
    pool = make_seqs(80)
    small, large = pool[:4], pool

    hist = simulate(ctrl, small, lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 60, rng, noise=0.05)
    assert all(k > 0 for k in hist[-1])
    hist = simulate(ctrl, large, lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 60, rng, noise=0.05)
    # 80 rows already sit past the 64-row knee: every verify row costs 1 ms for 0.8 tokens.
    assert all(k == 0 for ks in hist[-20:] for k in ks)
    assert ctrl.stats()["speculating_fraction"] == 0.0
    hist = simulate(ctrl, small, lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 60, rng, noise=0.05)
    assert all(k > 0 for k in hist[-1])
    assert ctrl.stats()["mean_k"] > 0


def test_partial_speculation_fills_the_cheap_region() -> None:
    """Between the extremes, k's are chosen so the batch stays near the knee, not all or none."""
    ks = controller(0.8).choose_k(make_seqs(20))
    assert 64 - 20 <= sum(ks) + 20 <= 64 + K_MAX
    assert 0 < sum(ks) < K_MAX * 20


def test_known_prefill_rows_replace_the_moving_average() -> None:
    """Right after a burst of prompts is prefilled, the average of recent prefill rows is still
    large. The rows the scheduler says the next step can actually carry decide instead, for that
    one decision."""
    ctrl = controller(0.8)
    ctrl.extra_tokens, ctrl.extra_seqs = 400.0, 8.0  # as left by a step that prefilled 8 prompts
    ctrl.expect_prefill(0, 0)
    fresh = controller(0.8)  # never saw a prefill
    assert ctrl.choose_k(make_seqs(40)) == fresh.choose_k(make_seqs(40, start=100))
    assert ctrl.stats()["predicted_step_time_s"] == pytest.approx(
        fresh.stats()["predicted_step_time_s"]
    )


def test_a_prefill_chunk_does_not_make_verify_rows_look_free() -> None:
    """A big prefill chunk in the step runs whatever the k's; verify rows are priced at what they
    add to it. Past the knee each verify row costs 1 ms for at most 0.6 tokens while a plain decode
    of the same sequences is cheaper per token, so nobody speculates, chunk or no chunk."""
    ctrl = controller(0.6)
    ctrl.expect_prefill(400, 8)
    assert ctrl.choose_k(make_seqs(70)) == [0] * 70
    under_knee = controller(0.6)
    under_knee.expect_prefill(0, 0)
    assert sum(under_knee.choose_k(make_seqs(8))) > 0  # below the knee verify rows are cheap


def test_decodes_beside_a_prefill_chunk_still_speculate_while_verify_rows_are_cheap() -> None:
    """A 40-row chunk keeps the step under the 64-row knee. What plain decodes add to that step is
    tiny, so a ratio of added time would call plain "6000 tokens/s" and never draft beside a
    prefill; priced at what the time commits in a decode-only step, drafting is clearly better."""
    ctrl = controller(0.8, cost_probe_every=10**9)  # no plain cost probe between the two
    seqs = make_seqs(4)
    alone = ctrl.choose_k(seqs)
    assert all(k > 0 for k in alone)
    ctrl.expect_prefill(40, 1)
    assert ctrl.choose_k(seqs) == alone
    # The reported step is the whole step, chunk included, and its goodput is decode tokens over
    # that time (not over what the decodes add).
    s = ctrl.stats()
    whole = ctrl.cost.target_time(40 + 4 + sum(alone), 5)
    assert s["predicted_step_time_s"] > whole
    assert s["predicted_goodput_tokens_per_s"] < 4 * (K_MAX + 1) / whole


def test_a_prefill_chunk_prices_decode_time_at_the_decode_only_rate() -> None:
    """On a CPU-like curve (a draft forward ~40% of a target step) beside a 47-row chunk, one
    sequence's plain row adds 42 ms and drafting 4 adds ~0.6 s for 3.4 more tokens: worth it at
    the ~5.8 tokens/s decode-only rate, which the objective compares against, not at the 24
    tokens/s a ratio of the added time would credit the plain row with."""
    target = TargetCost(base=0.235, per_seq=0.027, slope_low=0.0, knee=8, slope_high=0.015)
    draft = DraftCost(per_forward=0.119, per_row=0.0038, per_seq=0.0009)
    ctrl = controller(0.93, target, draft, plain_margin=0.0)
    ctrl.expect_prefill(47, 1)
    assert ctrl.choose_k(make_seqs(1))[0] > 0
    # A chunk that makes each verify row expensive (past the knee on a GPU-like curve, 20x a
    # row below it) still turns drafting off.
    ctrl = controller(0.8)
    ctrl.expect_prefill(200, 1)
    assert ctrl.choose_k(make_seqs(4)) == [0, 0, 0, 0]


def test_scheduler_reports_the_prefill_rows_the_next_step_can_carry(tiny_pair) -> None:
    target, draft = tiny_pair
    engine = make_engine(target, draft, max_num_seqs=2, max_num_batched_tokens=64)
    assert engine.scheduler.pending_prefill() == (0, 0)
    for i, n in enumerate((40, 40, 50)):
        engine.add_request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4))
    # Two may run at once (max_num_seqs=2): the third prompt waits for a slot and is not counted;
    # the 64-token budget caps the rest.
    assert engine.scheduler.pending_prefill() == (64, 2)
    engine.step()  # prefills the first prompt and a 24-token chunk of the second
    assert engine.scheduler.pending_prefill() == (16, 1)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.pending_prefill() == (0, 0)


def test_without_acceptance_data_the_first_request_is_probed_at_once() -> None:
    """The start-up guess (0.2 here) holds a lone sequence plain. Until some verify was seen
    nothing better is known, so the first request is probed as soon as plain first allows
    rather than on the probe schedule: at its second decision (its first one meets it), or,
    with plain first on, once ``min_measured`` live plain steps priced the plain step."""

    def first_draft(ctrl: AdaptiveController) -> int:
        hist = simulate(
            ctrl, make_seqs(1), lambda s, t: 0.95, GPU_TARGET, GPU_DRAFT, 60, random.Random(5)
        )
        return next(i for i, ks in enumerate(hist) if ks[0] > 0)

    assert first_draft(controller(0.2)) == 1
    assert first_draft(controller(0.2, cold_probe=False)) == 2 * AdaptiveParams().probe_every - 1
    ctrl = controller(0.2, plain_first=True)
    assert first_draft(ctrl) == ctrl.cost.min_measured
    # With acceptance data (an earlier sequence's poor verifies) the schedule applies again: a
    # new sequence held plain waits for a multiple of probe_every after its own probe interval.
    ctrl = controller(0.2)
    for _ in range(5):
        ctrl.acceptance.observe(99, 2, 0)
    assert first_draft(ctrl) >= 2 * ctrl.params.probe_every - 1


def test_reprobing_brings_a_sequence_back_after_its_acceptance_rises() -> None:
    rise_at = 150

    def acceptance(seq, step: int) -> float:
        return 0.95 if seq.seq_id == 0 and step >= rise_at else 0.05

    def run(probe_every: int) -> list[list[int]]:
        rng = random.Random(1)
        ctrl = controller(0.5, probe_every=probe_every)
        seqs = make_seqs(1)
        return simulate(ctrl, seqs, acceptance, GPU_TARGET, GPU_DRAFT, 500, rng, noise=0.05)

    hist = run(probe_every=16)
    assert hist[rise_at - 1][0] == 0  # off while its drafts were bad
    # Back on soon, and staying on (but for the odd plain step that keeps the cost fit honest).
    assert all(ks[0] > 0 for ks in hist[rise_at + 40 : rise_at + 60])
    assert sum(ks[0] > 0 for ks in hist[-100:]) >= 95
    # Without probing nothing new is ever learnt about a sequence at k = 0: it stays off.
    never = run(probe_every=10**9)
    assert all(ks[0] == 0 for ks in never[-20:])


def test_probing_is_skipped_when_verification_cannot_pay() -> None:
    """A batch off because verify rows are expensive is not probed: no draft work for nothing."""
    rng = random.Random(2)
    ctrl = controller(0.05)
    hist = simulate(ctrl, make_seqs(80), lambda s, t: 0.05, GPU_TARGET, GPU_DRAFT, 300, rng)
    assert ctrl.num_probes == 0 and ctrl.num_cost_probes == 0
    assert all(k == 0 for ks in hist for k in ks)


def test_a_probe_must_repay_its_draft_catch_up_within_a_few_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence at k = 0 whose draft has not read its last ~130 tokens (50 ms a draft row): a
    probe would read them all for one step of acceptance data, and most probes end back at
    k = 0. Spread over 8 steps the catch-up rules the probe out; spread over 16, as a decision's
    is, it would probe. A sequence whose draft is nearly caught up is probed."""
    target = flat_target(0.3)
    draft = DraftCost(per_forward=0.03, per_row=0.05, per_seq=0.0)

    def probes(unread: bool) -> int:
        ctrl = controller(0.05, target, draft, cost_probe_every=10**9)
        seqs = make_seqs(1, prompt_len=101)
        if unread:
            seqs[0].num_draft_computed_tokens = 0
        return run_one_seq(ctrl, 0.05, target, draft, 40, seed=7, seqs=seqs).num_probes

    assert probes(unread=True) == 0
    assert probes(unread=False) > 0
    monkeypatch.setattr(
        adaptive_module, "PROBE_PAYBACK_STEPS", adaptive_module.CATCHUP_PAYBACK_STEPS
    )
    assert probes(unread=True) > 0


def test_probing_costs_at_most_about_its_budget() -> None:
    """Waves of eight fresh sequences at a low acceptance on a step where verify rows are free but
    draft rows dear: each wave's probe of all eight reads everything they decoded plainly since
    they joined, several plain steps' worth, and ends back at k = 0. Unbudgeted, those probes cost
    over a tenth of the throughput; within the budget (2% of the time run, plus the first full
    credit) they cost a few percent, and probing still happens."""
    target = flat_target(0.3)
    draft = DraftCost(per_forward=0.02, per_row=0.01, per_seq=0.0)

    def run(**params: float) -> tuple[float, AdaptiveController]:
        # Scheduled probes only: the one probe of the first wave made for want of any
        # acceptance data is not what the budget is about.
        ctrl = controller(0.1, target, draft, cost_probe_every=10**9, cold_probe=False, **params)
        seconds = 0.0
        observe = ctrl.observe

        def timed(obs: StepObservation) -> None:
            nonlocal seconds
            seconds += obs.step_time
            observe(obs)

        ctrl.observe = timed  # type: ignore[method-assign]
        rng, tokens = random.Random(4), 0
        for wave in range(10):
            seqs = make_seqs(8, start=8 * wave)
            simulate(ctrl, seqs, lambda s, t: 0.1, target, draft, 64, rng, 0.1, 64 * wave)
            tokens += sum(s.num_output_tokens for s in seqs)
        return tokens / seconds, ctrl

    never, _ = run(probe_every=10**9)
    budgeted, ctrl = run()
    unbounded, free = run(probe_budget=1e9)
    assert ctrl.num_probes > 0 and ctrl.num_probes_deferred > 0
    assert budgeted >= 0.96 * never
    assert free.num_probes > ctrl.num_probes and unbounded < 0.9 * never


def test_probe_budget_is_earned_only_by_steps_with_auto_sequences() -> None:
    """Steps of 'off' (or 'on') requests alone, such as an A/B arm's, do not pay for probing."""
    ctrl, rng = controller(0.5), random.Random(0)
    simulate(ctrl, make_seqs(2, mode="off"), lambda s, t: 0.5, GPU_TARGET, GPU_DRAFT, 50, rng)
    assert ctrl.stats()["probe_credit_s"] == 0.0
    simulate(ctrl, make_seqs(2, start=2), lambda s, t: 0.5, GPU_TARGET, GPU_DRAFT, 50, rng)
    assert ctrl.stats()["probe_credit_s"] > 0.0


def test_no_probe_for_a_gain_the_decision_would_not_take() -> None:
    """A draft forward 85% of a target step: even at the probe's optimistic acceptance (0.9)
    speculating would be under 3% faster than plain, below the margin the decision asks, so a
    probe (whose draft catch-up is paid at once) would buy nothing. Without the margin it probes."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.0085, per_row=0.0, per_seq=0.0)

    def probes(plain_margin: float) -> int:
        ctrl = controller(0.05, target, draft, plain_margin=plain_margin)
        return run_one_seq(ctrl, 0.05, target, draft, 200, seed=3).num_probes

    assert probes(AdaptiveParams().plain_margin) == 0
    assert probes(0.0) > 0


def test_a_cost_curve_that_flatters_verification_is_corrected_by_measurement() -> None:
    """The prior says verify rows are free; the machine (CPU-like) says 25 ms each past 12 rows.

    A batch that keeps speculating measures only speculating steps; the occasional plain step
    shows the fit what plain costs, and the controller then turns speculation off (plain is
    faster here: 16 rows take 0.48 s, 48 rows 1.3 s for 2.4x the tokens).
    """
    true_target = TargetCost(base=0.30, per_seq=1e-3, slope_low=5e-3, knee=12, slope_high=0.025)
    flat = TargetCost(base=0.30, per_seq=1e-3, slope_low=1e-4, knee=1024, slope_high=1e-4)
    draft = DraftCost(per_forward=0.03, per_row=2e-3, per_seq=1e-3)

    def run(cost_probe_every: int) -> tuple[AdaptiveController, list[list[int]]]:
        ctrl = AdaptiveController(
            K_MAX,
            cost=CostModel(flat, draft),
            acceptance=AcceptanceTracker(K_MAX, initial=0.8),
            params=AdaptiveParams(
                cost_probe_every=cost_probe_every, plain_first=False, stop_drafts_early=False
            ),
        )
        seqs = make_seqs(16)
        hist = simulate(ctrl, seqs, lambda s, t: 0.8, true_target, draft, 200, random.Random(0))
        return ctrl, hist

    ctrl, hist = run(cost_probe_every=32)
    assert any(k > 0 for k in hist[0])  # it starts out believing the prior
    assert ctrl.num_cost_probes >= 1
    assert all(k == 0 for ks in hist[-50:] for k in ks)
    assert ctrl.cost.target.slope_high == pytest.approx(true_target.slope_high, rel=0.2)
    # Without those plain steps the flattering curve is never contradicted.
    _, stuck = run(cost_probe_every=10**9)
    assert all(sum(ks) > 0 for ks in stuck[-50:])


def test_no_flapping_on_noisy_inputs() -> None:
    """Acceptance sits at the on/off threshold and step times carry 10% noise."""
    a = 0.26  # for this cost model k=0 and k=1 are within a few percent of each other

    def run(margin: float) -> AdaptiveController:
        rng = random.Random(1)
        # Held decisions on noisy prices are the subject, not the first probe made for want of
        # acceptance data (which starts the batch drafting at k = 1, a tie with plain here).
        ctrl = controller(a, margin=margin, plain_margin=margin, cold_probe=False)
        simulate(ctrl, make_seqs(8), lambda s, t: a, GPU_TARGET, GPU_DRAFT, 400, rng, noise=0.1)
        return ctrl

    steady = run(margin=0.05)
    # At most two settled changes per sequence in 400 steps (the first decisions are made on the
    # prior's costs; the batch moves once or twice as the measured curve fills in).
    assert steady.num_changes <= 16
    # The scenario is genuinely on the edge: without hysteresis the same inputs flap.
    assert run(margin=0.0).num_changes >= 3 * max(1, steady.num_changes)


# ---- cost model -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "true_target",
    [
        GPU_TARGET,
        # CPU-like: weight reads dominate up to ~16 rows, then the matmuls are compute-bound.
        TargetCost(base=0.25, per_seq=5e-4, slope_low=2e-3, knee=16, slope_high=0.02),
    ],
)
def test_cost_fit_recovers_known_coefficients(true_target: TargetCost) -> None:
    true_draft = DraftCost(per_forward=1.5e-3, per_row=2e-5, per_seq=5e-5)
    rng = np.random.default_rng(0)
    model = CostModel()
    for i in range(400):
        s = int(rng.integers(1, 33))
        k = int(rng.integers(0, K_MAX + 1))
        n = s * (1 + k) + (int(rng.integers(1, 200)) if rng.random() < 0.2 else 0)
        catchup = s + int(rng.integers(0, 40))
        forwards = [(catchup, s)] + [(s, s)] * (k - 1) if k else []
        stall = 3.0 if i % 40 == 7 else 1.0  # now and then another process takes the CPU
        draft_noise, target_noise = 1 + 0.03 * rng.standard_normal(2)
        model.observe_draft(forwards, _sum_draft(true_draft, forwards) * draft_noise * stall)
        model.observe_target(n, s, true_target(n, s) * target_noise * stall)
    model.refit(search_knee=True)

    fit = model.target
    assert fit.knee == true_target.knee
    assert fit.base == pytest.approx(true_target.base, rel=0.1)
    assert fit.slope_low == pytest.approx(true_target.slope_low, rel=0.25)
    assert fit.slope_high == pytest.approx(true_target.slope_high, rel=0.05)
    for n in (1, 8, 32, 100, 300):
        assert model.target_time(n, 8) == pytest.approx(true_target(n, 8), rel=0.05)
    d = model.draft
    assert d.per_forward == pytest.approx(true_draft.per_forward, rel=0.1)
    assert d.per_row == pytest.approx(true_draft.per_row, rel=0.25)
    assert model.draft_time([(40, 16), (16, 16)]) == pytest.approx(
        _sum_draft(true_draft, [(40, 16), (16, 16)]), rel=0.05
    )


def _sum_draft(draft: DraftCost, forwards: list[tuple[int, int]]) -> float:
    return sum(draft(r, s) for r, s in forwards)


def test_cost_model_keeps_prior_where_no_data_reaches() -> None:
    """Live steps only at small batches, all 20% slower than the prior says: the fit follows them
    there and, past the knee where no live step reaches, keeps the prior's shape at their level."""
    model = CostModel(GPU_TARGET, GPU_DRAFT)
    for i in range(200):
        n = 4 + i % 8
        model.observe_target(n, n, GPU_TARGET(n, n) * 1.2)  # live steps pay 20% more overhead
    model.refit(search_knee=True)
    assert model.target.knee == GPU_TARGET.knee
    assert model.target.slope_high == pytest.approx(1.2 * GPU_TARGET.slope_high, rel=0.05)
    assert model.target_time(8, 8) == pytest.approx(GPU_TARGET(8, 8) * 1.2, rel=0.05)


def test_measured_curve_follows_a_jagged_step_time() -> None:
    """Step time that no smooth curve fits (a CPU kernel picking its blocking by row count: 4 rows
    faster than 1, 8 slower than 6): predictions at measured row counts follow the measurements,
    between them they interpolate, and the parametric fit alone would be far off."""
    jagged = {1: 0.29, 2: 0.28, 4: 0.185, 6: 0.175, 8: 0.27, 12: 0.285, 24: 0.50, 40: 0.745}
    rng = np.random.default_rng(1)
    model = CostModel()
    for i in range(600):
        n = list(jagged)[i % len(jagged)]
        stall = 3.0 if i % 50 == 13 else 1.0
        model.observe_target(n, min(n, 8), jagged[n] * (1 + 0.03 * rng.standard_normal()) * stall)
    model.refit(search_knee=True)
    for n, t in jagged.items():
        assert model.target_time(n, min(n, 8)) == pytest.approx(t, rel=0.05)
    assert model.target_time(5, 1) == pytest.approx((0.185 + 0.175) / 2, rel=0.05)
    assert model.target_time(80, 16) > model.target_time(40, 8)  # beyond: the fit's increase
    assert max(abs(model.target(n, min(n, 8)) / t - 1) for n, t in jagged.items()) > 0.15


def test_a_measured_point_is_shifted_to_the_batch_it_prices() -> None:
    """32 rows measured live only at 8 sequences (a jagged point the smooth fit misses by 19%)
    still prices 32 rows at 16 sequences right: the fit's per-sequence slope moves the point.
    Priced as measured, a batch grown from 8 to 16 sequences would see its verify steps 16% too
    cheap."""

    def true(n: int, s: int) -> float:
        return 0.2 + 0.012 * s + 0.004 * n + (0.08 if n == 32 else 0.0)

    rng = np.random.default_rng(2)
    model = CostModel()
    shapes = [(8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (16, 16), (48, 16), (64, 16)]
    for i in range(400):
        n, s = shapes[i % len(shapes)]
        model.observe_target(n, s, true(n, s) * (1 + 0.02 * rng.standard_normal()))
    model.refit(search_knee=True)
    assert model.target_time(32, 8) == pytest.approx(true(32, 8), rel=0.05)
    assert model.target_time(32, 16) == pytest.approx(true(32, 16), rel=0.05)
    assert model.target_time(16, 16) == pytest.approx(true(16, 16), rel=0.05)
    assert model.target_time(16, 8) == pytest.approx(true(16, 8), rel=0.05)


def test_an_exact_shape_is_priced_at_its_own_steps() -> None:
    """16 rows are 16 plain decodes or 8 sequences verifying a draft each; on a CPU the second can
    cost 20% more (here 0.6 s against 0.5 s) although rows and sequences explain the rest of the
    curve. A batch that speculates measures the verify shape every step and its plain shape only
    in the odd cost probe: the per-row point is the verify steps', and priced plain decode 20%
    too dear. The plain shape's own recent steps price it."""

    def true(n: int, s: int) -> float:
        return 0.3 + 0.0125 * n + (0.1 if n == 2 * s else 0.0)

    rng = np.random.default_rng(4)
    model = CostModel()
    shapes = [(8, 8), (16, 8), (24, 8), (32, 16), (48, 16)]
    for i in range(300):
        n, s = shapes[i % len(shapes)]
        model.observe_target(n, s, true(n, s) * (1 + 0.02 * rng.standard_normal()))
    for _ in range(3):  # cost probes
        model.observe_target(16, 16, true(16, 16) * (1 + 0.02 * rng.standard_normal()))
    assert model.target_time(16, 16) == pytest.approx(true(16, 16), rel=0.03)
    assert model.target_time(16, 8) == pytest.approx(true(16, 8), rel=0.03)
    assert model.target_time(32, 16) == pytest.approx(true(32, 16), rel=0.03)


def smooth_background(true: Callable[[int, int], float], rng: np.random.Generator) -> CostModel:
    """A model that has seen 300 steps (2% noise) of ten shapes around four plain decodes, all of
    them on the smooth curve ``true`` follows everywhere but at (4, 4)."""
    model = CostModel()
    shapes = [(1, 1), (2, 1), (3, 1), (2, 2), (6, 2), (8, 4), (12, 4), (16, 4), (8, 8), (16, 8)]
    for i in range(300):
        n, s = shapes[i % len(shapes)]
        model.observe_target(n, s, true(n, s) * (1 + 0.02 * rng.standard_normal()))
    return model


def test_a_point_many_steps_measured_a_few_percent_off_the_fit_is_believed() -> None:
    """Four plain decodes run 7% under the smooth curve every other shape follows (the real pair
    at four sequences: 160 ms where the fit said 170-182). Three steps of it are within the
    noise a median of three has, and the fit prices it; sixteen steps are not, and their median
    does. Held to a flat 10% the fit's bias stood for good, and speculating looked 19% better
    than plain where it was 3%."""

    def true(n: int, s: int) -> float:
        return (0.12 + 0.008 * s + 0.006 * n) * (0.93 if (n, s) == (4, 4) else 1.0)

    rng = np.random.default_rng(5)
    model = smooth_background(true, rng)
    model.refit(search_knee=True)
    fit = model.target(4, 4)
    assert fit / true(4, 4) - 1 > 0.05  # the smooth form cannot bend to one shape

    def observe_plain(steps: int) -> None:
        for _ in range(steps):
            model.observe_target(4, 4, true(4, 4) * (1 + 0.02 * rng.standard_normal()))

    observe_plain(model.min_measured)
    assert model.target_time(4, 4) == pytest.approx(fit, rel=0.01)
    observe_plain(model.measured_window - model.min_measured)
    assert model.target_time(4, 4) == pytest.approx(true(4, 4), rel=0.02)


@pytest.mark.parametrize("noise", [0.003, 0.05])
def test_a_point_whose_many_steps_agree_closely_is_believed_nearer_the_fit(noise: float) -> None:
    """Four plain decodes run 4.5% under the smooth curve every other shape follows; with their
    own steps in it the fit comes within 2-3% of them: inside the band a median of sixteen steps
    must leave the fit by (4.3%). Where those steps agree to a few tenths of a percent, their
    median's own error is far smaller than that, and it is believed (the real pair at eight
    sequences: 2.5% and 4% off the fit, and speculating predicted 11% better than plain where it
    measured 5%). Where they scatter by 5%, the median is no better than the fit: the fit stays."""

    def true(n: int, s: int) -> float:
        return (0.12 + 0.008 * s + 0.006 * n) * (0.955 if (n, s) == (4, 4) else 1.0)

    rng = np.random.default_rng(5)
    model = smooth_background(true, rng)
    for _ in range(model.measured_window):
        model.observe_target(4, 4, true(4, 4) * (1 + noise * rng.standard_normal()))
    model.refit()
    fit = model.target(4, 4)
    assert 0.02 < fit / true(4, 4) - 1 < model._tolerance(model.measured_window)
    if noise < 0.01:
        assert model.target_time(4, 4) == pytest.approx(true(4, 4), rel=0.005)
    else:
        assert model.target_time(4, 4) == pytest.approx(fit, rel=1e-9)


# The real pair's draft on two CPU cores, roughly: a decode row reads weights, a catch-up row of a
# prompt is compute-bound and costs about ten times as much.
CPU_DRAFT = DraftCost(per_forward=0.1, per_row=7e-4, per_seq=0.0, knee=16, per_row_above_knee=6e-3)
CPU_TARGET = TargetCost(base=0.28, per_seq=0.005, slope_low=0.0015, knee=12, slope_high=0.0167)


def test_cost_fit_finds_the_knee_where_draft_catch_up_rows_turn_dear() -> None:
    """Most draft forwards carry a row or two per sequence; now and then one catches a draft up
    on a prompt. A line through them all follows the small ones and prices a 240-row catch-up at
    a fraction of its time; the fit finds the knee and prices both."""
    rng = np.random.default_rng(1)
    model = CostModel()
    for i in range(300):
        s = int(rng.integers(1, 17))
        k = int(rng.integers(1, K_MAX + 1))
        first = s * int(rng.integers(1, 3)) + (int(rng.integers(40, 250)) if i % 10 == 3 else 0)
        forwards = [(first, s)] + [(s, s)] * (k - 1)
        noise = 1 + 0.03 * rng.standard_normal()
        model.observe_draft(forwards, _sum_draft(CPU_DRAFT, forwards) * noise)
        model.observe_target(s * (1 + k), s, CPU_TARGET(s * (1 + k), s) * noise)
    model.refit(search_knee=True)

    assert model.draft.knee == CPU_DRAFT.knee
    catch_up, small = [(240, 4), (4, 4)], [(8, 4), (4, 4)]
    assert model.draft_time(catch_up) == pytest.approx(_sum_draft(CPU_DRAFT, catch_up), rel=0.1)
    assert model.draft_time(small) == pytest.approx(_sum_draft(CPU_DRAFT, small), rel=0.05)
    # The same steps through a line (the knee never searched) misprice the catch-up. (Measured
    # steps of its size correct that after a few, but on a server catch-ups are rare.)
    line = CostModel()
    for sample in model._draft_live:
        line.observe_draft(list(sample.forwards), sample.seconds)
    line.refit(search_knee=False)
    assert _sum_draft(line.draft, catch_up) < 0.8 * _sum_draft(CPU_DRAFT, catch_up)


@pytest.mark.parametrize(
    ("draft", "speculates"),
    [(replace(CPU_DRAFT, knee=math.inf), True), (CPU_DRAFT, False)],
)
def test_a_batch_whose_drafts_skipped_the_prompt_is_charged_its_catch_up_at_catch_up_prices(
    draft: DraftCost, speculates: bool
) -> None:
    """Four sequences at acceptance 0.6 whose draft has not read their 60-token prompts. At a
    decode row's price the catch-up is cheap and drafting one token each is predicted 14% faster
    than plain, so the batch starts; at the compute-bound price of prompt rows (spread over the
    16 steps it pays for) the gain is 1%, below the bar, and the batch stays plain."""
    ctrl = controller(0.6, target=CPU_TARGET, draft=draft)
    seqs = make_seqs(4, prompt_len=60)
    for seq in seqs:
        seq.num_draft_computed_tokens = 0
    ks = ctrl.choose_k(seqs)
    assert (max(ks) > 0) == speculates
    terms = ctrl._terms(seqs[0], ctrl.acceptance.prior())
    assert terms.catchup_rows == 2.0
    assert terms.catchup_s == pytest.approx((draft(60, 1) - draft(2, 1)) / 16)


def test_draft_steps_are_priced_at_what_steps_of_their_size_measured() -> None:
    """One line through every draft step follows the many small ones: the real pair at 16
    sequences ran its two draft forwards (46 rows) 25% over the line for a whole run, and the
    controller kept speculating on the difference. Steps of that size price it once three were
    measured; other sizes, and a size within the tolerance of the line, keep the line."""
    line = DraftCost(per_forward=0.1, per_row=0.004, per_seq=0.001)
    model = CostModel(draft=line)
    small, big, near = [(4, 2), (2, 2)], [(30, 16), (16, 16)], [(100, 16), (16, 16)]

    def fit(forwards: list[tuple[int, int]]) -> float:
        return sum(model.draft(r, s) for r, s in forwards)

    for _ in range(50):
        model.observe_draft(small, fit(small))
    for _ in range(3):
        assert model.draft_time(big) == pytest.approx(fit(big))  # fewer than three: the line
        model.observe_draft(big, 1.25 * fit(big))
        model.observe_draft(near, 1.05 * fit(near))
    assert model.draft_time(big) == pytest.approx(1.25 * fit(big))
    assert model.draft_time([(31, 16), (16, 16)]) == pytest.approx(1.25 * fit([(31, 16), (16, 16)]))
    assert model.draft_time(small) == pytest.approx(fit(small))
    assert model.draft_time(near) == pytest.approx(fit(near))
    # The decision prices the same step the same way.
    terms = [SeqTerms([1.0, 1.9, 2.7], 30 / 16) for _ in range(16)]
    batch = BatchGoodput(terms, model, K_MAX)
    batch.assign([2] * 16)
    plain = model.target_time(16 + 32, 16)
    assert batch.step_time() == pytest.approx(plain + 1.25 * fit(big))
    assert batch.draft_rows() == 30 + 16  # the rows the shape probe asks the factor about
    batch.assign([0] * 15 + [1])
    assert batch.draft_rows() == 30 / 16
    batch.assign([0] * 16)
    assert batch.draft_rows() == 0


def test_neither_a_stall_nor_a_slow_spell_prices_a_row_count_out_for_good() -> None:
    """A row count measured during a stall would look expensive, so the controller would avoid
    it and never measure it again (the real pair at one sequence: one two-row step ran 870 ms
    against about 250, and k = 1 was off the table for the rest of the run). A point of fewer
    than three steps over twice the price the row count had without it is taken for a stall and
    left out; one less far off is kept, but expires when no step there follows. Three steps
    make a point that stands, however far off, while it is recent: a slow spell (the real pair
    at code c=1: five steps of 3 and 4 drafts at three times their price while another job
    ran, and drafts of 3 and 4 were off the table for the rest of the run) expires too."""
    fit = TargetCost(base=0.3, per_seq=0.0, slope_low=0.01, knee=64, slope_high=0.01)
    model = CostModel(fit, stale_after=20)
    before = model.target_time(16, 16)
    model.observe_target(16, 16, 20 * before)
    assert model.target_time(16, 16) == pytest.approx(before)
    model.observe_target(16, 16, 1.2 * before)  # two steps: their median is still a stall
    assert model.target_time(16, 16) == pytest.approx(before)

    def other_sizes() -> None:  # steps either side of 16 rows, at the true cost
        for i in range(22):
            n = 8 if i % 2 else 24
            model.observe_target(n, n, fit(n, n))

    model = CostModel(fit, stale_after=20)
    model.observe_target(16, 16, 1.5 * before)  # off, but not a stall: taken
    assert model.target_time(16, 16) == pytest.approx(1.5 * before)
    other_sizes()
    assert model.target_time(16, 16) == pytest.approx(before, rel=0.05)  # expired
    for _ in range(3):
        model.observe_target(16, 16, 3 * before)
    for _ in range(16):  # the spell's point stands while its steps are recent
        model.observe_target(8, 8, fit(8, 8))
        assert model.target_time(16, 16) == pytest.approx(3 * before, rel=0.05)
    other_sizes()
    assert model.target_time(16, 16) == pytest.approx(before, rel=0.05)


def replay_a_slow_spell(
    target: TargetCost, spell: list[tuple[int, float]], **cost_params: int
) -> list[int]:
    """One sequence at acceptance 0.9 with cheap drafts (k = 4 pays best): replay ``spell``, the
    (k, slowdown) of its first steps whatever the controller decides, then let it decide for
    200 steps at the true cost; returns those 200 decisions."""
    draft = DraftCost(per_forward=0.02, per_row=0.0, per_seq=0.0)
    ctrl = AdaptiveController(
        4,
        cost=CostModel(target, draft, **cost_params),
        acceptance=AcceptanceTracker(4, initial=0.9),
        params=AdaptiveParams(stop_drafts_early=False),  # the k the average gives
    )
    ctrl.cost.seed([TargetSample(r, 1, target(r, 1)) for r in range(1, 6)], [])
    rng = random.Random(0)
    seqs = make_seqs(1)

    def step(ks: list[int], slowdown: float) -> None:
        forwards = draft_forwards(seqs, ks)
        outcomes = [verify_step(seqs[0], ks[0], 0.9, rng)]
        rows = 1 + ks[0]
        t_target = target(rows, 1) * slowdown * (1 + 0.02 * rng.gauss(0, 1))
        t_draft = sum(draft(r, n) for r, n in forwards) * slowdown * (1 + 0.02 * rng.gauss(0, 1))
        ctrl.observe(
            StepObservation(t_target + t_draft, t_draft, t_target, rows, 1, forwards, outcomes)
        )

    for k, slowdown in spell:
        ctrl.choose_k(seqs)  # the decision, overruled by the history being replayed
        step([k], slowdown)
    chosen = []
    for _ in range(200):
        ks = ctrl.choose_k(seqs)
        chosen.append(ks[0])
        step(ks, 1.0)
    return chosen


def test_after_a_slow_spell_the_controller_returns_to_the_draft_length_that_pays() -> None:
    """One sequence, acceptance 0.9, drafts cheap: k = 4 pays best. Steps of 3 and 4 drafts ran
    during a slow spell (another job on the machine) at three times their price, those of 2
    drafts after it: as on the real pair at code c=1, the controller settles at k = 2, and the
    spell's prices would stand for good, since shapes priced out are never run again. Once the
    spell's steps are ``stale_after`` old they no longer count, and k = 4 comes back."""
    target = TargetCost(base=0.1, per_seq=0.0, slope_low=0.001, knee=64, slope_high=0.001)
    spell = [(4, 3.0)] * 5 + [(3, 3.0)] * 5 + [(2, 1.0)] * 5
    chosen = replay_a_slow_spell(target, spell, stale_after=64)
    assert chosen[:40].count(4) <= 4  # the spell's prices stand while its steps are recent
    assert chosen[-100:].count(4) >= 90  # and then (15 + 100 > 64 observations on) no longer


def test_fresh_steps_alone_price_a_shape_once_there_are_enough_of_them() -> None:
    """Three steps of a shape, then, 80 observations later, three that run 40% slower (another
    job took the machine): the fresh three price it, the target point, the exact shape and the
    draft factor alike. Before there are three of them, every step of the last ``stale_after``
    counts (a fresh step slower than the old price may be one stalled step; one well under it
    counts at once, see the next test; a draft factor always waits for three)."""
    fit = TargetCost(base=0.3, per_seq=0.0, slope_low=0.01, knee=64, slope_high=0.01)
    draft = DraftCost(per_forward=0.02, per_row=0.0, per_seq=0.0)
    model = CostModel(fit, draft, refresh_after=64)
    true_draft = draft.per_forward * 4
    forwards = [(1, 1)] * 4

    def run_shape(slowdown: float) -> None:
        model.observe_draft(forwards, true_draft * slowdown)
        model.observe_target(16, 16, fit(16, 16) * slowdown)

    def others() -> None:
        for i in range(80):
            model.observe_target(8 + i % 2, 8 + i % 2, fit(8 + i % 2, 8 + i % 2))

    for _ in range(3):
        run_shape(1.0)
    others()
    run_shape(1.4)
    run_shape(1.4)
    assert model.target_time(16, 16) == pytest.approx(fit(16, 16), rel=0.02)  # outvoted
    assert model.draft_time(forwards) == pytest.approx(true_draft, rel=0.02)
    run_shape(1.4)
    assert model.target_time(16, 16) == pytest.approx(1.4 * fit(16, 16), rel=0.02)
    assert model.draft_time(forwards) == pytest.approx(1.4 * true_draft, rel=0.02)


def test_one_fresh_step_well_under_a_slow_spells_price_is_believed_at_once() -> None:
    """Other work on a shared machine only ever adds time. So where the steps of a price are
    from a slow spell and a fresh step runs well (over ``curve_tolerance``) under them, the
    fresh step prices the shape by itself: open prompts at four sequences had plain priced at
    184 ms from a slow round while a cost probe ran at 138, and speculated on for the rest of
    the round. A fresh step near the old price, or over it, is one step among the others."""
    fit = TargetCost(base=0.12, per_seq=0.0, slope_low=0.01, knee=64, slope_high=0.01)

    def after_the_spell(*fresh: float) -> float:
        model = CostModel(fit, refresh_after=64)
        for _ in range(5):
            model.observe_target(4, 4, 0.18)
        for i in range(80):
            model.observe_target(7 + i % 2, 3, fit(7 + i % 2, 3))
        for t in fresh:
            model.observe_target(4, 4, t)
        return model.target_time(4, 4)

    assert after_the_spell(0.138) == pytest.approx(0.138, rel=0.02)
    assert after_the_spell(0.14, 0.136) == pytest.approx(0.138, rel=0.02)
    assert after_the_spell(0.17) == pytest.approx(0.18, rel=0.02)  # within the noise
    assert after_the_spell(0.138, 0.25) == pytest.approx(0.18, rel=0.02)  # not all faster
    assert after_the_spell(0.30) == pytest.approx(0.18, rel=0.02)


SPELL_TARGET = TargetCost(base=0.1, per_seq=0.0, slope_low=0.005, knee=64, slope_high=0.005)
SPELL_DRAFT = DraftCost(per_forward=0.03, per_row=0.0, per_seq=0.0)


def observe_step(model: CostModel, rows: int, slowdown: float, noise: float = 1.0) -> None:
    """One step of ``rows`` target rows at one sequence (``rows - 1`` one-row draft forwards)
    as the controller reports it: the speed first, then the draft and target seconds."""
    target_s = SPELL_TARGET(rows, 1) * slowdown * noise
    model.observe_speed(rows, 1, target_s)
    if rows > 1:
        forwards = [(1, 1)] * (rows - 1)
        model.observe_draft(forwards, SPELL_DRAFT.per_forward * (rows - 1) * slowdown * noise)
    model.observe_target(rows, 1, target_s)


@pytest.mark.parametrize("track_speed", [True, False])
def test_a_slow_spell_moves_the_speed_index_not_the_price_of_the_shape_it_slowed(
    track_speed: bool,
) -> None:
    """Plain steps and four-draft steps both measured at the machine's usual speed; then a spell
    slows the machine by 35% while only four-draft steps run. Every shape is slower in it, but
    only the one that ran was measured: priced as measured, four drafts would look 35% dearer
    against plain than they are (the controller at code c=1 left four drafts for shapes priced
    before such a spell). Their steps against their own earlier ones give the machine's speed;
    divided by it, the spell's steps leave the prices where they were, and it ends as it came."""
    model = CostModel(SPELL_TARGET, SPELL_DRAFT, track_speed=track_speed)
    rng = random.Random(0)
    for _ in range(16):
        observe_step(model, 1, 1.0, 1 + 0.02 * rng.gauss(0, 1))
        observe_step(model, 5, 1.0, 1 + 0.02 * rng.gauss(0, 1))
    for _ in range(12):
        observe_step(model, 5, 1.35, 1 + 0.02 * rng.gauss(0, 1))
    relative = model.target_time(5, 1) / model.target_time(1, 1)
    true_relative = SPELL_TARGET(5, 1) / SPELL_TARGET(1, 1)
    draft = model.draft_time([(1, 1)] * 4)
    if track_speed:
        assert model.speed_index == pytest.approx(1.35, rel=0.03)
        assert relative == pytest.approx(true_relative, rel=0.03)
        assert draft == pytest.approx(4 * SPELL_DRAFT.per_forward, rel=0.03)
        assert model.to_dict()["speed_index"] == model.speed_index
        for _ in range(4):  # the spell ends
            observe_step(model, 5, 1.0)
        assert model.speed_index == 1.0
    else:
        assert model.speed_index == 1.0
        assert relative == pytest.approx(1.35 * true_relative, rel=0.03)
        assert draft == pytest.approx(1.35 * 4 * SPELL_DRAFT.per_forward, rel=0.03)


def test_a_shapes_first_steps_are_its_price_not_a_spell() -> None:
    """A shape calibrated at 90 ms that runs at 130 live has no live steps to be compared with:
    its first steps reprice it and move no index. And a shape first run while a spell the index
    has seen lasts is priced at the usual speed, as the shapes measured before the spell are."""
    calibrated = CostModel(SPELL_TARGET, SPELL_DRAFT)
    calibrated.seed([TargetSample(3, 1, 0.09, calibration=True)], [])
    for _ in range(8):
        calibrated.observe_speed(3, 1, 0.13)
        calibrated.observe_target(3, 1, 0.13)
    assert calibrated.speed_index == 1.0
    assert calibrated.target_time(3, 1) == pytest.approx(0.13, rel=0.02)

    model = CostModel(SPELL_TARGET, SPELL_DRAFT)
    for _ in range(8):
        observe_step(model, 1, 1.0)
    for _ in range(5):
        observe_step(model, 1, 1.4)  # the spell, seen on plain steps
    assert model.speed_index == pytest.approx(1.4)
    for _ in range(5):
        observe_step(model, 4, 1.4)  # four rows, never run before
    assert model.speed_index == pytest.approx(1.4)
    # Kept at the usual speed, as the plain steps before the spell were.
    assert model.fastest_at(4, 1) == pytest.approx(SPELL_TARGET(4, 1))
    assert model.fastest_at(1, 1) == pytest.approx(SPELL_TARGET(1, 1))
    for _ in range(4):  # the spell ends: four usual steps are most of the last seven votes
        observe_step(model, 4, 1.0)
    assert model.speed_index == 1.0


def test_in_a_slow_spell_the_controller_keeps_the_draft_length_that_pays() -> None:
    """One sequence at acceptance 0.93, drafts priced as on the real pair's CPU: four drafts pay
    best, and every other length is measured now and then by shape probes. Midway the machine
    slows by 35% for 60 steps, every shape alike. Without the speed index the four-draft steps
    measured in the spell look dear against the others' older prices, and the controller
    leaves them; with it, it stays (probes and the odd step aside)."""

    def run(track_speed: bool) -> list[int]:
        draft = DraftCost(per_forward=0.037, per_row=0.0, per_seq=0.0)
        target = TargetCost(base=0.095, per_seq=0.0, slope_low=0.006, knee=64, slope_high=0.006)
        ctrl = AdaptiveController(
            K_MAX,
            cost=CostModel(target, draft, track_speed=track_speed),
            acceptance=AcceptanceTracker(K_MAX, initial=0.93),
            params=AdaptiveParams(plain_first=False, stop_drafts_early=False),
        )
        rng = random.Random(3)
        seqs = make_seqs(1)
        chosen = []
        for i in range(260):
            slowdown = 1.35 if 150 <= i < 210 else 1.0
            ks = ctrl.choose_k(seqs)
            chosen.append(ks[0])
            forwards = draft_forwards(seqs, ks)
            outcomes = [verify_step(seqs[0], ks[0], 0.93, rng)]
            rows = 1 + ks[0]
            noise = 1 + 0.02 * rng.gauss(0, 1)
            t_target = target(rows, 1) * slowdown * noise
            t_draft = sum(draft(r, n) for r, n in forwards) * slowdown * noise
            ctrl.observe(
                StepObservation(t_target + t_draft, t_draft, t_target, rows, 1, forwards, outcomes)
            )
        return chosen

    tracked, untracked = run(True), run(False)
    assert tracked[100:150].count(4) >= 44  # four drafts pay best, and are chosen
    assert tracked[150:210].count(4) >= 52  # in the spell too
    assert untracked[150:210].count(4) <= 40  # where the spell's prices sent it elsewhere


@pytest.mark.parametrize("refresh_after", [64, 256])
def test_a_near_best_draft_length_priced_in_a_slow_spell_is_measured_afresh(
    refresh_after: int,
) -> None:
    """As on the real pair at code c=2: four-draft steps ran while the machine was slow (draft
    forwards 215 ms, the fixed arm later 160), were priced out by a few percent, and the
    controller drafted 3 and 2 for the next two rounds. Such a shape is still within reach of
    the decision, so shape probes re-measure it once its steps are ``refresh_after`` old, and
    the fresh steps alone price it: k = 4 returns long before the spell's steps go stale.
    With nothing counted fresh before ``stale_after`` (256 here too) it stays away."""
    target = TargetCost(base=0.1, per_seq=0.0, slope_low=0.004, knee=64, slope_high=0.004)
    spell = [(4, 1.3)] * 5 + [(3, 1.0)] * 5
    chosen = replay_a_slow_spell(target, spell, refresh_after=refresh_after)
    assert chosen[:40].count(4) <= 4  # the spell's price stands while its steps are fresh
    if refresh_after == 64:
        assert chosen[-60:].count(4) >= 50  # re-measured, and chosen again
    else:
        assert chosen[-60:].count(4) <= 10


def test_measured_row_counts_are_bounded_least_recent_forgotten() -> None:
    """A long-running server sees thousands of prefill sizes: the curve keeps the newest few."""
    model = CostModel(max_measured_sizes=4)
    for n in range(1, 11):
        model.observe_target(n, 1, 0.1 * n)
    model.observe_target(7, 1, 0.7)  # measured again: now the most recent
    assert model.target_curve().rows == [7.0, 8.0, 9.0, 10.0]
    model.observe_target(3, 1, 0.3)
    assert model.target_curve().rows == [3.0, 7.0, 9.0, 10.0]


def test_live_plain_step_is_measured_even_where_calibration_timed_one() -> None:
    """Calibration's bare plain forwards can be far off the live plain step (the real pair at 8
    sequences: 400-430 ms calibrated, 280 ms live), and a batch that always speculates measures
    only its verify steps: the controller still measures a live plain step of its batch size,
    and turns off once it sees plain is faster live."""
    live = TargetCost(base=0.30, per_seq=1e-3, slope_low=1e-2, knee=1024, slope_high=1e-2)
    draft = DraftCost(per_forward=0.03, per_row=2e-3, per_seq=1e-3)

    def run(cost_probe_every: int) -> tuple[AdaptiveController, list[list[int]]]:
        cost = CostModel(live, draft)
        shapes = [(s * r, s) for s in (1, 2, 4, 8, 16) for r in range(1, K_MAX + 2)]
        # Every shape calibrated at its live price, but for plain steps (one row a sequence),
        # timed 60% slow.
        slow = [(n, s, live(n, s) * (1.6 if n == s else 1.0)) for n, s in shapes]
        cost.seed([TargetSample(n, s, t, calibration=True) for n, s, t in slow], [])
        ctrl = AdaptiveController(
            K_MAX,
            cost=cost,
            acceptance=AcceptanceTracker(K_MAX, initial=0.4),
            # The margin over plain off: this is about what the cost probe measures, alone.
            params=AdaptiveParams(
                cost_probe_every=cost_probe_every,
                plain_margin=0.0,
                plain_first=False,
                stop_drafts_early=False,
            ),
        )
        hist = simulate(ctrl, make_seqs(16), lambda s, t: 0.4, live, draft, 200, random.Random(0))
        return ctrl, hist

    ctrl, hist = run(cost_probe_every=32)
    assert all(k > 0 for k in hist[0])  # the calibrated plain price makes drafting look better
    assert ctrl.num_cost_probes >= 1
    # Plain from then on, but for the odd acceptance probe of a few sequences.
    assert sum(map(sum, hist[-50:])) <= 2 * 4 * 2
    assert ctrl.cost.target_time(16, 16) == pytest.approx(live(16, 16), rel=0.05)
    assert sum(sum(ks) > 0 for ks in hist[:30]) <= 10
    # Only speculating steps measured: the plain price is not corrected by a plain step. (In
    # the long run the fit's live-vs-bare offset, learnt from speculating shapes, may get
    # there; the cost probe gets there within its first round.)
    _, stuck = run(cost_probe_every=10**9)
    assert all(sum(ks) > 0 for ks in stuck[:30])


def test_a_new_batch_size_measures_its_plain_step_soon_and_then_rarely() -> None:
    """A batch that grows to a size never run plain gets the few live plain steps the curve needs
    within a few dozen decisions (a 64-token reply at 16 sequences is ~25 steps), and no more
    than that for as long as they stay recent: the probes' cost is bounded, not their speed."""
    rng = random.Random(4)
    ctrl = controller(0.8)
    pool = make_seqs(16)
    simulate(ctrl, pool[:4], lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 100, rng)
    before = ctrl.num_cost_probes
    hist = simulate(ctrl, pool, lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 200, rng, first_step=100)
    plain_steps = [i for i, ks in enumerate(hist) if not any(ks)]
    assert ctrl.num_cost_probes - before == ctrl.cost.min_measured == len(plain_steps)
    assert plain_steps[-1] < 3 * ctrl.params.cost_probe_every + 4
    assert ctrl.cost.has_plain_sample(16, 16)


def test_a_batch_runs_plain_before_it_starts_speculating() -> None:
    """Before a batch starts drafting it runs plain, with no draft forward, until the fit has a
    few live plain steps of its size: calibration prices a plain step from bare forwards and
    other sizes (the real pair at 8 sequences on CPU: predicted 400-430 ms, ran 280 ms), and a
    start believed on that price pays every sequence's draft catch-up. A step beside a prefill
    chunk is priced differently and does not wait."""
    rng = random.Random(2)
    ctrl = controller(0.8, plain_first=True)
    seqs = make_seqs(4)
    hist = simulate(ctrl, seqs, lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 20, rng)
    n = ctrl.cost.min_measured
    assert all(draft_forwards(seqs, ks) == [] for ks in hist[:n])
    assert all(all(k > 0 for k in ks) for ks in hist[n:])
    assert ctrl.num_cost_probes == n
    beside_prefill = controller(0.8, plain_first=True)
    beside_prefill.expect_prefill(40, 1)
    assert all(k > 0 for k in beside_prefill.choose_k(make_seqs(4)))


def test_plain_first_runs_once_per_start_not_while_speculating() -> None:
    """One sequence whose drafts pay twice over: its first few steps are plain (no live plain step
    of its size yet), then it speculates for good."""
    target = flat_target(0.3)
    draft = DraftCost(per_forward=0.03, per_row=0.001, per_seq=0.0)
    ctrl = controller(0.9, target, draft, plain_first=True)
    hist = simulate(ctrl, make_seqs(1), lambda s, t: 0.9, target, draft, 300, random.Random(5))
    plain_steps = [i for i, ks in enumerate(hist) if not any(ks)]
    assert plain_steps == list(range(ctrl.cost.min_measured))
    assert ctrl.num_cost_probes == ctrl.cost.min_measured


@pytest.mark.parametrize("refresh_after", [64, 256])
def test_a_speculating_batch_measures_its_plain_step_afresh(refresh_after: int) -> None:
    """Speculating here is predicted some 15-25% faster than plain: within reach of a plain
    price that is off, as one from a slower or faster spell of the machine is. So a few live
    plain steps are run again once the last ones are ``refresh_after`` observations old (the
    cost model then prices plain from those alone), not only once they are ``stale_after``."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.003, per_row=0.0, per_seq=0.0)
    ctrl = AdaptiveController(
        K_MAX,
        cost=CostModel(target, draft, refresh_after=refresh_after),
        acceptance=AcceptanceTracker(K_MAX, initial=0.6),
        params=AdaptiveParams(plain_first=False, stop_drafts_early=False),
    )
    hist = simulate(ctrl, make_seqs(2), lambda s, t: 0.6, target, draft, 400, random.Random(3))
    plain = [i for i, ks in enumerate(hist) if not any(ks)]
    assert len(plain) == ctrl.num_cost_probes  # every plain step is a cost probe
    gaps = [b - a for a, b in zip(plain, plain[1:], strict=False) if b - a > 8]
    if refresh_after == 64:
        assert 12 <= len(plain) <= 20 and max(gaps) <= 80
    else:
        assert len(plain) <= 6


def test_a_far_better_speculating_batch_is_not_cost_probed_again() -> None:
    """One sequence whose drafts pay twice over: after the plain step's first live measurements,
    a plain step every so often would give up half a step's tokens and could not change the
    decision. With the cap lifted it re-measures whenever those steps stop being recent."""
    target = flat_target(0.3)
    draft = DraftCost(per_forward=0.03, per_row=0.001, per_seq=0.0)

    def cost_probes(cap: float) -> int:
        ctrl = controller(0.9, target, draft, cost_probe_max_gain=cap)
        return run_one_seq(ctrl, 0.9, target, draft, 500, seed=5).num_cost_probes

    assert cost_probes(AdaptiveParams().cost_probe_max_gain) == CostModel().min_measured
    assert cost_probes(float("inf")) >= 2 * CostModel().min_measured


def test_a_slow_spells_plain_price_is_measured_again_however_far_ahead_speculation_looks() -> None:
    """Two sequences whose k = 1 drafts lose 6% to plain at the true prices (a 10 ms target
    step, 6 ms a draft forward, half the drafts accepted). Their last plain steps ran in a slow
    spell, at 18 ms: priced so, speculation looks 69% faster, far past the 30% beyond which a
    speculating batch is not cost-probed again. But plain steps of that shape have run at 10 ms,
    and at that price speculation loses: so the plain step is measured again once those slow
    steps are ``refresh_after`` old, and the batch goes plain (priced at the slow spell alone,
    it would speculate on until they were ``window`` old)."""
    target = flat_target(0.010)
    draft = DraftCost(per_forward=0.006, per_row=0.0, per_seq=0.0)
    rng = random.Random(4)

    def decisions() -> list[list[int]]:
        # The measured loss would end it too: this test is about the cost probe alone.
        ctrl = AdaptiveController(
            K_MAX,
            cost=CostModel(target, draft),
            acceptance=AcceptanceTracker(K_MAX, initial=0.5),
            params=AdaptiveParams(
                plain_first=False, measured_loss_raises_keep_bar=False, stop_drafts_early=False
            ),
        )
        seqs = make_seqs(2)
        for slowdown in [1.0] * 3 + [1.8] * 13:  # plain steps, fast and then in a slow spell
            ctrl.choose_k(seqs)  # overruled by the history being replayed
            outcomes = [verify_step(seq, 0, 0.5, rng) for seq in seqs]
            t = 0.010 * slowdown
            ctrl.observe(StepObservation(t, 0.0, t, 2, 2, [], outcomes))
        return simulate(ctrl, seqs, lambda s, t: 0.5, target, draft, 200, rng)

    hist = decisions()
    assert any(ks != [0, 0] for ks in hist[:40])  # it speculates on the slow spell's price
    assert sum(ks == [0, 0] for ks in hist[100:]) >= 90  # and then, measured again, not


def test_a_row_count_mispriced_by_calibration_is_measured_live() -> None:
    """Calibration's bare forward at 3 rows says 330 ms; live it takes 200 ms (a CPU kernel's
    blocking changes with the row count). k = 2 (3 rows) is predicted within 10% of the best k,
    so the controller runs it now and then until it has live steps there, and then keeps it.
    Without those shape probes k = 2 is never chosen, so never measured, so never corrected."""
    flat = 0.30
    live = {3: 0.20}
    draft = DraftCost(per_forward=0.02, per_row=0.0, per_seq=0.0)

    def true_target(n: float, s: float) -> float:
        return live.get(int(n), flat)

    def run(shape_probe_every: int) -> tuple[AdaptiveController, list[list[int]]]:
        # No tolerance: every calibrated row count is a point of the curve as measured.
        cost = CostModel(
            TargetCost(base=flat, per_seq=0.0, slope_low=0.0, knee=64, slope_high=0.0),
            draft,
            curve_tolerance=0.0,
        )
        bare = {n: (0.33 if n == 3 else flat) for n in range(1, K_MAX + 2)}
        cost.seed([TargetSample(n, 1, t, calibration=True) for n, t in bare.items()], [])
        ctrl = AdaptiveController(
            K_MAX,
            cost=cost,
            acceptance=AcceptanceTracker(K_MAX, initial=0.5),
            # the k decided is the point here: no draft is deepened or stopped early
            params=AdaptiveParams(shape_probe_every=shape_probe_every, stop_drafts_early=False),
        )
        rng = random.Random(3)
        hist = simulate(ctrl, make_seqs(1), lambda s, t: 0.5, true_target, draft, 300, rng)
        return ctrl, hist

    ctrl, hist = run(shape_probe_every=8)
    assert ctrl.num_shape_probes >= 1
    assert ctrl.cost.target_time(3, 1) == pytest.approx(0.20, rel=0.05)
    assert sum(ks == [2] for ks in hist[-100:]) >= 90
    _, stuck = run(shape_probe_every=10**9)
    assert sum(ks == [2] for ks in stuck) == 0


def test_a_draft_shape_not_measured_live_is_probed_when_near_best() -> None:
    """Every target row count has live steps, but only four-token drafts were measured on the
    draft side: three- and two-token drafts at four sequences are priced by a line through
    other steps (on the real pair at code c=4: 307 ms predicted, 244 ms live). Predicted within
    the tolerance of the best, the nearest of them runs one step, until its draft rows were
    measured; then the controller stops probing it."""
    flat = 0.30
    cost = CostModel(
        TargetCost(base=flat, per_seq=0.0, slope_low=0.0, knee=64, slope_high=0.0),
        DraftCost(per_forward=0.12, per_row=0.0, per_seq=0.0),
    )
    for _ in range(cost.min_measured):
        for rows in range(4, 4 * (K_MAX + 1) + 1):
            cost.observe_target(rows, 4, flat)
        cost.observe_draft([(4, 4)] * 4, 0.48)
    ctrl = AdaptiveController(K_MAX, cost=cost, acceptance=AcceptanceTracker(K_MAX, initial=0.95))
    seqs = make_seqs(4)
    every = ctrl.params.shape_probe_every
    decisions = [ctrl.choose_k(seqs) for _ in range(every)]
    probe_at = every // 2 - 1
    assert all(ks == [4] * 4 for i, ks in enumerate(decisions) if i != probe_at)
    assert decisions[probe_at] == [3] * 4 and ctrl.num_shape_probes == 1
    assert cost.num_live_draft_at(12) == 0
    for _ in range(cost.min_measured):
        cost.observe_draft([(4, 4)] * 3, 0.36)  # 12 rows: the bucket of 8..15
    assert cost.num_live_draft_at(8) == cost.min_measured
    assert [ctrl.choose_k(seqs) for _ in range(every)] == [[4] * 4] * every
    assert ctrl.num_shape_probes == 1


# ---- stats and logging ------------------------------------------------------------------------


def test_stats_and_debug_log_line(caplog: pytest.LogCaptureFixture) -> None:
    # No plain cost probe: it would show this batch that plain pays here, and mean_k would be 0.
    ctrl = controller(0.9, log_every=5, cost_probe_every=10**9)
    with caplog.at_level(logging.DEBUG, logger="specdec.controller.adaptive"):
        simulate(ctrl, make_seqs(3), lambda s, t: 0.6, GPU_TARGET, GPU_DRAFT, 10, random.Random(0))
    lines = [r.getMessage() for r in caplog.records if "mean_k=" in r.getMessage()]
    assert len(lines) == 2
    stats = ctrl.stats()
    for key in (
        "mean_k",
        "speculating_fraction",
        "cost_target_base_s",
        "cost_target_knee_tokens",
        "cost_target_per_token_above_knee_s",
        "cost_draft_per_forward_s",
        "acceptance_prior",
        "acceptance_by_request",
    ):
        assert key in stats
    assert 0 < stats["mean_k"] <= K_MAX
    assert set(stats["acceptance_by_request"]) == {"req-0", "req-1", "req-2"}
    assert 0.4 < stats["acceptance_prior"][0] < 0.8  # moved from the initial 0.9 towards 0.6


def test_finished_sequences_are_forgotten() -> None:
    ctrl = controller(0.8)
    seqs = make_seqs(2)
    simulate(ctrl, seqs, lambda s, t: 0.8, GPU_TARGET, GPU_DRAFT, 5, random.Random(0))
    seqs[0].status = SequenceStatus.FINISHED_STOPPED
    ctrl.observe(StepObservation(0.01, 0.0, 0.01, 2, 2, [], [SeqOutcome(seqs[0], 0, 0)]))
    assert ctrl.acceptance.tracked() == [1]


# ---- on the engine (tiny random models) --------------------------------------------------------


class _ScriptedController:
    """Returns a scripted k for every sequence, step after step; records what it returned and
    the observations it was fed."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.returned: list[list[int]] = []
        self.observed: list[StepObservation] = []
        self.calls: list[str] = []  # every call, in order

    stops_drafts_early = True  # asked after every draft forward but the last, so it is seen

    def choose_k(self, seqs):
        self.calls.append("choose_k")
        k = self.script[len(self.returned) % len(self.script)]
        self.returned.append([k] * len(seqs))
        return self.returned[-1]

    def expect_prefill(self, rows: int, seqs: int) -> None:
        self.calls.append("expect_prefill")

    def keep_drafting(self, seqs, confidences) -> list[bool]:
        self.calls.append("keep_drafting")
        return [True] * len(seqs)

    def while_target_runs(self) -> None:
        self.calls.append("while_target_runs")

    def observe(self, obs) -> None:
        self.calls.append("observe")
        self.observed.append(obs)

    def stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1, layers=1)


def _run_recording(engine, max_steps: int = 200) -> list[tuple[int, list[int] | None]]:
    """Per engine step: (draft forwards it ran, the k's the controller returned or None)."""
    out = []
    while engine.has_unfinished() and len(out) < max_steps:
        before, asked = engine.proposer.num_forwards, len(engine.controller.returned)
        engine.step()
        ks = engine.controller.returned[asked] if len(engine.controller.returned) > asked else None
        out.append((engine.proposer.num_forwards - before, ks))
    return out


def test_step_with_all_k_zero_runs_no_draft_forward(tiny_pair) -> None:
    engine = make_engine(*tiny_pair)
    free = engine.allocator.num_free_blocks
    engine.controller = _ScriptedController([0, 0, 2, 0, 3, 0, 0, 1])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], params)
    steps = _run_recording(engine)
    assert not engine.has_unfinished()
    zero_steps = [f for f, ks in steps if ks is None or not any(ks)]
    spec_steps = [f for f, ks in steps if ks is not None and any(ks)]
    assert len(zero_steps) >= 10 and len(spec_steps) >= 4
    assert all(f == 0 for f in zero_steps)
    # The counter does move when k > 0, so the assertion above can fail.
    assert sum(f > 0 for f in spec_steps) >= len(spec_steps) - 1
    assert engine.allocator.num_free_blocks == free


def test_engine_reports_the_draft_forwards_it_ran(tiny_pair) -> None:
    """The draft-cost fit learns from the real (rows, sequences) of every draft forward: the
    first catches each drafting sequence up on the tokens its draft has not seen (a whole prompt
    the first time), later ones carry one row per sequence still drafting."""
    engine = make_engine(*tiny_pair)
    engine.controller = _ScriptedController([0, 3, 2, 0, 1])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [4, 3, 2]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = _run_recording(engine)
    observed = engine.controller.observed
    assert len(observed) == len(steps)
    for (forwards, _), obs in zip(steps, observed, strict=True):
        assert len(obs.draft_forwards) == forwards  # one entry per forward that ran
        if forwards:
            assert [s for _, s in obs.draft_forwards[1:]] == [r for r, _ in obs.draft_forwards[1:]]
            assert obs.draft_forwards[0][0] >= obs.draft_forwards[0][1]
    first = next(obs for obs in observed if obs.draft_forwards)
    # The first drafting step catches the draft up on both whole sequences (prompt + output).
    assert first.draft_forwards[0][0] >= sum(map(len, prompts))
    later = [obs.draft_forwards for obs in observed if obs.draft_forwards][1:]
    assert later and all(f[0][0] <= 2 * (3 + 1) for f in later)  # 1 + accepted rows each


def test_engine_gives_the_controller_the_target_forward_window_every_step(tiny_pair) -> None:
    """Each step: the decision, then (the forward launched) ``while_target_runs``, then the
    observation of that step; a step with no decode-ready sequence (prefill) is asked nothing
    but still gets the window and is observed."""
    engine = make_engine(*tiny_pair)
    ctrl = engine.controller = _ScriptedController([0, 2])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("r0", [5, 6, 7, 8, 9], params)
    steps = 0
    while engine.has_unfinished():
        before = len(ctrl.calls)
        engine.step()
        steps += 1
        calls = [c for c in ctrl.calls[before:] if c != "expect_prefill"]
        assert calls[-2:] == ["while_target_runs", "observe"]
        # k = 2 asks once, between the two draft forwards, whether to draft the second token
        assert calls[:-2] in ([], ["choose_k"], ["choose_k", "keep_drafting"])
    assert ctrl.calls.count("while_target_runs") == steps == len(ctrl.observed)
    assert ctrl.calls.count("choose_k") == steps - 1  # the prefill step had nothing to decide


def test_the_target_curve_is_reused_while_no_kept_point_moves() -> None:
    """A step priced within the fit's noise moves no point the curve keeps: the curve object is
    reused (a batch held plain asks for it every step). A row count measured clearly off the
    fit is a kept point, and moving it makes a new curve."""
    model = CostModel(GPU_TARGET, GPU_DRAFT)
    model.defer_refits = True  # no refit in between: the fit stays the same object
    for _ in range(5):
        model.observe_target(8, 8, GPU_TARGET(8, 8))
    curve = model.target_curve()
    model.observe_target(8, 8, 1.01 * GPU_TARGET(8, 8))
    assert model.target_curve() is curve
    for _ in range(9):
        model.observe_target(8, 8, 1.5 * GPU_TARGET(8, 8))
    moved = model.target_curve()
    assert moved is not curve
    assert moved(8, 8) == pytest.approx(1.5 * GPU_TARGET(8, 8))
    assert curve(8, 8) == pytest.approx(GPU_TARGET(8, 8))


def test_deferred_refits_wait_for_the_window_and_then_match_eager_ones() -> None:
    """With ``defer_refits`` a due refit waits for ``refit_if_due`` (the engine's overlap
    window); run there, it gives the fit an eager model made from the same observations."""
    eager, deferred = CostModel(GPU_TARGET, GPU_DRAFT), CostModel(GPU_TARGET, GPU_DRAFT)
    deferred.defer_refits = True
    for i in range(eager.refit_every):
        for model in (eager, deferred):
            model.observe_target(8 + i, 8, 1.5 * GPU_TARGET(8 + i, 8))
    assert eager.num_fits == 1 and deferred.num_fits == 0
    assert deferred.target == GPU_TARGET  # predictions use the last fit meanwhile
    deferred.refit_if_due()
    assert deferred.num_fits == 1 and deferred.to_dict() == eager.to_dict()
    deferred.refit_if_due()  # nothing due: no refit
    assert deferred.num_fits == 1


def test_adaptive_controller_at_low_acceptance_never_drafts(tiny_pair) -> None:
    engine = make_engine(*tiny_pair)
    engine.controller = AdaptiveController(
        K_MAX,
        acceptance=AcceptanceTracker(K_MAX, initial=0.0),
        params=AdaptiveParams(probe_every=10**9, stop_drafts_early=False),
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = engine.generate([[3, 4, 5, 6], [9, 8, 7], [1, 2, 3, 4, 5]], params)
    assert all(len(o.output_token_ids) == 16 for o in outs)
    assert engine.proposer.num_forwards == 0
    assert engine.controller.stats()["speculating_fraction"] == 0.0
    # The same engine does draft for a request that forces speculation on.
    engine.generate([[3, 4, 5, 6]], params, speculative="on")
    assert engine.proposer.num_forwards > 0


def test_calibration_returns_every_block_and_seeds_the_model(tiny_pair) -> None:
    engine = make_engine(*tiny_pair)
    free = engine.allocator.num_free_blocks
    result = calibrate(engine, K_MAX, time_budget=5.0, repeats=1)
    assert engine.allocator.num_free_blocks == free
    assert len(result.target) >= 2 and len(result.draft) >= 2
    assert {s.num_tokens for s in result.target} >= {1, 1 + K_MAX}
    model = CostModel()
    model.seed(result.target, result.draft)
    assert 0 < model.target_time(1, 1) < 10 and 0 < model.draft_time([(1, 1)]) < 10
    assert math.isfinite(model.target_time(500, 8))


def test_build_controller_calibrates_and_serves_the_engine(tiny_pair) -> None:
    engine = make_engine(*tiny_pair)
    free = engine.allocator.num_free_blocks
    cfg = engine.config.__class__(**{**engine.config.__dict__, "controller_warmup": True})
    ctrl = build_controller(cfg, engine)
    assert isinstance(ctrl, AdaptiveController)
    assert engine.allocator.num_free_blocks == free
    assert ctrl.cost.num_fits >= 1
    engine.controller = ctrl
    outs = engine.generate([[3, 4, 5, 6]] * 2, SamplingParams(temperature=0.0, max_tokens=12))
    assert all(o.finished for o in outs)
    assert engine.allocator.num_free_blocks == free
    assert ctrl.stats()["cost_num_observations"] > 0


# ---- host-time shortcuts change no decision -----------------------------------------------------


def _trace(
    fast: AdaptiveController,
    ref: AdaptiveController,
    steps: int,
    seed: int,
    modes: tuple[str, ...] = ("auto",) * 10 + ("off", "on"),
    overlap: bool = False,
) -> dict[str, int]:
    """Run both controllers through one seeded trace (batch joins and finishes, acceptance that
    drifts per sequence, requests in ``modes``, prefill chunks announced now and then; with
    ``overlap``, ``while_target_runs`` between decision and observation, as the engine calls
    it) and assert that every decision, predicted step time and counter agrees; returns how
    many decisions the fast controller made by each shortcut."""
    rng = random.Random(seed)
    target, draft = GPU_TARGET, replace(GPU_DRAFT, per_forward=0.004)
    acceptance: dict[int, float] = {}
    seqs: list = []
    next_id = 0
    taken = {"_steady_plain": 0, "_pinned": 0}

    def counted(name: str):
        original = getattr(fast, name)

        def call(*args):
            out = original(*args)
            taken[name] += out is not None
            return out

        return call

    for name in taken:
        setattr(fast, name, counted(name))
    for step in range(steps):
        phase = (step // 150) % 3  # 0: mixed, 1: poor drafts (batch settles plain), 2: good
        if rng.random() < 0.05 or not seqs:  # a request joins
            mode = rng.choice(modes)
            [seq] = make_seqs(1, start=next_id, mode=mode, prompt_len=rng.choice([8, 40]))
            seq.params = SamplingParams(max_tokens=rng.choice([20, 200, 10**6]))
            seq.num_draft_computed_tokens = rng.choice([seq.num_draft_computed_tokens, 0])
            next_id += 1
            seqs.append(seq)
        for seq in seqs:
            if seq.seq_id not in acceptance or rng.random() < 0.01:
                acceptance[seq.seq_id] = rng.choice([0.0, 0.1, 0.5, 0.8, 0.95])
        if rng.random() < 0.1:
            rows, num = rng.choice([(0, 0), (16, 1), (200, 2)])
            fast.expect_prefill(rows, num)
            ref.expect_prefill(rows, num)
        ks = fast.choose_k(seqs)
        assert ks == ref.choose_k(seqs), f"step {step}"
        assert fast.predicted_step_time_s == ref.predicted_step_time_s
        assert fast._last.goodput == ref._last.goodput, f"step {step}"
        if overlap:
            fast.while_target_runs()
            ref.while_target_runs()
        forwards = draft_forwards(seqs, ks)
        outcomes = []
        for seq, k in zip(seqs, ks, strict=True):
            a = (0.05, 0.05, 0.9)[phase] if acceptance[seq.seq_id] > 0.3 else 0.0
            outcomes.append(verify_step(seq, k, a, rng))
            if seq.num_output_tokens >= (seq.params.max_tokens or 10**9):
                seq.status = SequenceStatus.FINISHED_LENGTH
        rows = sum(1 + k for k in ks)
        t_target = target(rows, len(seqs)) * (1 + 0.05 * rng.gauss(0, 1))
        t_draft = sum(draft(r, s) for r, s in forwards) * (1 + 0.05 * rng.gauss(0, 1))
        obs = StepObservation(t_target + t_draft, t_draft, t_target, rows, len(seqs))
        obs.draft_forwards, obs.outcomes = forwards, outcomes
        fast.observe(obs)
        ref.observe(obs)
        seqs = [s for s in seqs if not s.is_finished]
    for name in ("num_probes", "num_probes_deferred", "num_cost_probes", "num_shape_probes"):
        assert getattr(fast, name) == getattr(ref, name), name
    assert fast.num_changes == ref.num_changes
    assert fast.cost.to_dict() == ref.cost.to_dict()
    assert fast.stats() == ref.stats()
    return taken


def _fast_and_reference() -> tuple[AdaptiveController, AdaptiveController]:
    def make() -> AdaptiveController:
        ctrl = AdaptiveController(
            K_MAX, cost=CostModel(GPU_TARGET, GPU_DRAFT), acceptance=AcceptanceTracker(K_MAX)
        )
        ctrl.cost.seed(
            [TargetSample(s * r, s, GPU_TARGET(s * r, s)) for s in (1, 4, 16) for r in (1, 3, 5)],
            [],
        )
        return ctrl

    fast, ref = make(), make()
    ref._exact_reference = ref.cost.exact_reference = True
    return fast, ref


@pytest.mark.parametrize(("seed", "overlap"), [(0, False), (1, False), (2, True)])
def test_the_fast_path_decides_exactly_as_the_full_computation(seed: int, overlap: bool) -> None:
    """Caches, memoised objective values, the steady-plain shortcut and the faster fitting give
    the very decisions (k per sequence, probes, hysteresis) of the full computation, step for
    step, over a trace that exercises all of them (with refits in the engine's overlap window
    too)."""
    fast, ref = _fast_and_reference()
    taken = _trace(fast, ref, 600, seed, overlap=overlap)
    assert taken["_steady_plain"] > 100  # the shortcut was taken (and agreed)
    assert fast.num_probes > 0 and fast.num_changes > 0


def test_a_batch_without_auto_requests_is_decided_exactly_as_the_full_computation() -> None:
    """An A/B arm or an eval ('on'/'off' requests only, now and then an 'auto' one among them):
    the pinned shortcut gives the full computation's decisions, and its lazily computed
    prediction (stats, traces) the full computation's numbers."""
    fast, ref = _fast_and_reference()
    taken = _trace(fast, ref, 400, 3, modes=("off",) * 6 + ("on",) * 3 + ("auto",), overlap=True)
    assert taken["_pinned"] > 100
    assert fast.num_changes > 0


def test_draft_feature_columns_match_the_per_sample_sums() -> None:
    from specdec.controller.cost_model import (
        DraftSample,
        _draft_features,
        _draft_features_reference,
    )

    samples = [DraftSample(1, 37, 1, 0.01, calibration=True), DraftSample(3, 10, 3, 0.02)]
    samples += [DraftSample(f, 5 * f + 7, f, 0.01, forwards=((7 + f, f),) * f) for f in (1, 4)]
    for knee in (*(4, 8, 64, 512), math.inf, 6.5):
        got, want = _draft_features(samples, knee), _draft_features_reference(samples, knee)
        assert np.array_equal(got, want), knee


@pytest.mark.parametrize("prefill", [0.0, 48.0])
def test_memoised_objective_equals_the_plain_evaluation(prefill: float) -> None:
    """Best moves and searches over random batches (random gains, catch-up rows and seconds,
    fixed k's) come out bit for bit as the unmemoised evaluation's."""
    rng = random.Random(3)
    model = CostModel(GPU_TARGET, GPU_DRAFT)
    for trial in range(30):
        terms = []
        for _ in range(rng.randint(1, 24)):
            room = rng.randint(0, K_MAX)
            gains = [1.0]
            for _ in range(room):
                gains.append(gains[-1] + rng.choice([0.0, 0.3, rng.random()]))
            fixed = rng.choice([None] * 6 + [0, room])
            catchup_s = rng.choice([0.0, 0.0, 1e-3 * rng.randint(1, 4), rng.random() * 0.01])
            terms.append(SeqTerms(gains, rng.choice([1.0, 2.0]), fixed, catchup_s))
        batches = [
            BatchGoodput(terms, model, K_MAX, prefill, prefill and 1.0, True, reference)
            for reference in (False, True)
        ]
        n = len(terms)
        start = [rng.randint(0, K_MAX) for _ in range(n)]
        for batch in batches:
            batch.assign(batch.clamp(start))
        moves = [[b.best_move(i) for i in range(n)] for b in batches]
        assert moves[0] == moves[1], trial
        starts = [start, [0] * n] + [[k] * n for k in range(1, K_MAX + 1)]
        fast, ref = (b.search(starts) for b in batches)
        assert fast == ref, trial
        assert batches[0].step_time() == batches[1].step_time()
