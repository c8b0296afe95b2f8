"""The cluster's ingress: one HTTP app in front of a Ray Serve deployment of engine replicas.

A *generation* is one Serve application running the engine deployment for one engine
configuration, plus the API app built for it by ``api.app.create_app`` over a ``RemoteEngine``
(so the OpenAI endpoints, validation, errors and streaming are the single server's). The
ingress forwards every request to the current generation's app, except its own routes:
``/health`` and ``/metrics`` aggregated over the replicas, and ``POST /admin/swap`` when an
admin token is set.

A swap (blue-green) deploys the new generation beside the old one and waits until its replicas
are ready; then new requests go to it, the old generation's requests run to their end
(``drain_timeout_s`` at most), and the old application is deleted.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from ray import serve
from specdec.api.app import _health, create_app
from specdec.api.cluster.metrics import merge_expositions, routing_exposition
from specdec.api.cluster.options import ClusterOptions, deployment_options
from specdec.api.cluster.registry import ROUTERS
from specdec.api.cluster.remote_engine import REPLICA_SLOT, RemoteEngine
from specdec.api.cluster.replica import EngineReplica
from specdec.api.errors import APIError, install_error_handlers
from specdec.api.json_text import JSONText
from specdec.api.protocol import HealthResponse
from specdec.api.settings import ServerSettings
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-Specdec-Replica"
DEPLOYMENT_NAME = "engine"
APP_PREFIX = "specdec-"
OWN_PATHS = ("/health", "/metrics", "/admin/swap")


class ReplicaHealth(BaseModel):
    replica: str
    ready: bool
    num_requests_running: int
    num_requests_waiting: int
    num_requests_in_flight: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    seconds_since_report: float | None = None


class ClusterHealthResponse(HealthResponse):
    """The single server's health body summed over replicas, plus one entry per replica."""

    generation: str
    replicas: list[ReplicaHealth] = Field(default_factory=list)


class SwapRequest(BaseModel):
    """Engine flags to change, as on the command line (``["--num-speculative-tokens", "3"]``);
    the rest of the configuration stays."""

    args: list[str] = Field(default_factory=list)


@dataclass
class Generation:
    name: str
    config: EngineConfig
    engine: RemoteEngine
    app: FastAPI
    lifespan: AbstractAsyncContextManager[Any]
    in_flight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)


def _replica_health(replica: str, report: dict[str, Any]) -> ReplicaHealth:
    snap = report.get("snapshot", {})
    queries = report.get("prefix_queries", 0)
    return ReplicaHealth(
        replica=replica,
        ready=bool(report.get("alive", True)),
        num_requests_running=snap.get("num_running", 0),
        num_requests_waiting=snap.get("num_waiting", 0),
        num_requests_in_flight=report.get("num_ongoing", 0),
        kv_cache_usage=snap.get("kv_usage", 0.0),
        prefix_cache_hit_rate=report.get("prefix_hits", 0) / queries if queries else 0.0,
        seconds_since_report=report.get("loop_age_s"),
    )


class ClusterServer:
    """Deploys generations and serves the ingress ASGI app (``self`` is the ASGI callable)."""

    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        options: ClusterOptions,
        admin_token: str | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.admin_token = admin_token
        self.current: Generation | None = None
        self._config = config
        self._counter = 0
        self._swap_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self.own = self._own_app()

    # ---- generations ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to Ray (or start a local cluster) and deploy the first generation."""
        await asyncio.to_thread(self.connect)
        self.current = await self._deploy(self._config)

    def connect(self) -> None:
        """Join ``--ray-address`` or start a local Ray cluster (once per process; call it from
        the main thread so Ray installs its signal handlers) and start Serve without its HTTP
        proxy: the ingress is this process."""
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if self.options.ray_address:
                kwargs["address"] = self.options.ray_address
            elif self.options.num_cpus is not None:
                kwargs["num_cpus"] = self.options.num_cpus
            ray.init(**kwargs)
        serve.start(proxy_location="Disabled")

    async def _deploy(self, config: EngineConfig) -> Generation:
        self._counter += 1
        # Unique within the Ray cluster, which other ingresses may share.
        name = f"{APP_PREFIX}{os.getpid()}-{int(time.time())}-g{self._counter}"
        opts = deployment_options(self.options, config, self.settings)
        deployment = serve.deployment(EngineReplica).options(name=DEPLOYMENT_NAME, **opts)
        app = deployment.bind(config, self.settings.max_queue_len, self.settings.model_name, name)
        # No access log line per request from the replicas (Serve's default); the ingress's
        # uvicorn log has them.
        target = serve.RunTarget(
            app, name=name, route_prefix=None, logging_config={"enable_access_log": False}
        )
        try:
            (handle,) = await asyncio.to_thread(
                serve.run_many, [target], wait_for_applications_running=False
            )
            await self._wait_running(name)
            info = await handle.describe.remote()
        except BaseException:
            await asyncio.to_thread(serve.delete, name)
            raise
        engine = RemoteEngine(handle, config, info, lambda: self._reports(name))
        api = create_app(engine, self.settings)  # type: ignore[arg-type]
        lifespan = api.router.lifespan_context(api)
        await lifespan.__aenter__()
        logger.info(
            "generation %s ready: %s, routing %s", name, self._replica_text(), self.options.routing
        )
        return Generation(name, config, engine, api, lifespan)

    def _replica_text(self) -> str:
        o = self.options
        if o.autoscaling:
            return f"{o.min_replicas or 1}..{o.max_replicas} replicas (autoscaling)"
        return f"{o.replicas} replica(s)"

    async def _wait_running(self, name: str) -> None:
        deadline = time.monotonic() + self.options.deploy_timeout_s
        while True:
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(name)
            state = str(app.status) if app is not None else "NOT_STARTED"
            if state.endswith("RUNNING"):
                return
            if state.endswith("DEPLOY_FAILED") or state.endswith("UNHEALTHY"):
                raise ConfigError(f"the engine replicas failed to start: {app.message}")
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the engine replicas were not ready within {self.options.deploy_timeout_s} s"
                    f" ({state}); does the cluster have room for them (--replica-cpus, "
                    f"--replica-gpus)?"
                )
            await asyncio.sleep(0.25)

    def _reports(self, name: str) -> dict[str, dict[str, Any]]:
        router = ROUTERS.get(name)
        return router.replica_stats() if router is not None else {}

    async def swap(self, config: EngineConfig) -> Generation:
        """Blue-green: deploy ``config``, switch new requests to it, drain and delete the old."""
        async with self._swap_lock:
            new = await self._deploy(config)
            old, self.current = self.current, new
            if old is not None:
                task = asyncio.create_task(self._retire(old))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
            return new

    async def _retire(self, gen: Generation) -> None:
        if gen.in_flight:
            try:
                await asyncio.wait_for(gen.drained.wait(), self.options.drain_timeout_s)
            except asyncio.TimeoutError:
                logger.warning("generation %s: %d requests still open at drain timeout",
                               gen.name, gen.in_flight)  # fmt: skip
        await gen.lifespan.__aexit__(None, None, None)
        await asyncio.to_thread(serve.delete, gen.name)
        logger.info("generation %s retired", gen.name)

    async def wait_retired(self) -> None:
        """Until every swapped-out generation is deleted (tests, shutdown)."""
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def shutdown(self) -> None:
        await self.wait_retired()
        if self.current is not None:
            gen, self.current = self.current, None
            await gen.lifespan.__aexit__(None, None, None)
            await asyncio.to_thread(serve.delete, gen.name)

    # ---- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http" or scope["path"] in OWN_PATHS or self.current is None:
            await self.own(scope, receive, send)
            return
        gen = self.current
        gen.in_flight += 1
        gen.drained.clear()
        slot: dict[str, str] = {}
        token = REPLICA_SLOT.set(slot)

        async def send_with_replica(message: dict) -> None:
            if message["type"] == "http.response.start" and "replica" in slot:
                value = f"{gen.name}/{slot['replica']}".encode()
                message = {**message, "headers": [*message.get("headers", []),
                                                   (REPLICA_HEADER.lower().encode(), value)]}  # fmt: skip
            await send(message)

        try:
            await gen.app(scope, receive, send_with_replica)
        finally:
            REPLICA_SLOT.reset(token)
            gen.in_flight -= 1
            if gen.in_flight == 0:
                gen.drained.set()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _own_app(self) -> FastAPI:
        app = FastAPI(title="specdec cluster", default_response_class=JSONText)
        install_error_handlers(app)

        @app.get("/health", response_model=ClusterHealthResponse)
        async def health() -> JSONText:
            gen = self.current
            if gen is None:
                raise APIError(503, "no engine generation is deployed", type="service_unavailable",
                               code="engine_unavailable")  # fmt: skip
            body = _health(gen.engine, self.settings)  # type: ignore[arg-type]
            reports = self._reports(gen.name)
            full = ClusterHealthResponse(
                **body.model_dump(),
                generation=gen.name,
                replicas=[_replica_health(r, s) for r, s in sorted(reports.items())],
            )
            return JSONText(full.model_dump(mode="json"), status_code=200 if body.ready else 503)

        @app.get("/metrics", response_class=Response)
        async def metrics() -> Response:
            gen = self.current
            if gen is None:
                return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
            ingress = gen.app.state.metrics.render(gen.engine.snapshot, gen.engine.is_alive)
            router = ROUTERS.get(gen.name)
            if router is not None and router.decisions:
                ingress += routing_exposition(self.settings.model_name, router.decisions)
            replicas = {
                r: s["metrics"] for r, s in self._reports(gen.name).items() if "metrics" in s
            }
            return Response(
                merge_expositions(ingress, replicas),
                media_type="text/plain; version=0.0.4; charset=utf-8",
            )

        @app.post("/admin/swap")
        async def admin_swap(body: SwapRequest, request: Request) -> JSONText:
            """Blue-green swap to the current configuration with ``args`` applied (engine flags);
            answers once the new replicas serve. Needs ``Authorization: Bearer <admin token>``."""
            self._check_admin(request)
            config = self._config_with(body.args)
            gen = await self.swap(config)
            return JSONText({"generation": gen.name, "model": config.model})

        return app

    def _check_admin(self, request: Request) -> None:
        if self.admin_token is None:
            raise APIError(404, "no route POST /admin/swap (start with --admin-token to enable)",
                           type="not_found_error")  # fmt: skip
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            raise APIError(401, "missing or wrong admin token", type="authentication_error")

    def _config_with(self, args: list[str]) -> EngineConfig:
        import argparse

        from specdec.api.engine_args import add_engine_arguments, config_from_args

        current = self.current.config if self.current is not None else self._config
        parser = argparse.ArgumentParser(prog="swap", add_help=False, exit_on_error=False)
        add_engine_arguments(parser)
        parser.set_defaults(**{f: getattr(current, f) for f in current.__dataclass_fields__})
        try:
            ns = parser.parse_args(args)
            return config_from_args(ns)
        except (argparse.ArgumentError, SystemExit) as exc:
            raise APIError(400, f"invalid swap arguments: {exc}", param="args") from None
