"""Options of `specdec cluster` that are neither engine nor HTTP settings, and the Ray Serve
deployment options they make. No Ray import here: `specdec serve` and the CLI parser load this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from specdec.api.settings import ServerSettings
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError

ROUTINGS = ("prefix", "pow2")
ROUTER_CLASSES = {
    "prefix": "specdec.api.cluster.router.PrefixAffinityRouter",
    "pow2": "specdec.api.cluster.router.PowerOfTwoRouter",
}
# Environment variables forwarded to the replicas' processes (the engine's test hooks).
FORWARDED_ENV_PREFIX = "SPECDEC_"


@dataclass(frozen=True)
class ClusterOptions:
    """``replicas``: fixed replica count; with ``max_replicas`` above ``min_replicas`` the
    deployment autoscales between the two on requests in flight per replica
    (``target_ongoing_requests``), after the load has stayed above (below) it for
    ``upscale_delay_s`` (``downscale_delay_s``). ``max_ongoing_requests``: requests Serve sends one replica at
    most (None: the engine's batch plus its queue, so a replica is never sent more than it
    accepts). ``max_queued_requests``: requests the ingress holds while every replica is full
    before answering 429 (-1: no limit). ``routing``: ``prefix`` (longest cached prefix when
    loads are within ``imbalance_threshold`` requests) or ``pow2`` (Serve's default policy).
    """

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    max_ongoing_requests: int | None = None
    max_queued_requests: int = -1
    routing: str = "prefix"
    imbalance_threshold: float = 2.0
    stats_period_s: float = 1.0
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ray_address: str | None = None
    num_cpus: int | None = None
    drain_timeout_s: float = 60.0
    deploy_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}")
        lo, hi = self.min_replicas, self.max_replicas
        # At least one: the ingress answers 503 while no replica runs (no scale from zero).
        check(lo is None or lo >= 1, f"--min-replicas must be >= 1, got {lo}")
        check(hi is None or hi >= 1, f"--max-replicas must be >= 1, got {hi}")
        check(
            lo is None or hi is None or lo <= hi,
            f"--min-replicas ({lo}) must not exceed --max-replicas ({hi})",
        )
        check(
            self.target_ongoing_requests > 0,
            f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}",
        )
        check(
            self.upscale_delay_s >= 0 and self.downscale_delay_s >= 0,
            "--upscale-delay and --downscale-delay must be >= 0 seconds",
        )
        check(
            self.max_ongoing_requests is None or self.max_ongoing_requests >= 1,
            f"--max-ongoing-requests must be >= 1, got {self.max_ongoing_requests}",
        )
        check(
            self.max_queued_requests == -1 or self.max_queued_requests >= 1,
            f"--max-queued-requests must be -1 (no limit) or >= 1, got {self.max_queued_requests}",
        )
        check(self.routing in ROUTINGS, f"--routing must be one of {ROUTINGS}, got {self.routing}")
        check(self.imbalance_threshold >= 0, "--imbalance-threshold must be >= 0")
        check(self.stats_period_s > 0, "--stats-period must be > 0 seconds")
        check(self.replica_cpus >= 0 and self.replica_gpus >= 0, "replica resources must be >= 0")
        check(self.num_cpus is None or self.num_cpus >= 1, "--num-cpus must be >= 1")
        check(self.drain_timeout_s > 0, "--drain-timeout must be > 0 seconds")
        check(self.deploy_timeout_s > 0, "--deploy-timeout must be > 0 seconds")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


def replica_capacity(config: EngineConfig, settings: ServerSettings) -> int:
    """Requests one engine accepts at once: its batch plus the queue before its 429."""
    return config.max_num_seqs + (settings.max_queue_len or 0)


def deployment_options(
    options: ClusterOptions, config: EngineConfig, settings: ServerSettings
) -> dict[str, Any]:
    """Keyword arguments of ``serve.deployment(...).options`` for the engine deployment."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIX)}
    actor: dict[str, Any] = {"num_cpus": options.replica_cpus}
    if options.replica_gpus:
        actor["num_gpus"] = options.replica_gpus
    if env:
        actor["runtime_env"] = {"env_vars": env}
    result: dict[str, Any] = {
        "max_ongoing_requests": options.max_ongoing_requests or replica_capacity(config, settings),
        "max_queued_requests": options.max_queued_requests,
        "ray_actor_options": actor,
        # A stopping replica keeps serving the streams it has until they end, up to this long.
        "graceful_shutdown_timeout_s": options.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0,
        "request_router_config": {
            "request_router_class": ROUTER_CLASSES[options.routing],
            "request_router_kwargs": {
                "page_size": config.page_size,
                "imbalance_threshold": options.imbalance_threshold,
                "routed_ttl_s": max(10.0, 4 * options.stats_period_s),
            }
            if options.routing == "prefix"
            else {},
            "request_routing_stats_period_s": options.stats_period_s,
            "request_routing_stats_timeout_s": max(5.0, 2 * options.stats_period_s),
        },
    }
    if options.autoscaling:
        lo = options.min_replicas if options.min_replicas is not None else 1
        hi = options.max_replicas if options.max_replicas is not None else max(lo, options.replicas)
        result["autoscaling_config"] = {
            "min_replicas": lo,
            "initial_replicas": min(max(lo, options.replicas), hi),
            "max_replicas": hi,
            "target_ongoing_requests": options.target_ongoing_requests,
            "upscale_delay_s": options.upscale_delay_s,
            "downscale_delay_s": options.downscale_delay_s,
        }
    else:
        result["num_replicas"] = options.replicas
    return result
