"""The FastAPI application: routes, error handling, body limit, lifespan of the engine loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from specdec.api.ab import ARM_HEADER, SPECULATIVE_HEADER, ArmAssigner
from specdec.api.dashboard import controller_source, install_dashboard
from specdec.api.errors import APIError, install_error_handlers
from specdec.api.json_text import JSONText
from specdec.api.metrics import ServerMetrics
from specdec.api.middleware import BodySizeLimitMiddleware, UnhandledErrorMiddleware
from specdec.api.model_routing import Backend, ModelRouter, RoutingSettings
from specdec.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    SpeculationHealth,
)
from specdec.api.rolling_window import RollingWindow
from specdec.api.serving import OpenAIServing
from specdec.api.settings import ServerSettings
from specdec.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "invalid request (bad JSON, wrong type, out of range, prompt too long)"),
        (404, "unknown model"),
        (408, "request body not received within --body-timeout"),
        (413, "request body over --max-body-bytes"),
        (429, "queue full (see the Retry-After header)"),
        (503, "engine not ready, engine loop stopped, or request timed out"),
    )
}


def _stream_doc(model: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": f"JSON body, or with stream=true an SSE stream of chunks; header "
            f"{ARM_HEADER} names the A/B arm",
            "content": {"text/event-stream": {}},
        },
        **_ERRORS,
    }


def create_app(
    engine: AsyncEngine,
    settings: ServerSettings,
    draft_engine: AsyncEngine | None = None,
    routing: RoutingSettings | None = None,
) -> FastAPI:
    """Build the app for one engine, and optionally ``draft_engine`` serving the draft model as
    ``routing.draft_served_name`` (api.model_routing). The lifespan starts the engine loops
    (unless already running) and stops them at shutdown."""
    config = engine.engine.config
    metrics = ServerMetrics(
        settings.model_name, RollingWindow(controller=controller_source(engine))
    )
    assigner = ArmAssigner(
        config.speculative_mode,
        has_proposer=engine.engine.proposer is not None,
        split=settings.ab_split,
        seed=settings.ab_seed,
    )
    router = _router(engine, settings, assigner, draft_engine, routing)
    serving = OpenAIServing(engine, settings, metrics, assigner, router)
    created = int(time.time())
    engines = [b.engine for b in router.backends]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for e in engines:
            if not e.is_alive and e.error is None:
                e.start()
        _log_ready(engine, settings)
        yield
        for e in engines:
            await asyncio.to_thread(e.stop)
        if serving.prompts is not None:
            serving.prompts.shutdown()

    app = FastAPI(
        title="specdec",
        summary="OpenAI-compatible server with speculative decoding",
        version="0.1.0",
        lifespan=lifespan,
        default_response_class=JSONText,
    )
    app.state.metrics = metrics
    app.state.engine = engine
    install_error_handlers(app, on_error=metrics.rejected)
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        on_reject=metrics.rejected,
        timeout_s=settings.body_timeout_s,
    )
    # Added last, so it wraps the other middleware too.
    app.add_middleware(UnhandledErrorMiddleware, on_error=metrics.rejected)

    @app.post(
        "/v1/chat/completions",
        responses=_stream_doc(ChatCompletionResponse),
        response_class=JSONText,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion (OpenAI format). Speculation per request: body field `speculative`
        or header `X-Specdec-Speculative`."""
        _check_ready(engine)
        return await serving.chat(body, request)

    @app.post("/v1/completions", responses=_stream_doc(CompletionResponse), response_class=JSONText)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion (OpenAI format) of a string or token-id prompt."""
        _check_ready(engine)
        return await serving.completion(body, request)

    def model_cards() -> list[ModelCard]:
        draft_model = config.draft_model if engine.engine.proposer is not None else None
        cards = [
            ModelCard(
                id=name,
                created=created,
                root=config.model,
                max_model_len=engine.engine.max_model_len,
                draft_model=draft_model,
            )
            for name in settings.served_model_names
        ]
        if router.draft is not None:
            d = router.draft
            cards.append(
                ModelCard(id=d.name, created=created, root=d.root, max_model_len=d.max_model_len)
            )
        if router.router_name is not None:
            # Long requests go to the target, so the target's limit is the router's.
            cards.append(
                ModelCard(
                    id=router.router_name,
                    created=created,
                    root="router",
                    max_model_len=engine.engine.max_model_len,
                )
            )
        return cards

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=model_cards())

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses={404: _ERRORS[404]})
    async def get_model(model_id: str) -> ModelCard:
        for card in model_cards():
            if card.id == model_id:
                return card
        raise APIError(
            404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
        )

    @app.get(
        "/health",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "engine loop not running"}},
    )
    async def health() -> JSONText:
        """200 while the engine loop runs with the model loaded, 503 otherwise."""
        body = _health(engine, settings)
        return JSONText(body.model_dump(mode="json"), status_code=200 if body.ready else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus_metrics() -> Response:
        data = metrics.render(engine.snapshot, engine.is_alive)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    install_dashboard(app, engine, settings, metrics.window, router.names)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _router(
    engine: AsyncEngine,
    settings: ServerSettings,
    assigner: ArmAssigner,
    draft_engine: AsyncEngine | None,
    routing: RoutingSettings | None,
) -> ModelRouter:
    target = Backend(settings.model_name, engine.engine.config.model, engine, assigner)
    draft = None
    if draft_engine is not None:
        if routing is None or routing.draft_served_name is None:
            raise ValueError("a draft engine needs routing settings naming it (resolve_routing)")
        config = draft_engine.engine.config
        draft = Backend(
            routing.draft_served_name,
            config.model,
            draft_engine,
            ArmAssigner(config.speculative_mode, has_proposer=False),
        )
    return ModelRouter(target, settings.served_model_names, draft, routing)


def _check_ready(engine: AsyncEngine) -> None:
    if not engine.is_alive:
        reason = engine.error or "the engine loop is not running"
        raise APIError(503, reason, type="service_unavailable", code="engine_unavailable")


def _health(engine: AsyncEngine, settings: ServerSettings) -> HealthResponse:
    snap = engine.snapshot
    config = engine.engine.config
    ready = engine.is_alive
    reason = None if ready else (engine.error or "the engine loop is not running")
    return HealthResponse(
        status="ok" if ready else "unavailable",
        ready=ready,
        reason=reason,
        model=settings.model_name,
        num_requests_running=snap.num_running,
        num_requests_waiting=snap.num_waiting,
        kv_cache_usage=snap.kv_usage,
        num_free_blocks=snap.num_free_blocks,
        num_blocks=snap.num_blocks,
        engine_steps=snap.num_steps,
        seconds_since_loop_iteration=max(0.0, time.monotonic() - snap.loop_time),
        speculation=SpeculationHealth(
            method=config.speculative_method,
            default_mode=config.speculative_mode,
            num_speculative_tokens=config.num_speculative_tokens,
            ab_split=settings.ab_split,
            mean_k=snap.mean_k,
            speculating_fraction=snap.speculating_fraction,
            acceptance_rate=snap.acceptance_rate,
            mean_accepted_length=snap.mean_accepted_length,
        ),
        error=None
        if ready
        else ErrorDetail(
            message=reason or "", type="service_unavailable", code="engine_unavailable"
        ),
    )


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document without FastAPI's 422 responses (validation errors are 400s here)
    and with the speculation header documented."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    header = {
        "name": SPECULATIVE_HEADER,
        "in": "header",
        "required": False,
        "description": "speculation mode when the body has no `speculative` field",
        "schema": {"type": "string", "enum": ["auto", "on", "off"]},
    }
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            if path in ("/v1/chat/completions", "/v1/completions"):
                op.setdefault("parameters", []).append(header)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    app.openapi_schema = schema
    return schema


def _log_ready(engine: AsyncEngine, settings: ServerSettings) -> None:
    core = engine.engine
    config = core.config
    if core.proposer is None:
        spec = "speculation off (speculative_method=none)"
    else:
        spec = (
            f"speculation: method={config.speculative_method}"
            f"{f' draft={config.draft_model}' if config.draft_model else ''} "
            f"default mode={config.speculative_mode} k={config.num_speculative_tokens}"
        )
    ab = (
        f"; A/B split {settings.ab_split:.2f} spec / {1 - settings.ab_split:.2f} plain"
        f" (seed {settings.ab_seed})"
        if settings.ab_split is not None
        else ""
    )
    logger.info(
        "specdec ready at http://%s:%d: model %s (%s), %d KV blocks x %d tokens, "
        "max_model_len %d, %s%s",
        settings.host,
        settings.port,
        settings.model_name,
        config.model,
        core.allocator.num_blocks,
        config.page_size,
        core.max_model_len,
        spec,
        ab,
    )
