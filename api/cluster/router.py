"""Prefix-affine request router for the engine deployment (Ray Serve's ``RequestRouter`` API).

Runs inside every deployment handle (here: the ingress process). For each request it computes
the prompt's prefix-cache keys (api.cluster.prefix), asks the index which replica holds the
longest run of them, and ranks replicas with ``prefix.choose``: the holder when its load is
within ``imbalance_threshold`` of the least-loaded replica, the least-loaded replica otherwise.
Serve then sends the request to the first ranked replica below ``max_ongoing_requests``.

Loads are Serve's own per-replica counts of requests in flight from this handle (its queue-length
cache, updated on every send and completion), or the replica's last report where the cache has
no entry. The index learns from two
sources: every routed prompt (at once) and each replica's report of the keys actually in its
cache, which Serve's controller fetches every ``request_routing_stats_period_s`` through
``EngineReplica.record_routing_stats`` (evictions show up there).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from specdec.api.cluster import registry
from specdec.api.cluster.prefix import PrefixIndex, choose, prompt_keys

logger = logging.getLogger(__name__)


class ReplicaStatsSource(RequestRouter):
    """A router that publishes itself in ``ROUTERS`` and exposes the replicas' reports."""

    def register(self) -> None:
        """Publish this router, so the ingress can read the replicas' reports (health, metrics)
        that Serve delivers to it."""
        registry.ROUTERS[self._deployment_id.app_name] = self

    # Routing choices by reason ("affine", "least_loaded"); a request that is routed again after
    # finding its replica full counts again.
    decisions: dict[str, int]

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """The latest report of each live replica, by replica id (may be empty at first)."""
        return {
            r.replica_id.unique_id: dict(r.routing_stats or {}) for r in self._replicas.values()
        }


class PowerOfTwoRouter(ReplicaStatsSource):
    """Two replicas drawn at random, the less loaded one wins (Serve's default policy), with no
    prefix affinity: the baseline of ``--routing pow2``."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.decisions = {}
        self.register()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]


class PrefixAffinityRouter(ReplicaStatsSource):
    def initialize_state(
        self,
        page_size: int = 16,
        imbalance_threshold: float = 2.0,
        routed_ttl_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        self.page_size = page_size
        self.imbalance_threshold = imbalance_threshold
        self.index = PrefixIndex(routed_ttl_s=routed_ttl_s)
        self.decisions = {"affine": 0, "least_loaded": 0}
        self.register()

    def _keys(self, pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None or not pending_request.args:
            return []
        ids = getattr(pending_request.args[0], "prompt_ids", None) or []
        return prompt_keys(ids, self.page_size)

    def _load(self, replica: RunningReplica) -> float:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return float(cached)
        stats = replica.routing_stats or {}
        return float(stats.get("num_ongoing", 0))

    def _sync_reports(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            stats = r.routing_stats or {}
            if "prefix_keys" in stats:
                self.index.report(
                    r.replica_id, stats.get("report_id"), stats["prefix_keys"], time.monotonic()
                )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every candidate is ranked below, so a retry should back off rather than spin.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        self._sync_reports(candidate_replicas)
        keys = self._keys(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        matches = {rid: self.index.match(rid, keys) for rid in by_id} if keys else {}
        decision = choose(loads, matches, self.imbalance_threshold)
        self.decisions[decision.reason] += 1
        return [[by_id[rid] for rid in rank] for rank in decision.ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        keys = self._keys(pending_request)
        if keys:
            self.index.routed(replica_id, keys, time.monotonic())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only(r.replica_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
