"""`specdec cluster`: `specdec serve` with N engine replicas on Ray Serve behind one ingress.

Takes every flag of `specdec serve` (engine and HTTP) plus the cluster's own. Ray is imported
only when the command runs, so the CLI (and `specdec serve`) works without the extra installed.
"""

from __future__ import annotations

import argparse
import logging

from specdec.api.cluster.options import ROUTINGS, ClusterOptions
from specdec.api.commands import serve as serve_command
from specdec.engine.errors import ConfigError

logger = logging.getLogger(__name__)

INSTALL_HINT = "specdec cluster needs Ray Serve: pip install 'specdec[cluster]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_command.add_arguments(parser)
    d = ClusterOptions()
    g = parser.add_argument_group("cluster")
    g.add_argument("--replicas", type=int, default=d.replicas,
                   help="engine replicas (fixed count; default: %(default)s)")  # fmt: skip
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling: fewest replicas (at least 1; default: no autoscaling)")  # fmt: skip
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas (default: no autoscaling)")  # fmt: skip
    g.add_argument(
        "--target-ongoing-requests", type=float, default=d.target_ongoing_requests,
        help="autoscaling: requests in flight per replica that the autoscaler aims for "
        "(default: %(default)s)",
    )  # fmt: skip
    g.add_argument("--upscale-delay", type=float, default=d.upscale_delay_s,
                   help="autoscaling: seconds the load must stay above target before a replica "
                   "is added (default: %(default)s)")  # fmt: skip
    g.add_argument("--downscale-delay", type=float, default=d.downscale_delay_s,
                   help="autoscaling: seconds the load must stay below target before a replica "
                   "is removed (default: %(default)s)")  # fmt: skip
    g.add_argument(
        "--max-ongoing-requests", type=int, default=None,
        help="most requests sent to one replica at once (default: its --max-num-seqs plus "
        "--max-queue-len, what its engine accepts)",
    )  # fmt: skip
    g.add_argument(
        "--max-queued-requests", type=int, default=d.max_queued_requests,
        help="requests the ingress holds while every replica is full; beyond it 429 "
        "(default: %(default)s, no limit)",
    )  # fmt: skip
    g.add_argument("--routing", choices=ROUTINGS, default=d.routing,
                   help="prefix: to the replica holding the longest prompt prefix while loads "
                   "are balanced; pow2: Serve's default (default: %(default)s)")  # fmt: skip
    g.add_argument(
        "--imbalance-threshold", type=float, default=d.imbalance_threshold,
        help="prefix routing: requests in flight the prefix holder may have above the "
        "least-loaded replica and still be chosen (default: %(default)s)",
    )  # fmt: skip
    g.add_argument("--stats-period", type=float, default=d.stats_period_s,
                   help="seconds between replica reports (load, cached prefixes, metrics) "
                   "(default: %(default)s)")  # fmt: skip
    g.add_argument("--replica-cpus", type=float, default=d.replica_cpus,
                   help="Ray CPUs reserved per replica (default: %(default)s)")  # fmt: skip
    g.add_argument("--replica-gpus", type=float, default=d.replica_gpus,
                   help="Ray GPUs per replica, fractions share a GPU (default: %(default)s)")  # fmt: skip
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local one)")  # fmt: skip
    g.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs of the local Ray cluster (default: all)")  # fmt: skip
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="seconds a swapped-out or stopping replica may finish its requests "
                   "(default: %(default)s)")  # fmt: skip
    g.add_argument("--deploy-timeout", type=float, default=d.deploy_timeout_s,
                   help="seconds to wait for replicas to start (default: %(default)s)")  # fmt: skip
    g.add_argument("--admin-token", default=None,
                   help="enable POST /admin/swap with this bearer token (default: off)")  # fmt: skip


# Single-server options: replicas serve the target only (the draft is not a model of its own).
_SINGLE_SERVER_FLAGS = {
    "router_model_name": "--router-model-name",
    "draft_served_model_name": "--draft-served-model-name",
    "draft_num_kv_blocks": "--draft-num-kv-blocks",
}


def options_from_args(args: argparse.Namespace) -> ClusterOptions:
    given = [flag for name, flag in _SINGLE_SERVER_FLAGS.items() if getattr(args, name) is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: specdec cluster serves the target model only; "
            "the draft as its own model and the router name are specdec serve options"
        )
    return ClusterOptions(
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        routing=args.routing,
        imbalance_threshold=args.imbalance_threshold,
        stats_period_s=args.stats_period,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        ray_address=args.ray_address,
        num_cpus=args.num_cpus,
        drain_timeout_s=args.drain_timeout,
        deploy_timeout_s=args.deploy_timeout,
    )


def run(args: argparse.Namespace) -> int:
    from specdec.api.engine_args import config_from_args

    config = config_from_args(args)
    settings = serve_command.settings_from_args(args, config)
    options = options_from_args(args)  # every flag checked before Ray starts
    try:
        import uvicorn
        from specdec.api.cluster.server import ClusterServer
        from specdec.api.slow_clients import header_timeout_protocol
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "ray":
            raise ConfigError(INSTALL_HINT) from None
        raise
    import asyncio

    server = ClusterServer(config, settings, options, admin_token=args.admin_token)
    server.connect()
    uv = uvicorn.Server(
        uvicorn.Config(
            server,
            host=settings.host,
            port=settings.port,
            log_level=str(getattr(args, "log_level", "info")).lower(),
            timeout_graceful_shutdown=5,
            http=header_timeout_protocol(settings.header_timeout_s),
        )
    )

    async def main() -> None:
        await server.start()
        await uv.serve()

    asyncio.run(main())
    return 0
