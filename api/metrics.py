"""Prometheus metrics of one server instance, named like vLLM's with a ``specdec:`` prefix.

Each app owns its own ``CollectorRegistry`` (not the process-global default), so several apps can
live in one process (tests). Request metrics carry the labels ``model_name`` and ``arm`` (the A/B
arm, ``spec`` or ``plain``); engine gauges are set from the loop's latest snapshot at scrape time.

Latency definitions (seconds, measured on the server when outputs reach the request handler):
- time to first token: arrival (before tokenization) to the first generated token;
- inter-token latency: gap between consecutive outputs of a request, one observation per output
  (a speculative step that commits several tokens is one output);
- time per output token: (finish - first token) / (generated tokens - 1), once per request;
- end-to-end latency: arrival to finish.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from specdec.api.rolling_window import RollingWindow
from specdec.engine.async_engine import EngineSnapshot
from specdec.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip

REQUEST_LABELS = ("model_name", "arm")

# The *_created series double the exposition size and no dashboard reads them (vLLM drops them too).
disable_created_metrics()


class ServerMetrics:
    def __init__(self, model_name: str, window: RollingWindow | None = None) -> None:
        self.model_name = model_name
        # The same measurements, binned over the last minutes, for the live A/B page.
        self.window = window or RollingWindow()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = REQUEST_LABELS
        self.ttft = Histogram(
            "specdec:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specdec:time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specdec:inter_token_latency_seconds",
            "Time between consecutive outputs of a request",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specdec:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specdec:prompt_tokens", "Prompt tokens processed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "specdec:generation_tokens", "Generated tokens", labels, registry=r
        )
        self.request_success = Counter(
            "specdec:request_success",
            "Finished requests by finish reason",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.request_rejected = Counter(
            "specdec:request_rejected",
            "Requests refused with an error status",
            ("model_name", "status"),
            registry=r,
        )
        self.num_drafts = Counter(
            "specdec:spec_decode_num_drafts",
            "Verify steps that checked at least one draft token",
            labels,
            registry=r,
        )
        self.num_draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens", "Draft tokens verified", labels, registry=r
        )
        self.num_accepted_tokens = Counter(
            "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        )
        self.accepted_per_pos = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based)",
            (*labels, "position"),
            registry=r,
        )
        self.num_tree_steps = Counter(
            "specdec:spec_decode_num_tree_steps",
            "Verify steps that checked a token tree",
            labels,
            registry=r,
        )
        self.num_tree_nodes = Counter(
            "specdec:spec_decode_num_tree_nodes",
            "Token-tree nodes verified (nodes per tree step = this / num_tree_steps)",
            labels,
            registry=r,
        )
        self.accepted_per_rank = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_rank",
            "Token-tree nodes accepted by their rank among siblings (0: the draft's first choice)",
            (*labels, "rank"),
            registry=r,
        )
        gauge_labels = ("model_name",)
        self.running = Gauge(
            "specdec:num_requests_running", "Sequences in the batch", gauge_labels, registry=r
        )
        self.waiting = Gauge(
            "specdec:num_requests_waiting", "Sequences waiting", gauge_labels, registry=r
        )
        self.kv_usage = Gauge(
            "specdec:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full)",
            gauge_labels,
            registry=r,
        )
        self.mean_k = Gauge(
            "specdec:spec_decode_mean_k",
            "Mean draft length chosen by the controller in the latest step",
            gauge_labels,
            registry=r,
        )
        self.speculating_fraction = Gauge(
            "specdec:spec_decode_speculating_fraction",
            "Fraction of decode-ready sequences that speculated in the latest step",
            gauge_labels,
            registry=r,
        )
        self.cost_model = Gauge(
            "specdec:spec_decode_cost_model",
            "The adaptive controller's fitted step-cost coefficients (a name's suffix is its "
            "unit: _s seconds, _tokens and _rows rows of a forward)",
            (*gauge_labels, "coefficient"),
            registry=r,
        )
        self.acceptance_estimate = Gauge(
            "specdec:spec_decode_acceptance_estimate",
            "The adaptive controller's engine-wide chance that a draft at each position (0-based) "
            "is accepted, given the ones before it were",
            (*gauge_labels, "position"),
            registry=r,
        )
        self.engine_alive = Gauge(
            "specdec:engine_loop_alive", "1 while the engine loop runs", gauge_labels, registry=r
        )

    def render(self, snapshot: EngineSnapshot, alive: bool) -> bytes:
        """Set the engine gauges from ``snapshot`` and return the exposition text."""
        m = self.model_name
        self.running.labels(m).set(snapshot.num_running)
        self.waiting.labels(m).set(snapshot.num_waiting)
        self.kv_usage.labels(m).set(snapshot.kv_usage)
        self.mean_k.labels(m).set(snapshot.mean_k)
        self.speculating_fraction.labels(m).set(snapshot.speculating_fraction)
        for name, value in snapshot.controller_costs:
            self.cost_model.labels(m, name).set(value)
        for position, acceptance in enumerate(snapshot.acceptance_estimate):
            self.acceptance_estimate.labels(m, str(position)).set(acceptance)
        self.engine_alive.labels(m).set(1.0 if alive else 0.0)
        return generate_latest(self.registry)

    def rejected(self, status: int) -> None:
        self.request_rejected.labels(self.model_name, str(status)).inc()

    def tracker(
        self, arm: str, arrival_time: float, num_prompt_tokens: int, model_name: str | None = None
    ) -> RequestTracker:
        """``model_name``: the served model answering (default: the server's model name)."""
        return RequestTracker(self, arm, arrival_time, num_prompt_tokens, model_name)


class RequestTracker:
    """Feeds one request's outputs into the metrics as they arrive."""

    def __init__(
        self,
        metrics: ServerMetrics,
        arm: str,
        arrival_time: float,
        num_prompt_tokens: int,
        model_name: str | None = None,
    ) -> None:
        self.metrics = metrics
        self.labels = (model_name or metrics.model_name, arm)
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_output_time: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        # Speculation counters already counted (the engine reports cumulative ones).
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._per_pos: list[int] = []
        self._per_rank: list[int] = []
        self._tree_steps = self._tree_nodes = 0
        self._target_steps = 0
        self._emitted = 0
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m, labels = self.metrics, self.labels
        if out.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                m.ttft.labels(*labels).observe(now - self.arrival_time)
                m.window.first_token(*labels, now - self.arrival_time)
            elif self.last_output_time is not None:
                m.itl.labels(*labels).observe(now - self.last_output_time)
            self.last_output_time = now
        self.num_output_tokens = len(out.output_token_ids)
        s = out.spec_stats
        m.num_drafts.labels(*labels).inc(s.num_spec_steps - self._drafts)
        m.num_draft_tokens.labels(*labels).inc(s.num_draft_tokens - self._draft_tokens)
        m.num_accepted_tokens.labels(*labels).inc(s.num_accepted_tokens - self._accepted)
        _inc_each(m.accepted_per_pos, labels, s.accepted_per_pos, self._per_pos)
        _inc_each(m.accepted_per_rank, labels, s.accepted_per_rank, self._per_rank)
        m.num_tree_steps.labels(*labels).inc(s.num_tree_steps - self._tree_steps)
        m.num_tree_nodes.labels(*labels).inc(s.num_tree_nodes - self._tree_nodes)
        m.window.progress(
            *labels,
            new_tokens=len(out.new_token_ids),
            draft_tokens=s.num_draft_tokens - self._draft_tokens,
            accepted_tokens=s.num_accepted_tokens - self._accepted,
            target_steps=s.num_target_steps - self._target_steps,
            emitted_tokens=s.num_emitted_tokens - self._emitted,
        )
        self._drafts, self._draft_tokens = s.num_spec_steps, s.num_draft_tokens
        self._accepted, self._per_pos = s.num_accepted_tokens, list(s.accepted_per_pos)
        self._per_rank = list(s.accepted_per_rank)
        self._tree_steps, self._tree_nodes = s.num_tree_steps, s.num_tree_nodes
        self._target_steps, self._emitted = s.num_target_steps, s.num_emitted_tokens
        if out.finished:
            self.finish(out.finish_reason or "stop")

    def finish(self, reason: str) -> None:
        """Request over (finished, aborted or failed): count its tokens and latencies once."""
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        m, labels = self.metrics, self.labels
        m.prompt_tokens.labels(*labels).inc(self.num_prompt_tokens)
        m.generation_tokens.labels(*labels).inc(self.num_output_tokens)
        m.request_success.labels(*labels, reason).inc()
        m.e2e.labels(*labels).observe(now - self.arrival_time)
        tpot = None
        if self.first_token_time is not None and self.num_output_tokens > 1:
            tpot = (now - self.first_token_time) / (self.num_output_tokens - 1)
            m.tpot.labels(*labels).observe(tpot)
        m.window.finished(*labels, tpot)


def _inc_each(counter: Counter, labels: tuple, counts: list[int], before: list[int]) -> None:
    """Add what each index of ``counts`` gained over ``before`` to its labelled child."""
    for i, count in enumerate(counts):
        seen = before[i] if i < len(before) else 0
        if count > seen:
            counter.labels(*labels, str(i)).inc(count - seen)
