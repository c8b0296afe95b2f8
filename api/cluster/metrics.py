"""Metrics of a cluster: each replica's engine gauges plus its prefix cache, and the merge of
the ingress's exposition with the replicas' under a ``replica`` label.

Request metrics (latencies, tokens, speculation counters per A/B arm) are observed where every
request passes: the ingress. They aggregate across replicas by construction. Engine state
(batch, queue, KV use, the controller's estimates, prefix-cache hits) exists once per replica;
each replica renders its own exposition, and ``/metrics`` merges the families, a replica's
samples carrying ``replica="<id>"``. A gauge family that the replicas report replaces the
ingress's own (which would only describe the ingress's sum of them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from specdec.api.metrics import ServerMetrics
from specdec.engine.async_engine import EngineSnapshot
from specdec.engine.block_allocator import BlockAllocator

REPLICA_LABEL = "replica"


class ReplicaMetrics(ServerMetrics):
    """ServerMetrics of one replica (only its engine gauges get samples there) plus the prefix
    cache's counters, which the single-process server does not export."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        r = self.registry
        self.prefix_queries = Counter(
            "specdec:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            ("model_name",),
            registry=r,
        )
        self.prefix_hits = Counter(
            "specdec:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            ("model_name",),
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "specdec:prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / tokens looked up, since start",
            ("model_name",),
            registry=r,
        )
        self._queries = 0
        self._hits = 0

    def render(  # type: ignore[override]
        self, snapshot: EngineSnapshot, alive: bool, allocator: BlockAllocator | None = None
    ) -> bytes:
        if allocator is not None:
            m = self.model_name
            queries, hits = allocator.prefix_queries, allocator.prefix_hits
            self.prefix_queries.labels(m).inc(max(0, queries - self._queries))
            self.prefix_hits.labels(m).inc(max(0, hits - self._hits))
            self._queries, self._hits = queries, hits
            self.prefix_hit_rate.labels(m).set(hits / queries if queries else 0.0)
        return super().render(snapshot, alive)


class _Families:
    """A collector that yields already-built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def routing_exposition(model_name: str, decisions: dict[str, int]) -> bytes:
    """The router's choices so far: ``affine`` (the prefix holder) or ``least_loaded``."""
    family = CounterMetricFamily(
        "specdec:cluster_routing_decisions",
        "Routing choices, by why the replica was chosen (a retried request counts again)",
        labels=("model_name", "reason"),
    )
    for reason, count in sorted(decisions.items()):
        family.add_metric((model_name, reason), count)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([family]))  # type: ignore[arg-type]
    return generate_latest(registry)


def merge_expositions(ingress: bytes, replicas: dict[str, bytes]) -> bytes:
    """One exposition: the ingress's families, each replica's samples labelled with its id."""
    merged: dict[str, Metric] = {}
    replica_gauges: set[str] = set()
    for replica, text in sorted(replicas.items()):
        for family in text_string_to_metric_families(text.decode()):
            if not family.samples:
                continue
            if family.type == "gauge":
                replica_gauges.add(family.name)
            target = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            target.samples.extend(
                s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples
            )
    for family in text_string_to_metric_families(ingress.decode()):
        if family.name in replica_gauges or not family.samples:
            continue
        target = merged.setdefault(
            family.name, Metric(family.name, family.documentation, family.type)
        )
        target.samples[:0] = family.samples
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))  # type: ignore[arg-type]
    return generate_latest(registry)
