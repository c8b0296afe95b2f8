"""AdaptiveController: k per sequence per step from measured acceptance and measured step cost.

Each step (``choose_k``):

1. every decode-ready sequence gets its expected-tokens table E(0..k) from its acceptance estimate
   and a draft catch-up cost; 'on' sequences are pinned at k_max and 'off' ones at 0;
2. the batch goodput (``goodput``) is maximised over the 'auto' sequences, starting from the
   decision held from the last step, from all-off and from every uniform k;
3. hysteresis: the new assignment replaces the held one only if it beats it by ``margin`` times
   the share of the batch whose k changes, so one sequence's noisy estimate cannot flip the batch
   and the whole batch cannot flip on a change worth less than ``margin``; and speculation at
   all must be predicted to beat plain decode by ``plain_margin`` to start (plain is the safe
   side of every error the prediction makes) and by ``plain_keep_margin`` to go on, a band wide
   enough that a gain predicted near the bar does not switch the batch on and off with the noise
   of each step (every switch back on pays the draft's catch-up on the tokens it skipped). A
   decision made beside a prefill chunk, priced differently, does not move the batch into the
   band: only a decode-only step's decision does; and the band belongs to the batch that drafted
   (some of its sequences drafted at that decision), so a new wave of requests starts afresh.
   A batch whose size measured speculating decode steps at ``plain_margin`` more tokens/s than
   plain ones lately (``RealizedGoodput``, probes' steps left out) starts at the keep bar: the
   gain was seen, not just predicted; and a speculating batch whose size measured them at fewer
   tokens/s than plain ones goes on only past the start bar: the gain was predicted and not seen;
4. a sequence held at k = 0 has no new acceptance data, so now and then (after ``probe_every``
   steps, doubling after each poor probe, back to ``probe_every`` after a promising one) it
   drafts ``probe_k`` tokens for one step - but only when speculation could pay for it at a high
   acceptance under the current cost model, the draft's catch-up on the tokens it skipped
   included, so a batch that is off because verifying (or catching up) is expensive is not probed
   for nothing. Probes fall on multiples of ``probe_every`` so probing sequences share forwards,
   and they spend from a budget (``probe_budget`` of the time run): a probe of many sequences whose
   drafts skipped a prompt's worth of tokens costs several plain steps, and near the break-even
   point such probes mostly end back at k = 0, so their cost is bounded rather than their number.
   Until the engine has seen any verify, each sequence is weighed for a probe once, off the
   schedule, as soon as plain first allows (its estimate is only the start-up guess);
5. a batch that keeps speculating runs one step plain now and then when no live plain step of
   that size was measured lately (calibration's bare forwards do not count: a live step at many
   sequences costs more than a bare forward, and by a share that grows with the batch), so a cost
   curve that flatters verification is corrected; once such steps were measured, a batch predicted
   ``cost_probe_max_gain`` faster speculating is not probed again (no plausible error flips it);
6. likewise the drafting sequences run one step at another k now and then when that step is
   predicted within ``shape_probe_tolerance`` of the decision but its target row count or its
   draft rows have few live steps behind them, so a shape mispriced by calibration or by the
   draft fit is measured instead of avoided for good.
7. a batch that is not speculating and would start runs plain first (``plain_first``) until the
   fit has ``min_measured`` live plain steps of its size, so the start is weighed against a
   measured plain price rather than one extrapolated from bare forwards and other sizes.

``observe`` feeds acceptance counts to the tracker and (target, draft) times to the cost model.
Decisions depend only on those measurements, never on the wall clock.

Host time: the controller runs on the engine's critical path every step, so what it computes is
cached where the inputs have not changed (expected-tokens tables until the acceptance tracker
sees a verify, catch-up prices until the draft fit changes, the objective's values, see
``goodput``), and a batch held plain with no probe due skips the search when a bound shows that no
assignment could clear the bar to start speculating (``_steady_plain``). Both give exactly the
decisions of the plain computation, which ``_exact_reference`` keeps for the equivalence test.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from specdec.controller.acceptance import AcceptanceTracker, expected_tokens_table
from specdec.controller.cost_model import CostModel
from specdec.controller.draft_stop import ConfidenceCalibration, continuing
from specdec.controller.goodput import BatchGoodput, SeqTerms
from specdec.controller.realized import RealizedGoodput
from specdec.controller_base import SeqOutcome, StepObservation

logger = logging.getLogger(__name__)

_FORGET_AFTER = 1024  # decisions without seeing a sequence before its state is dropped
_FORGET_EVERY = 64  # ... looked for every this many decisions (a pass over every state)
# Steps of speculation over which the draft's catch-up on unseen tokens (a whole prompt, or all
# that was decoded plainly since it last drafted) must pay off. Charged over the rest of a long
# reply (two tokens a step) it looks cheap, but decisions change long before that (a batch
# grows, acceptance drops, a cost probe lands) and the catch-up is paid in full at once; a short
# horizon keeps sequences that joined a batch where speculation barely pays from paying a
# prompt's worth of draft rows for it.
CATCHUP_PAYBACK_STEPS = 16
# A probe drafts for one step and most probes end back at k = 0, so the catch-up it triggers must
# pay off sooner (open prompts at 8 sequences: a probe of all eight read 468 draft rows, 2.2 s, six
# plain steps' worth, to learn one step of acceptance).
PROBE_PAYBACK_STEPS = 8


@dataclass(frozen=True)
class AdaptiveParams:
    margin: float = 0.03  # relative goodput gain needed to change the held decision
    plain_margin: float = 0.08  # relative gain over all-plain needed to start speculating
    plain_keep_margin: float = 0.02  # ... and to go on speculating (hysteresis band)
    # A batch size whose recent speculating decode steps measured at least ``plain_margin``
    # more tokens/s than its recent plain ones (``RealizedGoodput``) starts at the keep bar:
    # the gain the start bar guards against over-predicting was measured.
    measured_gain_lowers_start_bar: bool = True
    # ... and a speculating batch whose size measured its speculating decode steps at fewer
    # tokens/s than its plain ones lately must go on clearing the start bar, not the keep bar:
    # a gain predicted inside the band was measured to be a loss.
    measured_loss_raises_keep_bar: bool = True
    probe_every: int = 16  # steps at k = 0 before the first probe; probes align to multiples
    probe_max_interval: int = 256
    # Until any verify was seen, weigh each sequence for a probe at once instead of on the
    # schedule (``_cold_probe_ready``).
    cold_probe: bool = True
    probe_k: int = 2
    probe_acceptance: float = 0.9  # a probe must be able to pay off at this acceptance
    # Acceptance probes may cost (predicted seconds beyond what their expected tokens are worth)
    # this share of the time that steps with 'auto' sequences ran, banked up to
    # ``probe_credit_steps`` mean step times, so that however expensive one probe is, probing
    # costs at most about this share of throughput.
    probe_budget: float = 0.02
    probe_credit_steps: float = 4.0
    # How often to check the fit has seen live plain steps of this batch size lately. Cheap to
    # check often: at most ``CostModel.min_measured`` probes per size per 256 steps run, however
    # often it is checked, and a batch that just grew learns its plain price in ~3 x this.
    cost_probe_every: int = 8
    # A batch predicted this much faster speculating than plain is not cost-probed again once
    # its plain step has live measurements: no plausible error in that price flips the decision,
    # and at one sequence every plain step gives up half a step's tokens.
    cost_probe_max_gain: float = 0.3
    shape_probe_every: int = 8  # how often to look for a near-best row count not measured live
    shape_probe_tolerance: float = 0.15  # ... predicted within this share of the decision
    # Before a batch starts speculating, run plain until the fit has ``CostModel.min_measured``
    # live plain steps of its size: the start is decided against a measured plain price.
    plain_first: bool = True
    prefill_ema: float = 0.5  # weight of the newest step in the prefill-rows estimate
    # Let every drafting 'auto' sequence draft up to k_max in a decode-only step and stop it
    # where the draft's confidence in its tokens so far says more forwards are not worth their
    # time (``draft_stop``). On by default, with k_max 6: after a run of sure drafts a fifth and
    # sixth pay where the average says stop at four, and an unsure first draft ends the draft.
    # In two five-round sweeps (README) adaptive was within 5% of the best arm and within 3% of
    # plain at every point, judged on each round's paired ratios.
    stop_drafts_early: bool = True
    log_every: int = 100  # debug log line every this many observed steps (0: never)


@dataclass
class _SeqState:
    request_id: str
    k: int = 0  # held decision (a probe does not change it)
    zero_since: int = 0  # decision index when it was last set to 0 (or last probed)
    probe_interval: int = 16
    probing: bool = False
    probe_promising: bool = False  # every draft of the last probe was accepted
    cold_checked: bool = False  # weighed for a probe while the engine had no acceptance data
    last_seen: int = 0


class _Decision:
    """The k's of the last decision and the goodput (tokens / s) and step seconds predicted for
    them; a decision taken without pricing it (``_pinned``) is priced when first asked."""

    def __init__(
        self,
        ks: list[int] | None = None,
        goodput: float = 0.0,
        step_time: float = 0.0,
        price: Callable[[], tuple[float, float]] | None = None,
    ) -> None:
        self.ks = ks if ks is not None else []
        self._price = price
        self._priced = (goodput, step_time)

    def _get(self) -> tuple[float, float]:
        if self._price is not None:
            self._priced, self._price = self._price(), None
        return self._priced

    @property
    def goodput(self) -> float:
        return self._get()[0]

    @property
    def step_time(self) -> float:
        return self._get()[1]


class _SeqSnapshot(NamedTuple):
    """What pricing a decision reads of a sequence, as it was when the decision was taken."""

    seq_id: int
    spec_mode: str
    num_tokens: int
    num_draft_computed_tokens: int
    num_output_tokens: int
    params: SamplingParams


class AdaptiveController:
    """Implements ``SpeculationController``; see the module docstring for the decision rule.

    Args:
        k_max: longest draft (the engine's num_speculative_tokens).
        cost: step-cost model (seeded by calibration or default coefficients).
        acceptance: per-sequence acceptance tracker.
        params: hysteresis, probing and logging knobs.
        per_position_forwards: True for a draft model (one forward per drafted position), False
            for a lookup proposer that drafts every position at once.
    """

    def __init__(
        self,
        k_max: int,
        cost: CostModel | None = None,
        acceptance: AcceptanceTracker | None = None,
        params: AdaptiveParams | None = None,
        per_position_forwards: bool = True,
    ) -> None:
        self.k_max = k_max
        self.cost = cost or CostModel()
        self.acceptance = acceptance or AcceptanceTracker(k_max)
        self.params = params or AdaptiveParams()
        self.per_position_forwards = per_position_forwards
        self._states: dict[int, _SeqState] = {}
        self._num_decisions = 0
        self._num_observed = 0
        self.realized = RealizedGoodput()
        # decisions to start speculating that cleared the keep bar, not the start bar, because
        # the batch's size measured speculation paying lately
        self.num_measured_starts = 0
        # decisions that went plain from a speculating batch only because its size measured
        # speculation losing lately (the gain predicted cleared the keep bar, not the start bar)
        self.num_measured_stops = 0
        self._last = _Decision()
        # 'auto' sequences that drafted at the last decode-only decision, and whether any of
        # them is in the batch being decided (it is then "speculating already")
        self._drafting: frozenset[int] = frozenset()
        self._speculating = False
        self._ready: dict[int, int] = {}  # seq_id -> raw draft catch-up rows, this step
        self._ready_fresh = False
        self.extra_tokens = 0.0  # estimated non-decode (prefill) rows per step
        self.extra_seqs = 0.0
        self._expected_prefill: tuple[int, int] | None = None  # told by the engine, next step
        self.num_probes = 0
        self.num_probes_deferred = 0  # probe rounds put off for want of probe budget
        self._probe_credit_s: float | None = None  # None until the first step is observed
        self._mean_step_s = 0.0  # moving average of observed step times (the credit's unit)
        self.num_cost_probes = 0
        self.num_shape_probes = 0
        self.num_changes = 0
        self.confidence = ConfidenceCalibration(initial=self.acceptance.initial)
        self.num_draft_stops = 0  # sequence-steps whose draft stopped before its k
        self._decision_extra = (0.0, 0.0)  # (prefill rows, seqs) the last decision assumed
        # seq_id -> k decided, and drafts so far this step, for every decode of the last decision
        self._draft_ks: dict[int, int] = {}
        self._draft_depth: dict[int, int] = {}
        self._probed: set[int] = set()  # sequences a probe moved at the last decision
        # True: no caches and no shortcut, every decision computed in full (the reference the
        # equivalence test compares the fast path against; decisions are identical either way).
        self._exact_reference = False
        # seq_id -> (room, expected-tokens table), valid while ``_gains_key`` (the tracker and
        # its version) holds
        self._gains: dict[int, tuple[int, list[float]]] = {}
        self._gains_key: tuple[AcceptanceTracker, int] | None = None
        self._optimistic: dict[int, tuple[tuple[int, float], list[float]]] = {}  # probe tables
        self._gains_inserts = 0  # tables put in ``_gains`` (a table object is never changed)
        # _plain_bound's matrix of expected tokens, by (_gains_inserts, tables' identities)
        self._bound_gains: tuple[tuple, np.ndarray] | None = None
        # raw catch-up rows -> draft seconds beyond two rows, under one draft fit (model, epoch, fit)
        self._catchup_memo: dict[int, float] = {}
        self._catchup_key: tuple | None = None

    # ---- decision ---------------------------------------------------------------------------
    def expect_prefill(self, rows: int, seqs: int) -> None:
        """The prefill rows (and their sequences) the next step can carry beside the decodes.

        Known from the scheduler's queues, it replaces the moving average for one decision: right
        after a burst of prompts is prefilled the average still says "big prefill chunk", and
        verify rows riding on a big step look nearly free when the real step is decodes alone.
        """
        self._expected_prefill = (rows, seqs)

    def choose_k(self, seqs: list[Sequence]) -> list[int]:
        self._num_decisions += 1
        extra_tokens, extra_seqs = self.extra_tokens, self.extra_seqs
        if self._expected_prefill is not None:
            extra_tokens, extra_seqs = map(float, self._expected_prefill)
            self._expected_prefill = None
        self._decision_extra = (extra_tokens, extra_seqs)
        now = self._num_decisions
        self.cost.pin_draft_factors()  # every decision, whichever path takes it
        # Speculating already is a property of this batch, not of the last one: a batch of new
        # requests after the previous ones finished has read none of its prompts into the draft
        # and starts at the start bar (and after plain-first), whatever the last batch did.
        self._speculating = not self._drafting.isdisjoint(s.seq_id for s in seqs)
        if not self._exact_reference:
            out = self._pinned(seqs, extra_tokens, extra_seqs)
            if out is not None:
                return out
        if not self._exact_reference and extra_tokens < 1:
            out = self._steady_plain(seqs, extra_tokens, extra_seqs)
            if out is not None:
                return out
        prior = self.acceptance.prior()
        if self._exact_reference:
            terms = [self._terms(seq, prior) for seq in seqs]
        else:
            terms = self._all_terms(seqs, prior)
        self._ready = {s.seq_id: max(1, s.num_tokens - s.num_draft_computed_tokens) for s in seqs}
        self._ready_fresh = True
        batch = self._objective(terms, extra_tokens, extra_seqs)
        held = self._held(seqs, terms, batch)
        v_held = batch.assign(held)
        starts = [held, [0] * len(seqs)] + [[k] * len(seqs) for k in range(1, self.k_max + 1)]
        best, v_best = batch.search(starts)
        changed = sum(a != b for a, b in zip(best, held, strict=True)) / max(1, len(seqs))
        chosen = best if v_best > v_held * (1.0 + self.params.margin * changed) else held
        chosen = self._plain_unless_clearly_better(batch, chosen)
        if extra_tokens < 1 and not self._speculating and self.params.plain_first:
            chosen = self._plain_first(seqs, terms, chosen)
        if extra_tokens < 1:  # decode-only: its decision sets which side of the band we are on
            self._drafting = frozenset(
                seq.seq_id
                for seq, k, t in zip(seqs, chosen, terms, strict=True)
                if k > 0 and t.fixed_k is None
            )
        batch.assign(chosen)
        out = list(chosen)
        probes: list[int] = []
        p = self.params
        cold = self._cold_probe_ready(seqs)
        on_schedule = now % p.probe_every == 0
        if on_schedule or cold:
            probes = self._probes(seqs, terms, batch, chosen, prior, out, cold)
        if not (on_schedule or probes):  # one kind of probe a step
            if now % p.cost_probe_every == p.cost_probe_every // 4:
                self._cost_probe(seqs, terms, batch, out)
            elif now % p.shape_probe_every == p.shape_probe_every // 2:
                self._shape_probe(terms, batch, out)
        batch.assign(out)  # the predicted step below is the one that will run
        batch.resum()  # priced the same however the search reached it
        self._update_states(seqs, chosen, set(probes))
        self._last = _Decision(out, batch.tokens_per_s(), batch.step_time())
        self._forget_stale()
        # A probe's drafts run to its k: the shape or acceptance it is there to measure would
        # otherwise never be seen (cut at one draft, a probe of a row count priced too dear
        # measures one row again, and the price that keeps it from being chosen stands).
        self._probed = {s.seq_id for s, c, k in zip(seqs, chosen, out, strict=True) if k != c}
        if self.params.stop_drafts_early and extra_tokens < 1:
            out = self._deepened(terms, chosen, out)
        self._draft_ks = {s.seq_id: k for s, k in zip(seqs, out, strict=True)}
        self._draft_depth = {s.seq_id: min(k, 1) for s, k in zip(seqs, out, strict=True)}
        return out

    @staticmethod
    def _deepened(terms: list[SeqTerms], chosen: list[int], out: list[int]) -> list[int]:
        """``out`` with every drafting 'auto' sequence allowed its longest useful draft.

        Where drafts stop early the k decided above, from average acceptance, is the wrong cap:
        after a run of sure drafts one more forward pays although the average says it does not,
        and ``keep_drafting`` stops the sequence where the draft's confidence says it does not
        pay. So the decision keeps saying who drafts (k > 0) and what the step is worth (the
        goodput ``keep_drafting`` weighs each forward against); how far each drafts is left to
        the draft's confidence. Not in a step with prefill, whose token budget the longer drafts
        would take from the chunk, and not for a sequence a probe moved (its k is the point)."""
        return [
            t.max_k if t.fixed_k is None and k > 0 and k == c else k
            for t, c, k in zip(terms, chosen, out, strict=True)
        ]

    def _pinned(
        self, seqs: list[Sequence], extra_tokens: float, extra_seqs: float
    ) -> list[int] | None:
        """The decision for a batch without 'auto' sequences (an A/B arm, an eval), else None.

        Every k is fixed ('on': as many as max_tokens can use, 'off': 0), so the search, the bar
        and every probe (all of them move 'auto' sequences only) leave it as it is: this is the
        decision the full computation makes, with the same side effects, minus its pricing, which
        only stats and traces read and which is done if and when they ask.
        """
        out, ready, fields = [], {}, []
        for seq in seqs:
            mode = seq.spec_mode
            if mode == "off":
                out.append(0)
            elif mode == "on":
                out.append(self._max_useful_k(seq))
            else:
                return None
            n, drafted = seq.num_tokens, seq.num_draft_computed_tokens
            ready[seq.seq_id] = max(1, n - drafted)
            fields.append((seq.seq_id, mode, n, drafted, seq.num_output_tokens, seq.params))
        self._ready, self._ready_fresh = ready, True
        if extra_tokens < 1:
            self._drafting = frozenset()
        self._update_states(seqs, out, set())

        def price() -> tuple[float, float]:
            snapshot = [_SeqSnapshot(*f) for f in fields]
            terms = self._all_terms(snapshot, self.acceptance.prior())
            batch = self._objective(terms, extra_tokens, extra_seqs)
            batch.assign(out)
            batch.resum()  # as choose_k prices its decision
            return batch.tokens_per_s(), batch.step_time()

        self._last = _Decision(out, price=price)
        self._forget_stale()
        return out

    def _plain_unless_clearly_better(self, batch: BatchGoodput, chosen: list[int]) -> list[int]:
        """All 'auto' sequences plain unless speculating is predicted to beat that by
        ``plain_margin`` (``plain_keep_margin`` while the batch is speculating already).

        Plain decode is the safe side of every error the prediction makes: sequences picked for
        a high acceptance estimate draft worse afterwards (regression to the mean), a sequence
        that starts drafting again pays its draft's catch-up, and speculating shapes, mixed ones
        above all, have fewer live steps behind their predicted cost. A predicted gain smaller
        than those errors is not worth taking.
        """
        plain = batch.clamp([0] * len(chosen))
        if chosen == plain:
            return chosen
        margin = self._bar(len(chosen))
        if margin <= 0:
            return chosen
        v_chosen = batch.assign(chosen)
        v_plain = batch.assign(plain)
        if v_chosen <= v_plain * (1.0 + margin):
            keep = min(self.params.plain_margin, self.params.plain_keep_margin)
            if self._speculating and margin > keep and v_chosen > v_plain * (1.0 + keep):
                self.num_measured_stops += 1
            return plain
        if not self._speculating and margin < self.params.plain_margin:
            self.num_measured_starts += 1
        return chosen

    def _bar(self, num_decodes: int) -> float:
        """The gain over all-plain speculation must be predicted to have: ``plain_keep_margin``
        for a batch speculating already, unless its size measured speculation losing lately
        (``measured_loss_raises_keep_bar``), and for one whose size measured speculation paying
        lately (``measured_gain_lowers_start_bar``); else ``plain_margin``."""
        p = self.params
        keep = min(p.plain_margin, p.plain_keep_margin)
        if self._speculating:
            if p.measured_loss_raises_keep_bar:
                gain = self.realized.gain(num_decodes, self._num_observed)
                if gain is not None and gain < 0.0:
                    return p.plain_margin
            return keep
        if p.measured_gain_lowers_start_bar:
            gain = self.realized.gain(num_decodes, self._num_observed)
            if gain is not None and gain >= p.plain_margin:
                return keep
        return p.plain_margin

    def _plain_first(
        self, seqs: list[Sequence], terms: list[SeqTerms], chosen: list[int]
    ) -> list[int]:
        """Plain until live plain steps of this batch size were measured, before starting to speculate.

        Until then the plain step is priced from other sizes and from bare calibration forwards,
        which can be far off (the real pair at 8 sequences: predicted 400-430 ms, ran 280 ms); a
        start believed on that price pays every sequence's draft catch-up, a prompt's worth of
        draft rows, for a gain that is not there. A few plain steps cost little next to that.
        """
        plain = self._auto_plain(terms, chosen)
        if plain == chosen or self._plain_measured(len(seqs), recent=self.cost.window):
            return chosen
        self.num_cost_probes += 1
        return plain

    @staticmethod
    def _auto_plain(terms: list[SeqTerms], ks: list[int]) -> list[int]:
        """``ks`` with every 'auto' sequence at k = 0 ('on' and 'off' ones keep theirs)."""
        return [k if t.fixed_k is not None else 0 for k, t in zip(ks, terms, strict=True)]

    def _plain_measured(self, n_plain: float, recent: int = 256) -> bool:
        """Whether the fit has enough live plain steps within 25% of ``n_plain`` rows lately."""
        return self.cost.has_plain_sample(0.8 * n_plain, 1.25 * n_plain, recent=recent)

    def _steady_plain(
        self, seqs: list[Sequence], extra_tokens: float, extra_seqs: float
    ) -> list[int] | None:
        """The decision without the search when it is provably all plain, else None.

        Applies to a decode-only step (``extra_tokens`` < 1) where every sequence is held at
        k = 0 ('auto' or 'off', known, not just probed) and no probe is due. Then ``choose_k``
        keeps plain unless some assignment beats plain by the start bar
        (``_plain_unless_clearly_better``), and none of the probes that follow acts (no probe is
        due; a cost probe needs a speculating sequence; a shape probe a drafting one; plain first
        a proposed start). ``_plain_bound`` shows that no assignment that drafts at all can clear
        that bar, whatever the search would find: the decision is then all zeros, exactly as the
        search would have made it, with the same side effects.
        """
        now, p, states = self._num_decisions, self.params, self._states
        if not seqs:
            return None
        margin = self._bar(len(seqs))
        if margin <= 0:
            return None
        probe_step = now % p.probe_every == 0
        cold = self._cold_probe_ready(seqs)
        self._check_gains_cache()
        cache, prior, k_max = self._gains, None, self.k_max
        tables, free = [], []  # expected-tokens tables of the sequences free to draft, and they
        due, due_seqs = [], []  # on a probe step: optimistic tables of those due for a probe
        ready = {}  # what choose_k records as _ready (raw catch-up rows), if this decides
        most_rows, most_gain = 0, 0.0  # of the free sequences: sum of rooms, of E(room) - 1
        # This loop runs for every sequence every step a batch sits plain: written for speed
        # (conditionals rather than min/max calls, one pass).
        for seq in seqs:
            seq_id = seq.seq_id
            st = states.get(seq_id)
            if st is None or st.k != 0 or st.probing or (cold and not st.cold_checked):
                return None
            st.last_seen = now  # as _update_states sets it (the full computation, if not this)
            raw = seq.num_tokens - seq.num_draft_computed_tokens
            ready[seq_id] = raw if raw > 1 else 1
            mode = seq.spec_mode
            if mode == "off":
                continue
            if mode != "auto":
                return None
            max_tokens = seq.params.max_tokens  # _max_useful_k, inlined
            if max_tokens is None:
                room = k_max if k_max < 255 else 255
            else:
                remaining = max_tokens - seq.num_output_tokens
                room = (remaining if remaining > 1 else 1) - 1
                room = k_max if k_max < room else room
            if room <= 0:
                continue
            if probe_step and now - st.zero_since >= st.probe_interval:
                due.append(self._optimistic_table(seq_id, room))
                due_seqs.append(seq)
            hit = cache.get(seq_id)
            if hit is None or hit[0] != room:  # the table _all_terms would use (same cache)
                prior = prior or self.acceptance.prior()
                table = self.acceptance.expected_table(seq_id, prior, room)
                hit = cache[seq_id] = (room, table)
                self._gains_inserts += 1
            table = hit[1]
            tables.append(table)
            free.append(seq)
            most_rows += len(table) - 1
            most_gain += table[-1] - 1.0
        n = len(seqs)
        num_seqs = n + extra_seqs
        curve = self.cost.target_curve()
        # As BatchGoodput prices the all-plain step (no prefill beside it, no draft forward).
        step_time = max(curve(extra_tokens + n, num_seqs), 1e-9)
        plain = (n, extra_tokens + n, num_seqs, step_time)
        # Catch-up seconds only when the bound needs them (they change every step).
        sums = (most_rows, most_gain)
        if tables and not (
            self._plain_bound(tables, *plain, margin, sums=sums)
            or self._plain_bound(tables, *plain, margin, self._catchups(free, False), sums)
        ):
            return None
        # Due sequences are probed only if, at an optimistic acceptance and everything else
        # held where it is, some assignment would beat plain by ``plain_margin`` (``_probes``).
        if due and not self._plain_bound(
            due, *plain, p.plain_margin, self._catchups(due_seqs, True)
        ):
            return None
        # Side effects of the full decision on this outcome: see choose_k and _update_states
        # (a known sequence held at 0, not probing, kept at 0 only has last_seen move, which
        # the loop above did).
        self._ready, self._ready_fresh = ready, True
        self._drafting = frozenset()
        out = [0] * n
        self._last = _Decision(out, n / step_time, step_time)
        self._forget_stale()
        return out

    def _optimistic_table(self, seq_id: int, room: int) -> list[float]:
        """The expected-tokens table ``_probes`` asks about for a due sequence (cached as the
        tracker's tables are)."""
        p = self.params
        hit = self._optimistic.get(seq_id)
        if hit is None or hit[0] != (room, p.probe_acceptance):
            est = self.acceptance.estimate(seq_id, self.acceptance.prior())
            optimistic = [max(a, p.probe_acceptance) for a in est[:room]]
            hit = self._optimistic[seq_id] = (
                (room, p.probe_acceptance),
                expected_tokens_table(optimistic),
            )
            self._gains_inserts += 1
        return hit[1]

    def _catchups(self, seqs: list[Sequence], probe: bool) -> list[float]:
        """The catch-up seconds ``_terms`` (or, for a probe, ``_probes``) charges each."""
        steps = PROBE_PAYBACK_STEPS if probe else CATCHUP_PAYBACK_STEPS
        return [self._catchup(seq, steps)[1] for seq in seqs]

    def _plain_bound(
        self,
        tables: list[list[float]],
        n: int,
        plain_rows: float,
        num_seqs: float,
        plain_time: float,
        margin: float,
        catchup_s: list[float] | None = None,
        sums: tuple[int, float] | None = None,
    ) -> bool:
        """Whether no assignment that drafts at all can beat plain by ``margin``.

        ``tables``: E_i(0..room_i) of the sequences free to draft (the others commit one token
        each). An assignment drafting k_i (K in all, the longest kappa) commits n + sum_i
        (E_i(k_i) - 1) tokens in at least A + a kappa + b K seconds: A the least the target curve
        takes for any row count it can have, and a, b from the draft fit (``CostModel.
        draft_bound``: every forward pays its fixed part, every drafted token its row). It is
        not better than plain by the bar when n + sum_i (E_i(k_i) - 1) <= c (A + a kappa + b K),
        c = (n / plain time) (1 + margin), i.e. when for every kappa
        sum_i max_{k <= kappa} (E_i(k) - 1 - c b k) <= c A + c a kappa - n. Given the catch-up
        seconds C_i each sequence adds if it drafts (``catchup_s``, in ``tables``' order; else
        none are counted, which only weakens the bound), every drafting term also loses c C_i.
        ``sums``: (sum_i room_i, sum_i (E_i(room_i) - 1)) where the caller added them up
        already. A 1e-6 slack in c covers the rounding of every value involved.
        """
        draft = self.cost.draft_bound(self.per_position_forwards)
        if sums is None:
            sums = (sum(len(t) - 1 for t in tables), sum(t[-1] - 1.0 for t in tables))
        most_rows, most_gain = sums
        target = self.cost.target_curve().lower_bound(
            plain_rows + 1, plain_rows + most_rows, num_seqs
        )
        if draft is None or target is None:
            return False
        per_forward, per_row = draft
        c = n / plain_time * (1 + margin) / (1 + 1e-6)
        # Coarse first: every sequence at its longest draft in the cheapest drafting step.
        most_tokens = n + most_gain
        if catchup_s is None and most_tokens <= c * (target + per_forward + per_row):
            return True
        k_max = self.k_max
        key = (self._gains_inserts, *map(id, tables))  # the same table objects: the same matrix
        if self._bound_gains is None or self._bound_gains[0] != key:
            pad = [-math.inf] * k_max
            rows = [t[1:] + pad[: k_max + 1 - len(t)] for t in tables]
            self._bound_gains = (key, np.array(rows) - 1.0)  # [seqs, k_max]: E_i(k) - 1
        ks = np.arange(1, k_max + 1, dtype=np.float64)
        net = self._bound_gains[1] - (c * per_row) * ks  # E_i(k) - 1 - c b k
        if catchup_s is not None:
            net -= c * np.array(catchup_s)[:, None]
        best = np.maximum.accumulate(np.maximum(net, 0.0), axis=1).sum(axis=0)  # per kappa
        forwards = ks if self.per_position_forwards else np.ones_like(ks)
        return bool(np.all(best <= c * target + c * per_forward * forwards - n))

    def _check_gains_cache(self) -> None:
        """Drop cached expected-tokens tables once the tracker (or its data) changed."""
        key = self._gains_key
        if key is None or key[0] is not self.acceptance or key[1] != self.acceptance.version:
            self._gains, self._optimistic = {}, {}
            self._gains_inserts += 1
            self._gains_key = (self.acceptance, self.acceptance.version)

    def _all_terms(
        self, seqs: list[Sequence] | list[_SeqSnapshot], prior: list[float]
    ) -> list[SeqTerms]:
        """``_terms`` for every sequence, expected-tokens tables cached while the
        acceptance tracker has seen nothing new (the same tables: the same arithmetic)."""
        self._check_gains_cache()
        cache, out = self._gains, []
        for seq in seqs:
            room = self._max_useful_k(seq)
            hit = cache.get(seq.seq_id)
            if hit is not None and hit[0] == room:
                gains = hit[1]
            else:
                gains = self.acceptance.expected_table(seq.seq_id, prior, room)
                cache[seq.seq_id] = (room, gains)
                self._gains_inserts += 1
            mode = seq.spec_mode
            fixed = 0 if mode == "off" else room if mode == "on" else None
            rows, catchup_s = self._catchup(seq, CATCHUP_PAYBACK_STEPS)
            out.append(SeqTerms(gains, rows, fixed, catchup_s))
        return out

    def _terms(self, seq: Sequence, prior: list[float]) -> SeqTerms:
        room = self._max_useful_k(seq)
        gains = expected_tokens_table(self.acceptance.estimate(seq.seq_id, prior)[:room])
        fixed = None
        if seq.spec_mode == "off":
            fixed = 0
        elif seq.spec_mode == "on":
            fixed = room
        rows, catchup_s = self._catchup(seq, CATCHUP_PAYBACK_STEPS)
        return SeqTerms(gains, rows, fixed, catchup_s)

    def _catchup(self, seq: Sequence | _SeqSnapshot, payback_steps: int) -> tuple[float, float]:
        """(rows the sequence adds to the first draft forward, seconds charged to this step for
        the rest of its draft's catch-up) if it drafts.

        The draft must read a whole prompt (or everything since it last drafted) once; that buys
        speculation for the steps after, so only a share is charged: the rows beyond the usual
        one or two, priced as the compute-bound rows they are, spread over ``payback_steps``
        steps, fewer near the end of the reply (about two tokens a step).
        """
        raw = max(1, seq.num_tokens - seq.num_draft_computed_tokens)
        if raw <= 2:
            return float(raw), 0.0
        horizon = min(payback_steps, max(1.0, self._remaining_tokens(seq) / 2))
        return 2.0, self._catchup_seconds(raw) / horizon

    def _catchup_seconds(self, raw_rows: int) -> float:
        """Draft seconds for reading ``raw_rows`` unseen rows beyond the usual two (a lookup
        proposer reads nothing). Memoised per draft fit (``CostModel.draft_epoch``)."""
        if raw_rows <= 2 or not self.per_position_forwards:
            return 0.0
        if self._exact_reference:
            return self._catchup_seconds_uncached(raw_rows)
        key = (self.cost, self.cost.draft_epoch, self.cost.draft)
        old = self._catchup_key
        if old is None or old[0] is not key[0] or old[1] != key[1] or old[2] is not key[2]:
            self._catchup_memo, self._catchup_key = {}, key
        t = self._catchup_memo.get(raw_rows)
        if t is None:
            t = self._catchup_memo[raw_rows] = self._catchup_seconds_uncached(raw_rows)
        return t

    def _catchup_seconds_uncached(self, raw_rows: int) -> float:
        whole = self.cost.draft_time([(raw_rows, 1)])
        return max(0.0, whole - self.cost.draft_time([(2, 1)]))

    def _remaining_tokens(self, seq: Sequence | _SeqSnapshot) -> int:
        if seq.params.max_tokens is None:
            return 256
        return max(1, seq.params.max_tokens - seq.num_output_tokens)

    def _max_useful_k(self, seq: Sequence | _SeqSnapshot) -> int:
        # Drafts beyond max_tokens can never be committed (the scheduler clips them too).
        return max(0, min(self.k_max, self._remaining_tokens(seq) - 1))

    def _held(self, seqs: list[Sequence], terms: list[SeqTerms], batch: BatchGoodput) -> list[int]:
        """Last step's decisions; sequences new to the controller join at their best k."""
        held, new = [], []
        for i, seq in enumerate(seqs):
            st = self._states.get(seq.seq_id)
            if st is None:
                new.append(i)
            held.append(0 if st is None else st.k)
        batch.assign(batch.clamp(held))
        for i in new:
            if terms[i].fixed_k is None:
                batch.set(i, batch.best_move(i))
        return list(batch.ks)

    def _probes(
        self,
        seqs: list[Sequence],
        terms: list[SeqTerms],
        batch: BatchGoodput,
        chosen: list[int],
        prior: list[float],
        out: list[int],
        cold: bool,
    ) -> list[int]:
        """Sequences due for a probe that could pay off, judged together (they share forwards):
        on the schedule, or (``cold``) the first time they are weighed without acceptance data.
        Sets their k in ``out`` and returns their indices."""
        now, p = self._num_decisions, self.params
        due = []
        for i, seq in enumerate(seqs):
            st = self._states.get(seq.seq_id)
            if terms[i].fixed_k is not None or chosen[i] > 0 or terms[i].max_k == 0 or st is None:
                continue
            on_schedule = now % p.probe_every == 0 and now - st.zero_since >= st.probe_interval
            if on_schedule or (cold and not st.cold_checked):
                due.append(i)
            if cold:
                st.cold_checked = True
        if not due:
            return []
        # Would the due sequences be worth drafting for if their acceptance were high? Ask the
        # same objective with everything else pinned where it is.
        what_if = [
            SeqTerms(t.gains, t.catchup_rows, k, t.catchup_s)
            for t, k in zip(terms, chosen, strict=True)
        ]
        for i in due:
            est = self.acceptance.estimate(seqs[i].seq_id, prior)
            optimistic = [max(a, p.probe_acceptance) for a in est[: terms[i].max_k]]
            gains = expected_tokens_table(optimistic)
            rows, catchup_s = self._catchup(seqs[i], PROBE_PAYBACK_STEPS)
            what_if[i] = SeqTerms(gains, rows, None, catchup_s)
        trial = self._same_step(batch, what_if)
        v_chosen = trial.assign(chosen)
        v_trial = trial.search([chosen, [self.k_max] * len(chosen)], refine=2)[1]
        # The same bar as the decision itself: a gain the decision would not take even if the
        # optimistic acceptance came true is not worth a probe (whose catch-up is paid now).
        if v_trial <= v_chosen * (1.0 + p.plain_margin):
            return []
        probes = [i for i in due if trial.ks[i] > 0]
        probed = list(out)
        for i in probes:
            probed[i] = min(p.probe_k, terms[i].max_k)
        if probes and not self._spend_probe_budget(seqs, terms, batch, out, probed, probes):
            self.num_probes_deferred += 1
            return []
        out[:] = probed
        self.num_probes += len(probes)
        return probes

    def _cold_probe_ready(self, seqs: list[Sequence]) -> bool:
        """Whether sequences not yet weighed cold are due for a probe now, off the schedule.

        Until the first verify the acceptance estimate is the start-up guess alone, and a batch
        held plain on it would wait ``probe_every`` steps or more for its first probe: the first
        requests an engine serves would all run plain for that long (a single request on the
        real pair: 24 plain steps, 4% of its time). So while there is no acceptance data each
        sequence is weighed for a probe once, as soon as plain first has measured its batch's
        plain step; after that the schedule applies (a batch too big to ever speculate is not
        searched for a probe every step).
        """
        if not self.params.cold_probe or self.acceptance.has_prior_data():
            return False
        return not self.params.plain_first or self._plain_measured(
            len(seqs), recent=self.cost.window
        )

    def _objective(
        self, terms: list[SeqTerms], extra_tokens: float, extra_seqs: float
    ) -> BatchGoodput:
        """The batch goodput of ``terms`` with ``extra_tokens`` prefill rows (of ``extra_seqs``
        sequences) beside them, under this controller's cost model."""
        return BatchGoodput(
            terms,
            self.cost,
            self.k_max,
            extra_tokens,
            extra_seqs,
            self.per_position_forwards,
            self._exact_reference,
        )

    def _same_step(self, batch: BatchGoodput, terms: list[SeqTerms]) -> BatchGoodput:
        """The objective of ``batch``'s step (same prefill rows beside it) over other terms."""
        return self._objective(terms, batch.extra_tokens, batch.num_seqs - len(batch.terms))

    def _spend_probe_budget(
        self,
        seqs: list[Sequence],
        terms: list[SeqTerms],
        batch: BatchGoodput,
        out: list[int],
        probed: list[int],
        probes: list[int],
    ) -> bool:
        """Take the probes' predicted cost from the probe budget; False (nothing taken) when the
        budget cannot cover it.

        The cost is the seconds the probes add to the step, their drafts' whole catch-up included
        (a probe pays it at once), less what their expected tokens are worth at the rate of the
        step without them. The credit may go below zero once it is full (``probe_credit_steps``
        step times), so a probe dearer than that still runs now and then, after a long wait.
        """
        real = list(terms)
        for i in probes:
            raw = self._ready.get(seqs[i].seq_id, 1)
            real[i] = replace(terms[i], catchup_s=self._catchup_seconds(raw))
        step = self._same_step(batch, real)
        step.assign(out)
        t0, g0 = step.step_time(), step.sum_gain
        step.assign(probed)
        t1, g1 = step.step_time(), step.sum_gain
        overhead = max(0.0, (t1 - t0) - (g1 - g0) * t0 / max(g0, 1e-9))
        credit = self._probe_credit_s
        cap = self.params.probe_credit_steps * self._mean_step_s
        if credit is not None and credit < min(overhead, cap):
            return False
        self._probe_credit_s = (credit if credit is not None else cap) - overhead
        return True

    def _earn_probe_budget(self, step_time: float) -> None:
        """Bank ``probe_budget`` of an observed step's time, up to ``probe_credit_steps`` steps."""
        w = 0.05
        self._mean_step_s = (
            step_time if self._mean_step_s == 0 else ((1 - w) * self._mean_step_s + w * step_time)
        )
        cap = self.params.probe_credit_steps * self._mean_step_s
        credit = cap if self._probe_credit_s is None else self._probe_credit_s
        self._probe_credit_s = min(cap, credit + self.params.probe_budget * step_time)

    def _cost_probe(
        self, seqs: list[Sequence], terms: list[SeqTerms], batch: BatchGoodput, out: list[int]
    ) -> None:
        """Run a speculating step plain when the fit has not seen a plain step of this size lately.

        A batch that always speculates never measures its plain step time, so a cost curve that
        flatters verification would never be corrected by the steps it chooses. (The other side
        needs no such step: calibration and prefill chunks supply steps with many rows, and a
        forced draft after a long k = 0 spell would pay the draft's whole catch-up.) "Lately" is
        the cost model's ``refresh_after``: the machine's speed drifts, and a plain price from
        a faster or slower spell than the speculating steps it is weighed against tips the
        decision (open prompts at four sequences: plain priced at 167 ms from the round before,
        running at 130, and speculation started for a gain predicted at 18% that lost 13% to
        plain). ``out`` is updated in place.
        """
        plain = self._auto_plain(terms, out)
        n_plain = len(seqs) + batch.extra_tokens
        if plain == out or self._plain_measured(n_plain, recent=self.cost.refresh_after):
            return
        if self._plain_measured(n_plain, recent=self.cost.window):
            v_out, v_plain = batch.assign(out), batch.assign(plain)
            batch.assign(out)
            v_plain *= self._plain_price_slack(plain, batch)
            if v_out > v_plain * (1.0 + self.params.cost_probe_max_gain):
                return
        out[:] = plain
        self.num_cost_probes += 1

    def _plain_price_slack(self, plain: list[int], batch: BatchGoodput) -> float:
        """How many times faster than priced an all-plain decode-only step of this batch has
        run: its price over the fastest live step of its shape kept (1 if none, or if the step
        is not all plain and decode-only, where the target forward is not the whole step).

        The far-better exemption of ``_cost_probe`` must hold at that price too: a plain price
        from a slow spell makes speculation look far better than it is (open prompts at two
        sequences: plain priced at 181 ms from a slow spell, running at 100, speculation
        predicted 70% faster and 12% slower), and, being far better, it would not be measured
        again."""
        n = len(plain)
        if any(plain) or batch.extra_tokens >= 1 or n == 0:
            return 1.0
        fastest = self.cost.fastest_at(n, n)
        if fastest is None or fastest <= 0:
            return 1.0
        return max(1.0, self.cost.target_time(n, n) / fastest)

    def _shape_probe(self, terms: list[SeqTerms], batch: BatchGoodput, out: list[int]) -> None:
        """Run the speculating sequences at another k for one step when that step is predicted
        nearly as good as the decision but its target row count, or its draft rows, have not
        been measured live lately.

        A shape the controller does not choose is never measured live, so its price stays
        whatever a bare calibration forward or the fit said. On a CPU that can be far off, on
        both sides: target row counts 3 and 5 at one sequence, 308 and 199 ms calibrated, 293 and
        279 ms live; four sequences drafting two tokens each, 307 ms predicted by a draft line
        fitted mostly on four-token steps, 244 ms live. The decision then avoids a k that is as
        good or better, for good. Only sequences already drafting move (no catch-up to pay), only
        to a near-best shape, and a shape stops being a candidate once both sides have
        ``min_measured`` live steps within the cost model's ``refresh_after`` observations, so the
        cost is bounded (and a price measured during a slow spell is re-measured: the cost model
        then counts the fresh steps alone).
        """
        auto = [i for i, t in enumerate(terms) if t.fixed_k is None and out[i] > 0]
        if not auto:
            return
        v_out = batch.assign(out)
        n_fixed = batch.extra_tokens + len(terms) + sum(out) - sum(out[i] for i in auto)
        best: tuple[float, list[int]] | None = None
        for k in range(1, self.k_max + 1):
            trial = list(out)
            for i in auto:
                trial[i] = min(k, terms[i].max_k)
            if trial == out:
                continue
            rows = round(n_fixed + sum(trial[i] for i in auto))
            v = batch.assign(trial)
            need, fresh = self.cost.min_measured, self.cost.refresh_after
            if (
                self.cost.num_live_at(rows, recent=fresh) >= need
                and self.cost.num_live_draft_at(batch.draft_rows(), recent=fresh) >= need
            ):
                continue
            if v >= v_out * (1.0 - self.params.shape_probe_tolerance) and (
                best is None or v > best[0]
            ):
                best = (v, trial)
        batch.assign(out)
        if best is not None:
            out[:] = best[1]
            self.num_shape_probes += 1

    def _update_states(self, seqs: list[Sequence], chosen: list[int], probes: set[int]) -> None:
        now, p = self._num_decisions, self.params
        for i, seq in enumerate(seqs):
            st = self._states.get(seq.seq_id)
            if st is None:
                st = _SeqState(seq.request_id, k=-1, zero_since=now, probe_interval=p.probe_every)
                self._states[seq.seq_id] = st
            k = chosen[i]
            if st.probing and k == 0:
                # Not back on yet. A promising probe is repeated soon (one probe is little
                # evidence against a long history); a poor one makes the next wait longer.
                if st.probe_promising:
                    st.probe_interval = p.probe_every
                else:
                    st.probe_interval = min(2 * st.probe_interval, p.probe_max_interval)
            st.probing = i in probes
            if k > 0:
                st.probe_interval = p.probe_every
            if (k == 0 and st.k != 0) or st.probing:
                st.zero_since = now
            if st.k >= 0 and k != st.k:
                self.num_changes += 1
            st.k = k
            st.last_seen = now

    def _forget_stale(self) -> None:
        now = self._num_decisions
        if now % _FORGET_EVERY:
            return
        for seq_id in [i for i, st in self._states.items() if now - st.last_seen > _FORGET_AFTER]:
            self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
        self.acceptance.forget(seq_id)

    @property
    def stops_drafts_early(self) -> bool:
        # Off (the default), nobody asks keep_drafting and the calibration learns nothing: the
        # confidences it learns from are computed only for the rule that reads them.
        return self.params.stop_drafts_early

    def keep_drafting(self, seqs: list[Sequence], confidences: list[list[float]]) -> list[bool]:
        """Which sequences draft one more token this step (see ``draft_stop``): 'on' ones and
        those a probe moved always; other 'auto' ones where the tokens the forward adds per
        second it adds beat the step's predicted goodput."""
        probed = self._probed
        keep = [s.spec_mode != "auto" or s.seq_id in probed for s in seqs]
        auto = [i for i, k in enumerate(keep) if not k]
        if not auto or not self.params.stop_drafts_early:
            return [True] * len(seqs)
        goodput = self._last.goodput
        if goodput <= 0:
            return [True] * len(seqs)
        prior = self.acceptance.prior()
        pooled = self.confidence.pooled()
        gains = []
        for i in auto:
            depth = len(confidences[i])
            reach = self.confidence.reach(confidences[i], pooled)
            more, total = [], 0.0
            k = self._draft_ks.get(seqs[i].seq_id, self.k_max)
            for a in self.acceptance.estimate(seqs[i].seq_id, prior)[depth:k]:
                reach *= a
                total += reach
                more.append(total)
            gains.append(more)
        on = len(seqs) - len(auto)  # 'on' and probing ones run the next forward whatever we decide
        # The target rows as the drafts stand now (sequences no longer asked keep the drafts
        # they have); the next forward adds one per sequence that goes on. Priced on the
        # measured curve, not as a slope: on a CPU a verify of 2 rows can cost more than one of 5.
        drafted = self._draft_depth
        for seq, conf in zip(seqs, confidences, strict=True):
            drafted[seq.seq_id] = len(conf)
        extra_tokens, extra_seqs = self._decision_extra
        rows = extra_tokens + sum(1 + d for d in drafted.values())
        num_seqs = extra_seqs + len(drafted)
        cost = self.cost
        draft_on = cost.draft_time([(on, on)]) if on else 0.0
        target_now = cost.target_time(rows, num_seqs)

        forward_s: dict[int, float] = {}  # n -> one more forward for n sequences

        def added_seconds(n: int, m: int) -> float:
            draft = forward_s.get(n)
            if draft is None:
                draft = forward_s[n] = cost.draft_time([(on + n, on + n)]) - draft_on
            return m * draft + cost.target_time(rows + n * m, num_seqs) - target_now

        for i, go_on in zip(auto, continuing(gains, added_seconds, goodput), strict=True):
            keep[i] = go_on
            self.num_draft_stops += not go_on
        return keep

    # ---- measurements -----------------------------------------------------------------------
    def while_target_runs(self) -> None:
        """Refit the cost model if a refit is due, while the device runs the target forward.

        From the first call on, refits wait for this window instead of running inside
        ``observe`` (on the step's critical path): each refit then takes effect one decision
        later, a delay far below the fit's window of hundreds of steps."""
        self.cost.defer_refits = True
        self.cost.refit_if_due()

    def _probed_last_step(self, outcomes: list[SeqOutcome]) -> bool:
        """Whether a sequence drafted in this step because the last decision probed it."""
        for o in outcomes:
            if o.num_drafted > 0:
                st = self._states.get(o.seq.seq_id)
                if st is not None and st.probing:
                    return True
        return False

    def observe(self, obs: StepObservation) -> None:
        self._num_observed += 1
        for o in obs.outcomes:
            if o.num_drafted > 0:
                self.acceptance.observe(o.seq.seq_id, o.num_drafted, o.num_accepted)
                if o.draft_confidence:
                    self.confidence.observe(o.draft_confidence, o.num_drafted, o.num_accepted)
                st = self._states.get(o.seq.seq_id)
                if st is not None and st.probing:
                    st.probe_promising = o.num_accepted == o.num_drafted
        target_s = max(obs.step_time - obs.draft_time, 1e-9)
        self.cost.observe_speed(obs.num_target_tokens, obs.num_seqs, target_s)
        forwards = obs.draft_forwards or self._reconstruct_forwards(obs)
        if forwards and obs.draft_time > 0:
            self.cost.observe_draft(forwards, obs.draft_time)
        self.cost.observe_target(obs.num_target_tokens, obs.num_seqs, target_s)
        decodes, prefill_rows = self._observe_prefill(obs)
        decode_only = decodes and prefill_rows == 0 and len(decodes) == obs.num_seqs
        # Only 'auto' batches: an A/B arm's or an eval's steps say nothing of what the
        # controller's own speculation pays. Nor does a probe's step: one sequence drafting
        # once (its draft often catching up on a prompt) beside plain ones measures acceptance,
        # not what speculating the batch pays.
        # Seconds at the reference speed: plain steps of a slow spell and speculating steps of
        # a fast one compare as the same machine; probes are priced in that unit too.
        step_s = obs.step_time / self.cost.speed_index
        # Nor does a step whose draft forward only caught up (a lag over the token budget is read
        # in chunks while the sequence decodes plainly): it is neither arm's price.
        drafted = any(o.num_drafted > 0 for o in decodes)
        if (
            decode_only
            and all(o.seq.spec_mode == "auto" for o in decodes)
            and not self._probed_last_step(decodes)
            and (drafted or not obs.draft_forwards)
        ):
            self.realized.observe(
                len(decodes),
                drafted,
                sum(1 + o.num_accepted for o in decodes),
                step_s,
                self._num_observed,
            )
        if any(o.seq.spec_mode == "auto" for o in obs.outcomes):
            # The budget is a share of the time 'auto' sequences ran: steps of 'on' and 'off'
            # requests alone (an A/B arm, an eval) do not pay for probing 'auto' ones.
            self._earn_probe_budget(step_s)
        for o in obs.outcomes:
            if o.seq.is_finished:
                self._forget(o.seq.seq_id)
        self._ready_fresh = False
        every = self.params.log_every
        if every and self._num_observed % every == 0 and logger.isEnabledFor(logging.DEBUG):
            logger.debug("speculation controller: %s", self.summary())

    def _reconstruct_forwards(self, obs: StepObservation) -> list[tuple[int, int]]:
        """Draft forwards implied by the drafts verified, when the engine did not report them."""
        drafted = [o for o in obs.outcomes if o.num_drafted > 0]
        if not drafted:
            return []
        if not self.per_position_forwards:
            return [(sum(o.num_drafted for o in drafted), len(drafted))]
        rows0 = sum(self._ready.get(o.seq.seq_id, 1) for o in drafted)
        forwards = []
        for j in range(max(o.num_drafted for o in drafted)):
            seqs = sum(o.num_drafted > j for o in drafted)
            forwards.append((rows0 if j == 0 else seqs, seqs))
        return forwards

    def _observe_prefill(self, obs: StepObservation) -> tuple[list[SeqOutcome], int]:
        """Track the rows of the step that were not decodes (prefill chunks) as a moving average;
        returns the step's decodes (the sequences this step's decision covered) and those rows."""
        ready = self._ready if self._ready_fresh else {}
        decodes = [o for o in obs.outcomes if o.seq.seq_id in ready]
        rows = obs.num_target_tokens - sum(1 + o.num_drafted for o in decodes)
        seqs = obs.num_seqs - len(decodes)
        w = self.params.prefill_ema
        self.extra_tokens = (1 - w) * self.extra_tokens + w * max(0, rows)
        self.extra_seqs = (1 - w) * self.extra_seqs + w * max(0, seqs)
        return decodes, rows

    # ---- visibility -------------------------------------------------------------------------
    def stats(self) -> dict:
        ks = self._last.ks
        n = len(ks)
        prior = self.acceptance.prior()
        first = [self.acceptance.estimate(i, prior)[0] for i in self.acceptance.tracked()]
        by_request = {
            st.request_id: [round(a, 3) for a in self.acceptance.estimate(seq_id, prior)]
            for seq_id, st in list(self._states.items())[:32]
        }
        return {
            "mean_k": sum(ks) / n if n else 0.0,
            "speculating_fraction": sum(k > 0 for k in ks) / n if n else 0.0,
            "num_decode_seqs": n,
            # at the machine's current speed (the decision's prices are at the reference speed)
            "predicted_goodput_tokens_per_s": self._last.goodput / self.cost.speed_index,
            "predicted_step_time_s": self.predicted_step_time_s,
            "prefill_rows_estimate": self.extra_tokens,
            "num_probes": self.num_probes,
            "num_probes_deferred": self.num_probes_deferred,
            "probe_credit_s": self._probe_credit_s or 0.0,
            "num_cost_probes": self.num_cost_probes,
            "num_shape_probes": self.num_shape_probes,
            "num_decision_changes": self.num_changes,
            "num_measured_starts": self.num_measured_starts,
            "num_measured_stops": self.num_measured_stops,
            "acceptance_prior": [round(a, 4) for a in prior],
            "mean_acceptance": sum(first) / len(first) if first else prior[0],
            "acceptance_strength": self.acceptance.strength,
            "num_draft_stops": self.num_draft_stops,
            "acceptance_by_confidence": [round(a, 4) for a in self.confidence.table()],
            "acceptance_by_request": by_request,
            **{f"cost_{k}": v for k, v in self.cost.to_dict().items()},
        }

    def decision_inputs(self, seqs: list[Sequence]) -> dict[str, object]:
        """What the last ``choose_k`` over ``seqs`` weighed, for traces: the bar speculation had
        to clear over all-plain, the measured gain that may have moved it, and the predicted
        tokens/s of the batch with every 'auto' sequence at each uniform k (catch-up charges
        included, at the reference speed). Call it after that ``choose_k`` and before
        ``observe``: it reads the estimates the decision read."""
        terms = self._all_terms(seqs, self.acceptance.prior())
        batch = self._objective(terms, *self._decision_extra)
        uniform = [batch.assign(batch.clamp([k] * len(terms))) for k in range(self.k_max + 1)]
        return {
            "bar": self._bar(len(seqs)),
            "realized_gain": self.realized.gain(len(seqs), self._num_observed),
            "goodput_by_k": uniform,
            "catchup_s": [t.catchup_s for t in terms],
        }

    @property
    def predicted_step_time_s(self) -> float:
        """Predicted seconds of the step the last ``choose_k`` decided (probes included), at the
        machine's current speed (prices are kept at the reference speed: ``CostModel``)."""
        return self._last.step_time * self.cost.speed_index

    def summary(self) -> str:
        s = self.stats()
        return (
            f"mean_k={s['mean_k']:.2f} speculating={s['speculating_fraction']:.2f} "
            f"seqs={s['num_decode_seqs']} acc_prior={s['acceptance_prior']} "
            f"acc_mean={s['mean_acceptance']:.3f} acc_strength={s['acceptance_strength']:g} "
            f"target={s['cost_target_base_s'] * 1e3:.2f}ms"
            f"+{s['cost_target_per_token_s'] * 1e3:.3f}ms/tok(knee {s['cost_target_knee_tokens']:.0f},"
            f" then {s['cost_target_per_token_above_knee_s'] * 1e3:.3f}ms/tok)"
            f" draft={s['cost_draft_per_forward_s'] * 1e3:.2f}ms/fwd"
            f"+{s['cost_draft_per_row_s'] * 1e3:.3f}ms/row(knee {s['cost_draft_knee_rows']:.0f},"
            f" then {s['cost_draft_per_row_above_knee_s'] * 1e3:.3f}ms/row)"
            f" speed={s['cost_speed_index']:.2f} "
            f"goodput={s['predicted_goodput_tokens_per_s']:.1f}tok/s probes={s['num_probes']}"
        )
