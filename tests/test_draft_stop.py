"""Stopping a draft early from the draft's confidence: calibration, the rule, the engine."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from test_speculative import GREEDY, many_sequences_engine
from tiny_models import make_engine, tiny_hf_model

from engine.sampling_params import SamplingParams
from evals.controller_sim import make_seqs
from specdec.controller import AcceptanceTracker, AdaptiveController, AdaptiveParams, CostModel
from specdec.controller.cost_model import DraftCost, TargetCost
from specdec.controller.draft_stop import ConfidenceCalibration, continuing
from specdec.controller_base import StaticController

# A CPU-like step: the target costs 170 ms whatever its rows, each draft forward 95 ms.
CPU_TARGET = TargetCost(base=0.170, per_seq=0.0, slope_low=0.0, knee=64, slope_high=0.0)
CPU_DRAFT = DraftCost(per_forward=0.095, per_row=0.0, per_seq=0.0)


def feed(cal: ConfidenceCalibration, rng: random.Random, n: int) -> None:
    """Verifies of one draft each: confidence 0.999 always holds, 0.5 holds half the time."""
    for _ in range(n):
        conf = rng.choice([0.999, 0.5])
        accepted = 1 if conf > 0.9 or rng.random() < 0.5 else 0
        cal.observe([conf], 1, accepted)


def test_calibration_learns_acceptance_per_confidence_bin() -> None:
    cal = ConfidenceCalibration(initial=0.7)
    assert cal.acceptance(0.3) == pytest.approx(0.7)  # nothing seen: the initial guess
    feed(cal, random.Random(0), 2000)
    assert cal.acceptance(0.995) > 0.97
    assert cal.acceptance(0.55) == pytest.approx(0.5, abs=0.06)
    # A bin with no data says what the pooled rate says.
    assert cal.acceptance(0.85) == pytest.approx(cal.pooled())
    assert cal.reach([0.995, 0.55]) == pytest.approx(cal.acceptance(0.995) * cal.acceptance(0.55))
    assert len(cal.table()) == 9


def test_calibration_counts_only_the_judged_drafts() -> None:
    cal = ConfidenceCalibration(initial=0.5, decay=1.0, strength=1.0)
    cal.observe([0.1, 0.3, 0.5, 0.75], num_drafted=4, num_accepted=1)
    # Draft 1 held, draft 2 was rejected, drafts 3 and 4 were never judged.
    assert cal.num_judged == 2
    assert cal.acceptance(0.1) == pytest.approx((1 + 0.5) / 2)
    assert cal.acceptance(0.3) == pytest.approx((0 + 0.5) / 2)
    assert cal.acceptance(0.75) == pytest.approx(cal.pooled())
    cal.observe([0.9, 0.9], num_drafted=2, num_accepted=2)  # all held: both judged
    assert cal.num_judged == 4


def test_calibration_follows_a_change_and_survives_long_runs() -> None:
    cal = ConfidenceCalibration(initial=0.5, decay=0.99)
    for _ in range(500):
        cal.observe([0.5], 1, 0)
    assert cal.acceptance(0.5) < 0.1
    for _ in range(20000):  # far past the point where the lazily decayed weights rescale
        cal.observe([0.5], 1, 1)
    assert cal.acceptance(0.5) > 0.9


@pytest.mark.parametrize(
    "kwargs", [{"initial": 1.5}, {"decay": 0.0}, {"decay": 1.2}, {"strength": 0.0}]
)
def test_calibration_rejects_bad_settings(kwargs) -> None:
    with pytest.raises(ValueError):
        ConfidenceCalibration(**kwargs)


def test_continuing_weighs_tokens_against_time() -> None:
    # Each forward costs 0.1 s whatever its rows; the step commits 10 tokens/s otherwise, so a
    # forward must add more than 1 expected token.
    def flat(n: int, m: int) -> float:
        return 0.1 * m

    assert continuing([[0.9]], flat, 10.0) == [False]
    assert continuing([[1.2]], flat, 10.0) == [True]
    # Neither sequence pays for a forward alone; together they do.
    assert continuing([[0.6], [0.6]], flat, 10.0) == [True, True]

    # Rows that cost: the least valuable sequence is left out.
    def per_row(n: int, m: int) -> float:
        return 0.05 * n * m

    assert continuing([[0.9], [0.2], [0.8]], per_row, 10.0) == [True, False, True]
    assert continuing([], flat, 10.0) == []


def test_continuing_looks_past_the_next_forward() -> None:
    # One more draft adds 0.9 tokens, two add 1.7. The first forward costs 0.1 s but the second
    # makes the verify cheaper (on a CPU 5 rows can run faster than 4): 0.15 s for both.
    def uneven(n: int, m: int) -> float:
        return 0.1 if m == 1 else 0.15

    assert continuing([[0.9, 1.7]], uneven, 10.0) == [True]
    assert continuing([[0.9]], uneven, 10.0) == [False]  # no second draft to reach for


def cpu_controller(draft: DraftCost = CPU_DRAFT, **params) -> AdaptiveController:
    params.setdefault("plain_first", False)
    params.setdefault("stop_drafts_early", True)
    return AdaptiveController(
        4,
        cost=CostModel(CPU_TARGET, draft),
        acceptance=AcceptanceTracker(4, initial=0.9),
        params=AdaptiveParams(**params),
    )


def test_an_unsure_draft_stops_where_a_forward_costs_much() -> None:
    ctrl = cpu_controller()
    feed(ctrl.confidence, random.Random(1), 2000)
    seqs = make_seqs(1)
    assert ctrl.choose_k(seqs)[0] >= 2
    # At about 7.5 tokens/s a 95 ms forward must add 0.7 tokens: after a sure draft the next
    # one does (0.9), after an unsure one it does not (0.5 * 0.9).
    assert ctrl.keep_drafting(seqs, [[0.999]]) == [True]
    assert ctrl.keep_drafting(seqs, [[0.5]]) == [False]
    assert ctrl.keep_drafting(seqs, [[0.999, 0.5]]) == [False]
    assert ctrl.num_draft_stops == 2
    assert ctrl.stats()["num_draft_stops"] == 2


def test_on_sequences_and_a_disabled_rule_draft_their_k() -> None:
    # Rows dear enough that an unsure 'auto' draft stops even where an 'on' sequence's draft
    # runs the forward anyway.
    dear_rows = DraftCost(per_forward=0.02, per_row=0.075, per_seq=0.0)
    for ctrl, modes, expect in (
        (cpu_controller(dear_rows), ["on", "auto"], [True, False]),
        (cpu_controller(dear_rows, stop_drafts_early=False), ["auto", "auto"], [True, True]),
    ):
        feed(ctrl.confidence, random.Random(2), 2000)
        seqs = make_seqs(2)
        for seq, mode in zip(seqs, modes, strict=True):
            seq.spec_mode = mode
        ctrl.choose_k(seqs)
        assert ctrl.keep_drafting(seqs, [[0.5], [0.5]]) == expect


def test_the_adaptive_controller_learns_confidence_from_the_engine() -> None:
    """End to end on a tiny pair with the rule on: verifies carry the draft's confidences and
    the controller's calibration learns from them."""
    target = tiny_hf_model("qwen2", seed=0)
    draft = tiny_hf_model("qwen2", seed=11, layers=1, hidden=32)
    engine = make_engine(target, draft, num_speculative_tokens=3, stop_drafts_early=True)
    assert isinstance(engine.controller, AdaptiveController)
    free0 = engine.allocator.num_free_blocks
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=0)
    engine.generate([[5, 6, 7, 8]] * 4, [params] * 4, speculative="on")
    assert engine.controller.confidence.num_judged > 0
    assert engine.allocator.num_free_blocks == free0


def test_with_the_rule_off_no_confidence_is_computed_or_asked_about() -> None:
    """Off, the engine never asks ``keep_drafting`` and the proposer reports no confidences:
    the draft's hot path does no work for a rule nobody runs."""
    target = tiny_hf_model("qwen2", seed=0)
    draft = tiny_hf_model("qwen2", seed=11, layers=1, hidden=32)
    engine = make_engine(target, draft, num_speculative_tokens=3, stop_drafts_early=False)
    ctrl = engine.controller
    assert isinstance(ctrl, AdaptiveController) and not ctrl.stops_drafts_early
    asked, seen = [], []
    keep_drafting, observe = ctrl.keep_drafting, ctrl.observe
    ctrl.keep_drafting = lambda seqs, conf: asked.append(len(seqs)) or keep_drafting(seqs, conf)

    def record(obs):
        seen.extend(o.draft_confidence for o in obs.outcomes if o.num_drafted)
        observe(obs)

    ctrl.observe = record
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=0)
    engine.generate([[5, 6, 7, 8]] * 4, [params] * 4, speculative="on")
    assert seen and all(c == [] for c in seen)  # drafts were verified, none carried confidence
    assert asked == [] and ctrl.confidence.num_judged == 0


class _StopAfter(StaticController):
    """Fixed k, but each sequence stops drafting once its last draft's confidence is below
    ``threshold``; counts the stops."""

    stops_drafts_early = True

    def __init__(self, k_max: int, threshold: float) -> None:
        super().__init__(k_max)
        self.threshold = threshold
        self.asked = self.stopped = 0

    def keep_drafting(self, seqs, confidences):
        keep = [c[-1] >= self.threshold for c in confidences]
        self.asked += len(keep)
        self.stopped += keep.count(False)
        return keep


def test_a_stopped_draft_verifies_fewer_tokens_and_output_is_unchanged() -> None:
    target = tiny_hf_model("qwen2", seed=0)
    same = tiny_hf_model("qwen2", seed=0)
    engine = make_engine(target, same, num_speculative_tokens=3, speculative_mode="on")
    ref = make_engine(target, None)
    ctrl = engine.controller = _StopAfter(3, threshold=2.0)  # stops after every first draft
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == [
        o.output_token_ids for o in ref.generate(prompts, GREEDY)
    ]
    assert ctrl.stopped == ctrl.asked > 0
    for o in outs:  # one draft a step, and the identical draft's one draft always holds
        assert o.spec_stats.num_draft_tokens == o.spec_stats.num_spec_steps > 0
        assert o.spec_stats.acceptance_rate == 1.0


def test_greedy_confidence_is_the_drafts_softmax_probability() -> None:
    """With the draft identical to the target, the first draft's confidence is the target's
    probability (temperature 1) of the token it then commits."""
    target = tiny_hf_model("qwen2", seed=0)
    same = tiny_hf_model("qwen2", seed=0)
    engine = make_engine(
        target, same, num_speculative_tokens=2, speculative_mode="on", stop_drafts_early=True
    )
    seen = []
    observe = engine.controller.observe

    def record(obs):
        seen.extend(o.draft_confidence for o in obs.outcomes if o.num_drafted)
        observe(obs)

    engine.controller.observe = record
    prompt = [5, 6, 7, 8]
    out = engine.generate([prompt], GREEDY)[0].output_token_ids
    with torch.no_grad():
        logits = target(torch.tensor([prompt + out[:1]])).logits[0, -1]
    assert seen and len(seen[0]) == 2
    assert seen[0][0] == pytest.approx(torch.softmax(logits, -1)[out[1]].item(), rel=1e-4)


def test_a_confidence_rule_leaves_the_sampled_distribution_unchanged() -> None:
    """Drafts stopped by their confidence (a rule that reads only tokens already drafted)
    give the same distribution of tokens 0..3 as plain sampling (two-sample chi-square)."""
    from scipy.stats import chi2_contingency

    vocab = 12
    tgt = tiny_hf_model("qwen2", seed=1, vocab=vocab, hidden=32)
    drf = tiny_hf_model("qwen2", seed=2, vocab=vocab, hidden=32)
    n = 3000
    prompt = [3, 5, 7]
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)
    ]

    def run(mode: str, rule: _StopAfter | None = None) -> list[tuple[int, ...]]:
        engine = many_sequences_engine(tgt, drf, mode)
        if rule is not None:
            engine.controller = rule
        return [tuple(o.output_token_ids) for o in engine.generate([prompt] * n, params)]

    rule = _StopAfter(3, threshold=0.2)
    plain, stopped = run("off"), run("on", rule)
    assert 0 < rule.stopped < rule.asked  # some drafts stopped early, some went on

    for pos in range(4):
        ca = collections.Counter(x[pos] for x in plain)
        cb = collections.Counter(x[pos] for x in stopped)
        keys = sorted(set(ca) | set(cb))
        assert chi2_contingency([[ca[k] for k in keys], [cb[k] for k in keys]])[1] > 1e-4, pos


def test_a_probes_drafts_are_not_stopped() -> None:
    """A shape probe runs the drafting sequences at another k for one step to measure it; cut at
    one draft by an unsure token, it would measure the one-draft shape again and the price
    that keeps the probed shape from being chosen would stand."""
    flat = 0.30
    cost = CostModel(
        TargetCost(base=flat, per_seq=0.0, slope_low=0.0, knee=64, slope_high=0.0),
        DraftCost(per_forward=0.12, per_row=0.0, per_seq=0.0),
    )
    for _ in range(cost.min_measured):  # every target row count measured, 4-draft steps only
        for rows in range(4, 4 * 5 + 1):
            cost.observe_target(rows, 4, flat)
        cost.observe_draft([(4, 4)] * 4, 0.48)
    ctrl = AdaptiveController(
        4,
        cost=cost,
        acceptance=AcceptanceTracker(4, initial=0.95),
        params=AdaptiveParams(stop_drafts_early=True),
    )
    feed(ctrl.confidence, random.Random(3), 2000)
    seqs = make_seqs(4)
    unsure = [[0.5]] * 4
    probes = 0
    for _ in range(ctrl.params.shape_probe_every):
        ks = ctrl.choose_k(seqs)
        keep = ctrl.keep_drafting(seqs, unsure)
        if ks == [3] * 4:  # the probe of three-draft steps, whose draft rows were never measured
            probes += 1
            assert keep == [True] * 4
        else:
            assert ks == [4] * 4 and keep == [False] * 4
    assert probes == 1 == ctrl.num_shape_probes
