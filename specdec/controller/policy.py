"""Speculation policies: how many drafts each decode-ready sequence verifies this step.

The adaptive policy picks, among plain decode and "the n sequences of highest E_i(k) draft k"
(as chains, or as trees of ``tree_nodes`` nodes) for every k and n on a grid, the step of highest
predicted goodput ``G = (sum_i E_i(k_i) + FIRST_TOKEN_WEIGHT * P) / (T_target + T_draft)``, with
``E_i`` from ``estimates``, ``P`` the prompt chunks riding in the step, and the times from
``step_cost`` for the step's exact shape (draft catch-up included). One hysteresis band
(``MARGIN``), one exploration rule (``EXPLORE_INTERVAL``, ``EXPLORE_BAND``), and a draft stop
rule (``drafts_to_continue``) that never drafts past the chosen k. Decisions depend only on what
``observe`` was given and the sequences' own counts, so a recorded run replays to the same
decisions. docs/controller.md states the model and the reason for each default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from specdec.controller.estimates import (
    AcceptanceModel,
    expected_tokens_table,
    tree_rates,
)
from specdec.controller.step_cost import ForwardShape, StepCostModel
from specdec.engine.sequence import Sequence

# Acceptance per position before any verify, per proposer: a guess too high costs a few verifies,
# one too low holds plain decode, which measures nothing (a same-family draft: 0.55-0.95).
INITIAL_ACCEPTANCE = {"draft_model": 0.85, "ngram": 0.5}
MARGIN = 0.03  # a new decision must be predicted 3% better: above the fit's step-to-step noise
EXPLORE_INTERVAL = 64  # decode steps between re-measurements of the runner-up: <2% of the steps
EXPLORE_BAND = 0.15  # only runners-up a plausible mispricing (<15%) could make the best are tried
# A first token is worth this many later ones: TTFT targets are commonly a few TPOT targets.
FIRST_TOKEN_WEIGHT = 4.0
# How many of n sequences may draft: every count up to 4, then a geometric grid, and n.
_COUNT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_KEPT_PACE = 2  # draft rows after a verify: the bonus token, and the last accepted draft's


@dataclass(frozen=True)
class PrefillShape:
    """The prompt chunks the step carries beside the decodes."""

    rows: int = 0
    seqs: int = 0
    attended: int = 0


@dataclass(frozen=True)
class DraftStop:
    """Plain data for ``drafts_to_continue``: per-position acceptance, the step's goodput, and
    the seconds one more draft position by m sequences adds (at m - 1)."""

    rates: tuple[float, ...]
    goodput: float
    marginal_seconds: tuple[float, ...]


@dataclass(frozen=True)
class SpecDecision:
    ks: list[int]  # per sequence: drafts to verify (an upper bound when ``stop`` is set)
    stop: DraftStop | None = None
    predicted_seconds: float = 0.0
    predicted_goodput: float = 0.0
    tree_nodes: list[int] | None = None  # per sequence: a tree of this many nodes, k deep


@dataclass
class SeqOutcome:
    """What one sequence's verify showed."""

    num_drafted: int  # a tree's depth
    num_accepted: int
    tree_ranks: list[int] | None = None  # a tree's: the sibling rank of each accepted node


@dataclass
class StepObservation:
    """One measured engine step."""

    target: ForwardShape
    target_seconds: float  # the target forward, sampling and the step's host work
    draft_forwards: list[ForwardShape]
    draft_seconds: float
    outcomes: list[SeqOutcome]


class SpeculationPolicy(Protocol):
    """What the engine asks each step, and what it tells afterwards."""

    # ks per decode-ready sequence (0: plain decode), given the step's prompt chunks
    def decide(self, seqs: Seq[Sequence], prefill: PrefillShape) -> SpecDecision: ...
    def observe(self, obs: StepObservation) -> None: ...  # one measured step
    def stats(self) -> dict: ...  # current decision inputs and outputs, for metrics and logs


def draft_value(confidences: Seq[float], position: int, stop: DraftStop) -> float:
    """Expected tokens a draft at ``position`` (0-based) adds to a sequence whose drafts so far
    were drawn with ``confidences`` (the draft's probability of each, taken as its chance to
    hold): the chance they all hold, times the position's acceptance."""
    return math.prod(confidences) * stop.rates[min(position, len(stop.rates) - 1)]


def drafts_to_continue(values: Seq[float], num_pinned: int, stop: DraftStop) -> int:
    """How many of the sequences offering ``values`` (highest first) draft one more position
    beside ``num_pinned`` that draft it anyway: the count whose added tokens, less the seconds
    they add at the step's goodput, are most (a draft forward costs about the same for any rows,
    so the sequences in it pay for it together). Reads only drafts already drawn, so the output
    distribution is unchanged."""

    def seconds(m: int) -> float:
        return stop.marginal_seconds[min(m, len(stop.marginal_seconds)) - 1] if m else 0.0

    best_m, best, total = 0, 0.0, 0.0
    for m, value in enumerate(values, start=1):
        total += value
        net = total - stop.goodput * (seconds(num_pinned + m) - seconds(num_pinned))
        if net > best:
            best_m, best = m, net
    return best_m


class FixedPolicy:
    """k drafts for every 'on' and 'auto' sequence (as trees of ``tree_nodes`` nodes, k deep)."""

    def __init__(self, k: int, tree_nodes: int = 0) -> None:
        self.k, self.tree_nodes = k, tree_nodes
        self._last: list[int] = []

    def decide(self, seqs: Seq[Sequence], prefill: PrefillShape) -> SpecDecision:
        self._last = [0 if s.spec_mode == "off" else self.k for s in seqs]
        nodes = [self.tree_nodes if k else 0 for k in self._last] if self.tree_nodes else None
        return SpecDecision(list(self._last), tree_nodes=nodes)

    def observe(self, obs: StepObservation) -> None: ...  # a fixed k learns nothing

    def stats(self) -> dict:
        return _k_stats(self._last)


@dataclass
class _Candidate:
    k: int  # draft length (a tree's depth) of the auto sequences that draft (0: plain)
    share: float  # the share of the auto sequences that draft (those of highest E_i(k))
    goodput: float
    seconds: float
    pinned: list[int]  # the k of every sequence before the auto ones that draft are set
    drafting: Seq[int] = ()  # indices of the auto sequences that draft k
    tree_nodes: int = 0  # the drafting ones grow trees of this many nodes (0: chains)

    @property
    def ks(self) -> list[int]:
        drafting = set(self.drafting)
        return [self.k if i in drafting else k for i, k in enumerate(self.pinned)]

    @property
    def nodes(self) -> list[int]:
        drafting = set(self.drafting) if self.tree_nodes else set()
        return [self.tree_nodes if i in drafting else 0 for i in range(len(self.pinned))]


class AdaptivePolicy:
    """Goodput-maximising draft lengths and shapes (see the module docstring). With
    ``tree_nodes``, a tree of that many nodes whose levels ``tree_widths(k)`` gives is a
    candidate beside each chain of k >= 2."""

    def __init__(
        self,
        k_max: int,
        initial_acceptance: float,
        cost: StepCostModel | None = None,
        stop_drafts_early: bool = True,
        has_draft_model: bool = True,
        max_model_len: int = 4096,
        tree_nodes: int = 0,
        tree_widths: Callable[[int], Seq[int]] | None = None,
    ) -> None:
        self.k_max, self.max_model_len = k_max, max_model_len
        self.acceptance = AcceptanceModel(k_max, initial_acceptance)
        # the same counts over tree verifies: what trees measured beyond the chain's rates
        self.tree_acceptance = AcceptanceModel(k_max, initial_acceptance) if tree_nodes else None
        self.tree_nodes = tree_nodes
        self._levels = {k: tuple(tree_widths(k)) for k in range(2, k_max + 1) if tree_widths}
        self.cost = cost or StepCostModel()
        self.stop_drafts_early = stop_drafts_early and has_draft_model
        self.has_draft_model = has_draft_model  # a lookup proposer's drafts cost no forwards
        self._held: tuple[int, float, int] = (0, 0.0, 0)  # (k, share drafting, tree nodes)
        self._since_explore, self._decided = 0, False
        self._last: list[int] = []
        self._last_goodput = self._last_seconds = 0.0
        self._table_cache: dict[int, tuple] = {}  # seq_id -> (key, chain E, tree E)
        self._trees: dict[int, list[float]] = {}
        self._lags: dict[int, tuple[int, float]] = {}  # seq_id -> (tokens left, catch-up seconds)

    def decide(self, seqs: Seq[Sequence], prefill: PrefillShape) -> SpecDecision:
        auto = [i for i, s in enumerate(seqs) if s.spec_mode == "auto"]
        # A step with prompt chunks, its seconds mostly the prompts', makes any addition look
        # cheap: it starts no lagging draft (a catch-up is priced spread over decode steps) and
        # may draft less than the held decision, never more. Only decode-only steps move it.
        if prefill.seqs and self.has_draft_model:
            auto = [i for i in auto if seqs[i].draft_lag <= _KEPT_PACE]
        pinned = [self.k_max if s.spec_mode == "on" else 0 for s in seqs]
        if not auto:
            self._last = pinned
            return SpecDecision(pinned)
        tables, self._lags = self._tables(seqs), {}
        held = self._evaluate_held(seqs, auto, tables, pinned, prefill)
        decode_only = prefill.seqs == 0
        self._since_explore += decode_only  # decode-only steps since a runner-up last ran
        explore = decode_only and self._since_explore >= EXPLORE_INTERVAL
        if held.k == 0 and not decode_only:
            self._last, self._last_goodput, self._last_seconds = held.ks, held.goodput, held.seconds
            return SpecDecision(held.ks, None, held.seconds, held.goodput)
        candidates = self._candidates(seqs, auto, tables, pinned, prefill)
        if not decode_only:  # no more than the held decision (the top of decide says why)
            fits = [c for c in candidates if c.k <= held.k and c.share <= held.share]
            candidates = [c for c in fits if c.tree_nodes <= held.tree_nodes]
        best = max(candidates, key=lambda c: c.goodput)
        choice = held
        # The band guards a decision made on evidence. Plain decode held before the first
        # decode-only step was never chosen, so that step takes the best candidate outright.
        if best.goodput > held.goodput * (1.0 + MARGIN * self._decided):
            choice = best
            if decode_only:
                self._held = (best.k, best.share, best.tree_nodes)
        self._decided |= decode_only
        if explore:
            choice = self._runner_up(seqs, choice, candidates, prefill)
        ks = choice.ks
        self._last, self._last_goodput, self._last_seconds = ks, choice.goodput, choice.seconds
        stops = self.stop_drafts_early and any(ks[i] for i in auto) and not choice.tree_nodes
        stop = self._draft_stop(seqs, ks, choice, prefill) if stops else None
        nodes = choice.nodes if choice.tree_nodes else None
        return SpecDecision(ks, stop, choice.seconds, choice.goodput, nodes)

    def _tables(self, seqs: Seq[Sequence]) -> dict[int, list[float]]:
        """E_i(0..k_max) of every sequence that may draft as chains (returned) and as trees
        (``_trees``), kept while neither its counts nor the engine-wide estimates moved."""
        cache, self._table_cache, out, self._trees = self._table_cache, {}, {}, {}
        trees_seen = self.tree_acceptance
        version = (self.acceptance.version, trees_seen.version if trees_seen else 0)
        engine = self.acceptance.rates()
        for i, s in enumerate(seqs):
            if s.spec_mode == "off":
                continue
            st, key = s.spec_stats, (version, s.spec_stats.num_spec_steps)
            hit = cache.get(s.seq_id)
            if hit is None or hit[0] != key:
                rates = self.acceptance.seq_rates(st.first_choices_per_pos(), st.judged_per_pos)
                trees = [expected_tokens_table(tree_rates(rates, engine, trees_seen, w))[-1]
                         for w in self._levels.values()] if trees_seen else []  # fmt: skip
                hit = (key, expected_tokens_table(rates), [0.0, 0.0, *trees])
            self._table_cache[s.seq_id] = hit
            out[i], self._trees[i] = hit[1], hit[2]
        return out

    def _widths(self, k: int, tree: bool) -> tuple[int, ...]:
        """Rows each draft forward after the first feeds per sequence (a chain: one token)."""
        return self._levels[k][:-1] if tree else (1,) * (k - 1)

    def _step(
        self, seqs: Seq[Sequence], c: _Candidate, prefill: PrefillShape, amortize: bool = True
    ) -> tuple[float, float]:
        """(predicted seconds, first-token value) of the step candidate ``c`` runs."""
        ks, nodes = c.ks, c.nodes
        rows = [sum(self._levels[k]) if n else k for k, n in zip(ks, nodes, strict=True)]
        seconds = self.cost.target_time(_target_shape_of(seqs, ks, prefill, rows))
        drafting = []
        for s, k, n in ((s, k, n) for s, k, n in zip(seqs, ks, nodes, strict=True) if k):
            table = self._table_cache[s.seq_id][2 if n else 1]
            catch_up, lag_seconds = self._catch_up(s, table[min(k, self.k_max)], amortize)
            drafting.append((k, self._widths(k, n > 0), *_member(s, catch_up)))
            seconds += lag_seconds
        if drafting and self.has_draft_model:
            seconds += self.cost.draft_time(_draft_forwards(drafting))
        return seconds, FIRST_TOKEN_WEIGHT * prefill.seqs

    def _candidates(self, seqs, auto, tables, pinned, prefill) -> list[_Candidate]:
        """Plain, and for every k (and shape) the n sequences of highest E_i(k) drafting k, for n
        on a grid, each priced from running sums of its drafting sequences' rows, attention and
        value: two cost-model calls a candidate, not a pass over the batch."""
        base = _target_shape_of(seqs, pinned, prefill)
        base_value = FIRST_TOKEN_WEIGHT * prefill.seqs
        on_sums, on_lag_seconds = (0,) * 5, 0.0
        for i, (s, k) in enumerate(zip(seqs, pinned, strict=True)):
            base_value += tables[i][k] if i in tables else 1.0
            if k:
                more_rows, more_seconds = self._catch_up(s, tables[i][k])
                on_sums = tuple(map(sum, zip(on_sums, _member(s, more_rows), strict=True)))
                on_lag_seconds += more_seconds
        on, num_on = (self.k_max, self._widths(self.k_max, False), *on_sums), on_sums[0]

        def price(group, rows, att, samp, value, lag_seconds):
            more = ForwardShape(rows, 0, att, samp)
            seconds = self.cost.target_time(base + more) + on_lag_seconds + lag_seconds
            if (group[2] or num_on) and self.has_draft_model:
                seconds += self.cost.draft_time(_draft_forwards([group, on]))
            return seconds, base_value + value

        seconds, value = price((0, (), 0, 0, 0, 0, 0), 0, 0, 0, 0.0, 0.0)
        out = [_Candidate(0, 0.0, value / seconds, seconds, pinned)]
        shapes = [(k, 0) for k in range(1, self.k_max + 1)]
        shapes += [(k, self.tree_nodes) for k in self._levels if self.tree_acceptance]
        for k, tree_nodes in shapes:
            table = self._trees if tree_nodes else tables
            per_seq = sum(self._levels[k]) if tree_nodes else k
            order = sorted(auto, key=lambda i: -table[i][k])
            counts = {c for c in _COUNT_GRID if c < len(order)} | {len(order)}
            rows, att, samp, value, lag_seconds = 0, 0, 0, 0.0, 0.0
            sums, widths = (0,) * 5, self._widths(k, tree_nodes > 0)
            for n, i in enumerate(order, start=1):
                ctx = seqs[i].num_tokens
                rows += per_seq
                att += (1 + per_seq) * (ctx + k) - ctx
                samp += per_seq * _sampled(seqs[i])
                value += table[i][k] - 1.0
                more_rows, more_seconds = self._catch_up(seqs[i], table[i][k])
                sums = tuple(map(sum, zip(sums, _member(seqs[i], more_rows), strict=True)))
                lag_seconds += more_seconds
                if n in counts:
                    seconds, total = price((k, widths, *sums), rows, att, samp, value, lag_seconds)
                    goodput, share = total / seconds, n / len(order)
                    drafting = order[:n]
                    out.append(_Candidate(k, share, goodput, seconds, pinned, drafting, tree_nodes))
        return out

    def _catch_up(self, seq: Sequence, expected: float, amortize: bool = True):
        """(rows in the step's first draft forward, seconds beside it) of drafting for ``seq``.
        A draft that lags (a prompt it never read, steps it sat out) reads its lag in one forward,
        whose seconds beyond a kept-pace read are spread over the sequence's remaining steps at
        ``expected`` tokens a step (seconds, not rows: a lag-sized forward costs far more than
        its rows add to a small one). A one-step trial (``amortize`` False) pays all of it."""
        lag = max(1, seq.draft_lag)
        if lag <= _KEPT_PACE or not amortize:
            return lag, 0.0
        if not self.has_draft_model:
            return _KEPT_PACE, 0.0
        if seq.seq_id not in self._lags:  # what every k shares, priced once a step
            left = seq.tokens_left(self.max_model_len)
            ctx = seq.num_tokens
            extra = self.cost.draft_time([ForwardShape(lag, 1, lag * ctx)])
            extra -= self.cost.draft_time([ForwardShape(_KEPT_PACE, 1, _KEPT_PACE * ctx)])
            self._lags[seq.seq_id] = (left, max(0.0, extra))
        left, extra = self._lags[seq.seq_id]
        return _KEPT_PACE, extra / max(1.0, left / expected)

    def _evaluate_held(self, seqs, auto, tables, pinned, prefill) -> _Candidate:
        k, share, tree_nodes = self._held
        n = round(share * len(auto)) if k else 0
        table = self._trees if tree_nodes else tables
        drafting = sorted(auto, key=lambda i: -table[i][k])[:n]
        c = _Candidate(k, share, 0.0, 0.0, pinned, drafting, tree_nodes) if n else None
        c = c or _Candidate(0, 0.0, 0.0, 0.0, pinned)
        c.seconds, value = self._step(seqs, c, prefill)
        value += sum(tables[i][k] if i in tables else 1.0 for i, k in enumerate(pinned))
        value += sum(table[i][k] - tables[i][0] for i in drafting) if n else 0.0
        c.goodput = value / c.seconds
        return c

    def _runner_up(
        self, seqs, choice: _Candidate, candidates: list[_Candidate], prefill: PrefillShape
    ) -> _Candidate:
        """Exploration. The best candidate of another draft length becomes the held decision when
        it is within ``MARGIN`` of the choice: a tie under what is known is broken towards the
        length not being measured (the band takes the decision back if the measurements
        disappoint). Else the best as a one-step trial (its drafts' whole catch-up charged to it)
        runs once when within ``EXPLORE_BAND`` of the choice. Either way the clock restarts."""
        self._since_explore = 0
        others = [c for c in candidates if (c.k, c.tree_nodes) != (choice.k, choice.tree_nodes)]
        tie = max(others, key=lambda c: c.goodput, default=choice)
        if tie is not choice and tie.goodput >= choice.goodput * (1.0 - MARGIN):
            self._held = (tie.k, tie.share, tie.tree_nodes)
            return tie
        goodput, runner_up = max(  # each as a one-step trial: its whole catch-up charged
            ((c.goodput * c.seconds / self._step(seqs, c, prefill, False)[0], c) for c in others),
            key=lambda t: t[0], default=(0.0, choice),
        )  # fmt: skip
        return runner_up if goodput >= choice.goodput * (1.0 - EXPLORE_BAND) else choice

    def _draft_stop(
        self, seqs, ks: list[int], choice: _Candidate, prefill: PrefillShape
    ) -> DraftStop:
        """The stop rule's prices: the seconds m more verify rows (at the drafting sequences' mean
        context) and one more m-row draft forward add, for every m."""
        drafting = [s for s, k in zip(seqs, ks, strict=True) if k]
        base = _target_shape_of(seqs, ks, prefill)
        context = sum(s.num_tokens for s in drafting) // len(drafting)
        sampled = sum(map(_sampled, drafting)) / len(drafting)
        marginal = []
        for m in range(1, len(drafting) + 1):
            more = ForwardShape(m, 0, m * context, round(m * sampled))
            seconds = self.cost.target_time(base + more) - self.cost.target_time(base)
            if self.has_draft_model:
                seconds += self.cost.draft_time([ForwardShape(m, m, more.attended, more.sampled)])
            marginal.append(seconds)
        rates = tuple(self.acceptance.rates())
        return DraftStop(rates, choice.goodput, tuple(marginal))

    def observe(self, obs: StepObservation) -> None:
        if obs.outcomes and not any(o.num_drafted for o in obs.outcomes):
            for model in filter(None, (self.acceptance, self.tree_acceptance)):
                model.age()
        for o in obs.outcomes:
            if o.tree_ranks is not None and o.num_drafted:
                # The chain's estimate reads the tree's leading run of first choices.
                first = next((j for j, r in enumerate(o.tree_ranks) if r), len(o.tree_ranks))
                self.acceptance.observe(o.num_drafted, first)
                if self.tree_acceptance is not None:
                    self.tree_acceptance.observe(o.num_drafted, o.num_accepted)
            elif o.num_drafted:
                self.acceptance.observe(o.num_drafted, o.num_accepted)
        self.cost.observe(obs.target, obs.target_seconds, obs.draft_forwards, obs.draft_seconds)

    def stats(self) -> dict:
        return {
            **_k_stats(self._last),
            "acceptance_prior": list(self.acceptance.rates()),
            "cost_machine_pace": self.cost.speed,
            "cost_num_observations": float(self.cost.target.num_live),
            "cost_predicted_step_seconds": self._last_seconds,
            "cost_predicted_goodput": self._last_goodput,
        }


def _target_shape_of(
    seqs: Seq[Sequence], ks: Seq[int], prefill: PrefillShape, rows: Seq[int] | None = None
) -> ForwardShape:
    """The target forward of a step: sequence i verifies ks[i] drafts (``rows[i]`` rows when a
    tree ks[i] deep), beside ``prefill``."""
    total, attended, sampled = prefill.rows, prefill.attended, 0
    for s, k, r in zip(seqs, ks, rows or ks, strict=True):
        total += 1 + r
        attended += (1 + r) * (s.num_tokens + k)
        sampled += (1 + r) * _sampled(s)
    return ForwardShape(total, len(seqs) + prefill.seqs, attended, sampled)


def _sampled(seq: Sequence) -> int:
    """1 when the sequence's tokens are drawn from a warped distribution, 0 for greedy."""
    return 1 if seq.params.warped else 0


def _member(seq: Sequence, catch_up: int) -> tuple[int, int, int, int, int]:
    """One drafting sequence's share of its group's sums (see ``_draft_forwards``)."""
    return 1, catch_up, _sampled(seq), seq.num_tokens, catch_up * seq.num_tokens


def _draft_forwards(groups: Seq[Seq]) -> list[ForwardShape]:
    """The draft forwards of groups of drafting sequences (k, rows each sequence feeds forwards
    1.. (a chain one token, a tree a level), then the sums of ``_member``: sequences, catch-up
    rows, sampled sequences, contexts, catch-up rows times context): forward 0 feeds every group
    its catch-up, forward f > 0 each sequence's f-th rows, every row attending to its context."""
    groups = [g for g in groups if g[0] and g[2]]
    forwards = [ForwardShape(*(sum(g[i] for g in groups) for i in (3, 2, 6, 4)))]
    for f in range(1, max((len(g[1]) for g in groups), default=0) + 1):
        live = [(g[2], g[4], g[5], g[1][f - 1]) for g in groups if len(g[1]) >= f]
        parts = [(n * w, n, w * (c + n * f), m * w) for n, m, c, w in live]  # rows .. sampled
        forwards.append(ForwardShape(*map(sum, zip(*parts, strict=True))))
    return forwards


def _k_stats(ks: Seq[int]) -> dict:
    n = max(1, len(ks))
    return {"mean_k": sum(ks) / n, "speculating_fraction": sum(k > 0 for k in ks) / n}
