"""Replay recorded traces through the real engine against simulated time.

The engine under replay is the real ``LLMEngine`` (scheduler, block allocator, step loop,
sampling and verification, ``DraftModelProposer`` and the speculation policy), with two
substitutions:

- the model forwards: ``TraceTargetRunner`` and ``TraceDraftRunner`` stand in for the engine's two
  ``ModelRunner``s. Token ids live in a small local vocabulary (``LOCAL_VOCAB``); the target's
  logits are one-hot at the recorded path token, and every request runs greedy, so the target
  commits exactly the recorded path (``RecordedPathParams``: the policy and the step shapes the
  engine measures still see a temperature-1 request's rows as sampled). The draft proposes the path token where the trace says its
  proposal is accepted (``ReplayRequest.accept``) and a different token otherwise, with logits
  shaped so that its probability of the proposed token is the recorded top-1 probability (what a
  draft stop rule reads as confidence);
- the clock: the engine reads ``SimClock`` for every time it measures, and each fake forward
  advances it by the cost table's price of that forward (``specdec.evals.cost_table.StepCosts``), scaled
  by the scenario's slow-downs and lengthened by its stalls.

Acceptance per output position (``replay_request``): at temperature 0 a draft is accepted where the
draft's top-1 equals the target's token, so a chain of k accepts min(k, leading matches), exactly as
the live engine would. At temperature 1 the rejection rule accepts a draft sampled from q with
probability sum_x min(p(x), q(x)); the replay draws acceptance once per position, with a fixed
seed, as Bernoulli(sum over the draft's recorded top-8 x of min(p(x), q(x))) (a lower bound of the
full sum), and the path continues along the recorded path whatever was drawn (live, a rejection
resamples a token from the residual and the text diverges).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.loader import LoadedModel
from specdec.engine.model_runner import RunEntry
from specdec.engine.models.arch import ModelArch
from specdec.engine.sampling_params import SamplingParams
from specdec.evals.cost_table import StepCosts
from specdec.evals.traces import TOP_K, RequestTrace

from specdec.controller.policy import (
    FixedPolicy,
    PrefillShape,
    SpecDecision,
    SpeculationPolicy,
    StepObservation,
)

LOCAL_VOCAB = 64  # small: the engine's sampling rows stay cheap
EOS_ID = 1  # never emitted: requests finish at their recorded length
FIRST_ID = 2  # local ids of recorded tokens start here
MAX_K = 6  # the engine's default num_speculative_tokens, the largest fixed policy
CAUGHT_UP_ROWS = 2  # a draft that kept pace reads one or two tokens at a step's first forward
REPLAY_MAX_MODEL_LEN = 4096


def local_id(token: int, offset: int = 0) -> int:
    """A recorded token id folded into the local vocabulary (``offset`` shifts whole prompts, so
    replicas of one request share no prefix-cache blocks)."""
    return FIRST_ID + (int(token) + offset) % (LOCAL_VOCAB - FIRST_ID)


def other_id(local: int) -> int:
    """A local id different from ``local``: what the draft proposes where it is rejected."""
    return FIRST_ID + (local - FIRST_ID + 1) % (LOCAL_VOCAB - FIRST_ID)


@dataclass
class ReplayRequest:
    request_id: str
    prompt: list[int]  # local ids
    path: list[int]  # local ids of the recorded output
    accept: np.ndarray  # [len(path)] bool: the draft's proposal at this position is accepted
    confidence: np.ndarray  # [len(path)] the draft's probability of its top token there
    temperature: float
    arrival: float = 0.0  # seconds after the start (open-loop arrivals only)
    # [len(path)] the rank of the path's token among the draft's choices there (0 where accepted;
    # TOP_K: not among them) and [len(path), TOP_K] the draft's probabilities of its top choices
    rank: np.ndarray | None = None
    top_probs: np.ndarray | None = None

    def token_at(self, pos: int) -> int | None:
        """Local id at absolute position ``pos`` of prompt + path (None past the end)."""
        if pos < len(self.prompt):
            return self.prompt[pos]
        j = pos - len(self.prompt)
        return self.path[j] if j < len(self.path) else None

    def cut(self, max_tokens: int) -> ReplayRequest:
        """The same request stopped after ``max_tokens`` output tokens."""
        n = max_tokens

        def head(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[:n]

        return dataclasses.replace(
            self,
            path=self.path[:n],
            accept=self.accept[:n],
            confidence=self.confidence[:n],
            rank=head(self.rank),
            top_probs=head(self.top_probs),
        )

    def leading_accepts(self, start: int, limit: int) -> int:
        """How many consecutive drafts from output position ``start`` on would be accepted."""
        n = 0
        while n < limit and start + n < len(self.path) and self.accept[start + n]:
            n += 1
        return n


def replay_request(
    trace: RequestTrace,
    request_id: str,
    seed: int,
    offset: int = 0,
    filler_tokens: int = 0,
) -> ReplayRequest:
    """The replay's view of one recorded request (module docstring: how acceptance is drawn).

    ``offset`` folds the ids differently (replicas of a request share no prefix-cache blocks);
    ``filler_tokens`` prefixes the prompt with that many random tokens drawn from a generator
    seeded by ``request_id``: context unique to this request (no prefix-cache sharing).
    """
    if trace.temperature == 0:
        accept = trace.greedy_match()
    else:
        rng = np.random.default_rng([seed, offset, int.from_bytes(trace.id.encode()[:8], "big")])
        accept = rng.random(trace.num_output) < trace.overlap()
    # Where a draft is rejected, the path's token is the draft's recorded r-th choice (r >= 1), or
    # none of its top choices (at temperature 1 also where its first choice was, but lost the draw).
    hit = trace.draft_ids == trace.tokens[:, None]
    recorded = np.where(hit.any(axis=1), hit.argmax(axis=1), TOP_K)
    rank = np.where(accept, 0, np.where(recorded > 0, recorded, TOP_K))
    filler_rng = np.random.default_rng(list(request_id.encode()))
    filler = [local_id(t) for t in filler_rng.integers(0, LOCAL_VOCAB, filler_tokens)]
    return ReplayRequest(
        request_id=request_id,
        prompt=filler + [local_id(t, offset) for t in trace.prompt_ids],
        path=[local_id(t) for t in trace.tokens],
        accept=np.asarray(accept, bool),
        confidence=trace.draft_probs[:, 0].astype(np.float64),
        temperature=trace.temperature,
        rank=rank.astype(np.int64),
        top_probs=trace.draft_probs.astype(np.float64),
    )


class SimClock:
    """Simulated seconds. ``charge`` advances it by a forward's price times the slow-down factor of
    the window it starts in, plus ``stall_seconds`` for every stall time the forward runs across."""

    def __init__(self) -> None:
        self.reset()

    def __call__(self) -> float:
        return self.now

    def reset(
        self,
        slowdowns: Sequence[tuple[float, float, float]] = (),
        stalls: Sequence[float] = (),
        stall_seconds: float = 0.0,
    ) -> None:
        """Back to zero, with these slow-downs (start, end, factor) and stalls from now on."""
        self.now = 0.0
        self.slowdowns = list(slowdowns)
        self.stalls = sorted(stalls)
        self.stall_seconds = stall_seconds
        self._next_stall = 0

    def charge(self, seconds: float) -> None:
        factor = 1.0
        for start, end, f in self.slowdowns:
            if start <= self.now < end:
                factor *= f
        dt = seconds * factor
        while self._next_stall < len(self.stalls) and self.stalls[self._next_stall] < self.now + dt:
            dt += self.stall_seconds
            self._next_stall += 1
        self.now += dt

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (stalls that fall in idle time cost nothing)."""
        self.now = max(self.now, t)
        while self._next_stall < len(self.stalls) and self.stalls[self._next_stall] < self.now:
            self._next_stall += 1


class _TraceRunner:
    """What the engine reads of a ``ModelRunner``, over the local vocabulary."""

    vocab_size = LOCAL_VOCAB
    device = torch.device("cpu")
    backend = None  # not FlashInfer: the engine uses the torch sampling reference
    graphed = None
    output_token_ids = None  # a full head over the local vocabulary

    def __init__(self, book: dict[str, ReplayRequest], costs: StepCosts, clock: SimClock) -> None:
        self.book = book  # request id -> its replay view; other sequences (calibration's) are
        # priced as bare forwards and get flat logits
        self.costs = costs
        self.clock = clock
        self.num_forwards = 0


class TraceTargetRunner(_TraceRunner):
    def run(self, entries: Sequence[RunEntry]) -> torch.Tensor:
        hot = []  # per logits row, the id whose logit is 1 (every other is 0)
        rows_by_temperature = [0, 0]  # greedy, sampled: what the live engine would sample
        for e in entries:
            req = self.book.get(e.seq.request_id)
            if req is not None:
                rows_by_temperature[req.temperature > 0] += e.num_logits
            for position in _row_positions(e):
                # the row at position i predicts the token at i + 1 (a tree node off the path
                # gets the path's token too: the verify never reads its row)
                tok = req.token_at(position + 1) if req is not None else None
                hot.append(tok if tok is not None else FIRST_ID)
        logits = torch.zeros(len(hot), LOCAL_VOCAB)
        logits[torch.arange(len(hot)), torch.tensor(hot, dtype=torch.long)] = 1.0
        self.num_forwards += 1
        shape = [(len(e.token_ids), e.start_pos) for e in entries]
        self.clock.charge(self.costs.target_seconds(shape, *rows_by_temperature))
        return logits


class TraceDraftRunner(_TraceRunner):
    def run(self, entries: Sequence[RunEntry]) -> torch.Tensor:
        rows = []
        rows_by_temperature = [0, 0]
        for e in entries:
            req = self.book.get(e.seq.request_id)
            if req is not None:
                rows_by_temperature[req.temperature > 0] += e.num_logits
            fed_tokens = list(e.token_ids)[len(e.token_ids) - e.num_logits :]
            for position, fed in zip(_row_positions(e), fed_tokens, strict=True):
                rows.append(_draft_row(req, position + 1, fed))  # the row predicts position + 1
        logits = torch.stack(rows) if rows else torch.empty(0, LOCAL_VOCAB)
        self.num_forwards += 1
        entries_shape = [(len(e.token_ids), e.start_pos) for e in entries]
        greedy, sampled = rows_by_temperature
        self.clock.charge(
            self.costs.draft_seconds(entries_shape)
            + self.costs.sampling_seconds(greedy, 0.0)
            + self.costs.sampling_seconds(sampled, 1.0)
        )
        return logits


def _row_positions(e: RunEntry) -> list[int]:
    """The positions of an entry's logits rows (explicit for a tree's nodes)."""
    positions = list(e.token_positions)
    return positions[len(positions) - e.num_logits :]


def _draft_row(req: ReplayRequest | None, pos: int, fed: int) -> torch.Tensor:
    """The draft's logits predicting ``pos`` after reading ``fed`` at ``pos - 1``.

    On the recorded path (the draft has seen the true prefix when its last input token is on it:
    a rejected proposal never is, so everything after one is off), its choices are ranked as the
    trace says: the path's token at its recorded rank (first where the proposal is accepted)
    with the recorded top probabilities, other ids at the other ranks. Off the path, one
    arbitrary proposal of probability 1/2."""
    truth = req.token_at(pos) if req is not None else None
    k = pos - len(req.prompt) if req is not None else -1
    if truth is None or k < 0 or fed != req.token_at(pos - 1):
        return _off_path_row(truth if truth is not None else FIRST_ID)
    return _path_row(truth, int(req.rank[k]), req.top_probs[k].tobytes())


@functools.cache
def _off_path_row(proposal: int) -> torch.Tensor:
    row = torch.full((LOCAL_VOCAB,), math.log(0.5 / (LOCAL_VOCAB - 1)))
    row[proposal] = math.log(0.5)
    return row


@functools.cache
def _path_row(truth: int, rank: int, top_probs: bytes) -> torch.Tensor:
    # Recorded order kept on ties (a slightly smaller probability at each later rank).
    recorded = np.frombuffer(top_probs, dtype=np.float64)
    probs = [min(max(float(p), 1e-6), 0.999) * (1 - 1e-3 * r) for r, p in enumerate(recorded)]
    # The rest of the mass spread over the other ids: the row's probabilities are the recorded
    # ones (a stop rule reads them) unless that would outrank a recorded choice.
    rest = min(probs[-1] * 0.999, max(1.0 - sum(probs), 0.0) / (LOCAL_VOCAB - TOP_K))
    row = [math.log(max(rest, 1e-9))] * LOCAL_VOCAB
    other = truth
    for r, p in enumerate(probs):
        if r == rank:
            row[truth] = math.log(p)
        else:
            other = other_id(other)
            row[other] = math.log(p)
    return torch.tensor(row, dtype=torch.float32)


def replay_arch() -> ModelArch:
    """The architecture the replay engine believes in: only the vocabulary and lengths matter."""
    return ModelArch(
        architecture="Qwen2ForCausalLM",
        vocab_size=LOCAL_VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=1 << 16,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(EOS_ID,),
    )


class _NoWeights:
    """The model slot of a replayed `LoadedModel`: plain weights, a full head."""

    quantization = "none"
    output_token_ids = None


class ReplayEngine(LLMEngine):
    cache_calibration = False  # simulated forwards: the step-cost table is measured every time

    """``LLMEngine`` whose two model runners read the traces; everything else is the engine's."""

    def __init__(
        self,
        config: EngineConfig,
        book: dict[str, ReplayRequest],
        costs: StepCosts,
        clock: SimClock,
    ) -> None:
        self.book = book
        self.costs = costs
        self._replay_runners = {
            "target": TraceTargetRunner(book, costs, clock),
            "draft": TraceDraftRunner(book, costs, clock),
        }
        arch = replay_arch()
        # No weights: the trace runners stand in for the models; the engine reads only their format.
        model = _NoWeights()
        target = LoadedModel(Path("replay-target"), arch, model, None, 0.0)  # type: ignore[arg-type]
        draft = LoadedModel(Path("replay-draft"), arch, model, None, 0.0)  # type: ignore[arg-type]
        super().__init__(config, target=target, draft=draft, progress=False, clock=clock)

    def _make_runner(self, loaded: LoadedModel, graph_q_lens: list[int]):  # type: ignore[override]
        return self._replay_runners["target" if loaded is self.target else "draft"]


# A policy builds the engine's speculation policy; None keeps the one the engine built from its
# config (``build_policy``, seeded at start-up by a step-cost table timed on the simulated clock).
PolicyFactory = Callable[[ReplayEngine], SpeculationPolicy]


@dataclass(frozen=True)
class Policy:
    name: str
    make: PolicyFactory | None = None
    tree_nodes: int = 0  # the engine's --spec-tree-max-nodes (its own policy prices such trees)


@dataclass(frozen=True)
class EngineShape:
    """The engine the replay simulates (the recorded pair's default pool and batch limits)."""

    num_kv_blocks: int
    page_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = REPLAY_MAX_MODEL_LEN

    def config(self, warmup: bool, tree_nodes: int = 0) -> EngineConfig:
        return EngineConfig(
            model="replay-target",
            draft_model="replay-draft",
            speculative_method="draft_model",
            num_speculative_tokens=MAX_K,
            device="cpu",
            dtype="float32",
            num_kv_blocks=self.num_kv_blocks,
            page_size=self.page_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            controller_warmup=warmup,
            spec_tree_max_nodes=tree_nodes,
        )


@dataclass(frozen=True)
class Round:
    """The next ``size`` requests from ``concurrency`` clients, started once every earlier
    round's requests finished (a benchmark's rounds); only ``measured`` rounds are reported."""

    size: int
    concurrency: int
    measured: bool = True


@dataclass
class Workload:
    """Requests in submission order, and how they arrive: ``concurrency`` clients each sending its
    next request when the last one finished (closed loop; ``grow_to`` (n, c): c clients once n
    requests were sent), in ``rounds`` (closed loops one after another), or open loop at each
    request's ``arrival`` when ``concurrency`` is None and there are no rounds."""

    requests: list[ReplayRequest]
    concurrency: int | None
    grow_to: tuple[int, int] | None = None
    rounds: tuple[Round, ...] = ()
    slowdowns: list[tuple[float, float, float]] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    stall_seconds: float = 0.0

    def __post_init__(self) -> None:
        held = sum(r.size for r in self.rounds)
        if self.rounds and held != len(self.requests):
            raise ValueError(f"the rounds hold {held} requests, the workload {len(self.requests)}")


@dataclass
class PolicyResult:
    tokens: int
    seconds: float
    ttft: list[float]
    steps: int
    drafted: int  # drafts verified
    accepted: int  # of those, accepted
    decode_steps: int  # (sequence, decode step) pairs

    @property
    def mean_k(self) -> float:
        return self.drafted / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ReplayError(RuntimeError):
    """The replay broke an invariant (an engine bug, or a fake runner out of step with it)."""


def run_policy(workload: Workload, policy: Policy, costs: StepCosts, shape: EngineShape):
    """Run ``workload`` under ``policy``; returns (PolicyResult, the engine)."""
    # Start-up calibration runs on the machine as it is before the workload: the scenario's
    # slow-downs and stalls are set on the clock (from zero) only once the engine is built.
    clock = SimClock()
    book = {r.request_id: r for r in workload.requests}
    config = shape.config(warmup=policy.make is None, tree_nodes=policy.tree_nodes)
    engine = ReplayEngine(config, book, costs, clock)
    if policy.make is not None:
        engine.policy = policy.make(engine)
    clock.reset(workload.slowdowns, workload.stalls, workload.stall_seconds)
    free_at_start = engine.allocator.num_free_blocks
    pending = deque(workload.requests)
    arrivals: dict[str, float] = {}
    first_token: dict[str, float] = {}

    def submit(req: ReplayRequest, now: float) -> None:
        params = RecordedPathParams(
            temperature=0.0,
            max_tokens=len(req.path),
            ignore_eos=True,
            recorded_temperature=req.temperature,
        )
        engine.add_request(req.request_id, req.prompt, params, arrival_time=now)
        arrivals[req.request_id] = now

    bounds = list(itertools.accumulate(r.size for r in workload.rounds))
    closed = workload.concurrency is not None or bool(bounds)

    def clients() -> int:
        grow = workload.grow_to
        return grow[1] if grow and len(arrivals) >= grow[0] else workload.concurrency or 0

    def fill_closed_loop(now: float) -> None:
        if bounds and pending:  # the round under way: the first whose requests have not finished
            r = bisect.bisect_right(bounds, len(finished))
            while len(arrivals) < min(bounds[r], len(finished) + workload.rounds[r].concurrency):
                submit(pending.popleft(), now)
        while not bounds and pending and len(arrivals) - len(finished) < clients():
            submit(pending.popleft(), now)

    finished: dict[str, float] = {}  # request id -> when its last token came
    if closed:
        fill_closed_loop(0.0)
    idle = 0
    while pending or engine.has_unfinished():
        if not closed:
            while pending and pending[0].arrival <= clock.now:
                req = pending.popleft()
                submit(req, req.arrival)
            if not engine.has_unfinished():
                clock.advance_to(pending[0].arrival)
                continue
        steps_before = engine.num_steps
        outputs = engine.step()
        idle = idle + 1 if engine.num_steps == steps_before else 0
        if idle > 2:
            raise ReplayError("the engine scheduled nothing with requests unfinished")
        now = clock.now
        for out in outputs:
            if out.output_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = now
            if out.finished:
                req = book[out.request_id]
                if out.output_token_ids != req.path:
                    raise ReplayError(f"{out.request_id}: the engine left the recorded path")
                finished[out.request_id] = now
        if closed:
            fill_closed_loop(now)
    if engine.allocator.num_free_blocks != free_at_start:
        raise ReplayError(
            f"KV blocks leaked: {free_at_start - engine.allocator.num_free_blocks} not returned"
        )
    # What is reported: every request over the whole run, or the measured rounds over their spans
    spans = [workload.requests]
    if bounds:
        starts = [0, *bounds[:-1]]
        spans = [
            workload.requests[a:b]
            for a, b, r in zip(starts, bounds, workload.rounds, strict=True)
            if r.measured
        ]
    ids = [r.request_id for span in spans for r in span]
    seconds = sum(
        max(finished[r.request_id] for r in span) - min(arrivals[r.request_id] for r in span)
        for span in spans
    ) if bounds else clock.now - min(arrivals.values(), default=0.0)  # fmt: skip
    stats = engine.spec_stats
    result = PolicyResult(
        tokens=sum(len(book[i].path) for i in ids),
        seconds=seconds,
        ttft=[first_token[i] - arrivals[i] for i in sorted(ids)],
        steps=engine.num_steps,
        drafted=stats.num_draft_tokens,
        accepted=stats.num_accepted_tokens,
        decode_steps=stats.num_target_steps,
    )
    return result, engine


@dataclass(frozen=True)
class RecordedPathParams(SamplingParams):
    """A replayed request's parameters: the engine picks its tokens greedily (the harness has drawn
    them, ``replay_request``), while every cost the engine measures or prices treats its rows as
    drawn at the recorded temperature, as the live engine would."""

    recorded_temperature: float = 0.0

    @property
    def warped(self) -> bool:
        return self.recorded_temperature > 0


# ---- policies -------------------------------------------------------------------------------
class OraclePolicy:
    """The best per-step choice in hindsight.

    For each decode-ready sequence it reads from the trace L_i, how many drafts from its next
    position on would be accepted (capped at ``k_max`` and at the tokens it has left). Over the
    choices k_i = min(L_i, K) for K = 0..k_max it picks the one that maximises the step's committed
    decode tokens, sum_i (k_i + 1), divided by the step's seconds priced from the cost table (the
    target forward with its verify rows and the prefill rows the engine says the step can carry,
    sampling, and the draft forwards those k's need with every draft priced as caught up), without
    the scenario's slow-downs or stalls. Drafting past L_i only adds cost, so no other k_i <= k_max
    beats these at a given K. Catch-up the draft owes (a prompt, steps it sat out) is left out of
    the choice, since every drafting policy pays it once; the clock still charges it.
    """

    def __init__(self, book: dict[str, ReplayRequest], costs: StepCosts, k_max: int) -> None:
        self.book = book
        self.costs = costs
        self.k_max = k_max
        self._prefill = (0, 0)
        self._last_ks: list[int] = []

    def _leading(self, seq) -> int:
        req = self.book.get(seq.request_id)
        if req is None or seq.spec_mode == "off":
            return 0
        left = (seq.params.max_tokens or 0) - seq.num_output_tokens - 1
        return req.leading_accepts(seq.num_output_tokens, max(0, min(self.k_max, left)))

    def step_seconds(self, seqs, ks: list[int]) -> float:
        rows, n = self._prefill
        entries = [(1 + k, s.num_tokens - 1) for s, k in zip(seqs, ks, strict=True)]
        entries += [(rows // n, 0)] * n if n else []
        greedy = [not s.params.warped for s in seqs]
        by_temperature = [0, n]  # prefills priced as sampled rows: their temperature is unknown
        for g, k in zip(greedy, ks, strict=True):
            by_temperature[not g] += 1 + k
        t = self.costs.target_seconds(entries, *by_temperature)
        for j in range(max(ks, default=0)):
            drafting = [s for s, k in zip(seqs, ks, strict=True) if k > j]
            if j == 0:
                # A draft that sat out earlier steps (or never read the prompt) catches up
                # here; every policy that drafts pays that once, so the choice is priced as if
                # it were caught up (its last committed token or two).
                d = [
                    (min(CAUGHT_UP_ROWS, s.num_tokens - s.num_draft_computed_tokens), s.num_tokens)
                    for s in drafting
                ]
            else:
                d = [(1, s.num_tokens + j - 1) for s in drafting]
            drafting_greedy = sum(
                1 for s, k, g in zip(seqs, ks, greedy, strict=True) if k > j and g
            )
            t += self.costs.draft_seconds(d)
            t += self.costs.sampling_seconds(drafting_greedy, 0.0)
            t += self.costs.sampling_seconds(len(d) - drafting_greedy, 1.0)
        return t

    def decide(self, seqs, prefill: PrefillShape) -> SpecDecision:
        self._prefill = (prefill.rows, prefill.seqs)
        leading = [self._leading(s) for s in seqs]
        best, best_rate = [0] * len(seqs), -1.0
        for cap in range(self.k_max + 1):
            ks = [min(L, cap) for L in leading]
            if cap and ks == best:
                continue
            rate = sum(k + 1 for k in ks) / self.step_seconds(seqs, ks)
            if rate > best_rate:
                best, best_rate = ks, rate
        self._last_ks = best
        return SpecDecision(best)

    def observe(self, obs: StepObservation) -> None:
        pass

    def stats(self) -> dict:
        n = len(self._last_ks)
        return {"mean_k": sum(self._last_ks) / n if n else 0.0}


# Token-tree policies: every step drafts a tree of this many nodes, this many levels deep.
TREE_POLICIES = {"tree_n8": (8, 4), "tree_n16": (16, 5)}


def default_policies() -> list[Policy]:
    """plain, fixed_k1..fixed_k6, tree_n8 and tree_n16, adaptive (the engine's own policy),
    adaptive_trees (the same with trees of 16 nodes to price), oracle."""
    policies = [Policy("plain", lambda e: FixedPolicy(0))]
    policies += [Policy(f"fixed_k{k}", lambda e, k=k: FixedPolicy(k)) for k in range(1, MAX_K + 1)]
    policies += [
        Policy(name, lambda e, n=n, k=k: FixedPolicy(k, n))
        for name, (n, k) in TREE_POLICIES.items()
    ]
    policies.append(Policy("adaptive"))
    policies.append(Policy("adaptive_trees", tree_nodes=16))
    policies.append(Policy("oracle", lambda e: OraclePolicy(e.book, e.costs, MAX_K)))
    return policies
