"""`specdec serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specdec.api.engine_args import add_engine_arguments, config_from_args
from specdec.api.model_routing import add_routing_arguments, build_draft_engine, routing_from_args
from specdec.api.settings import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_REQUEST_TIMEOUT_S,
    ServerSettings,
)
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in `model` (default: the basename of --model)",
    )
    server.add_argument(
        "--ab-split",
        type=float,
        default=None,
        help="A/B test: a request that does not choose `speculative` goes to the spec arm with "
        "this probability, else to plain decode (default: off, the engine default applies)",
    )
    server.add_argument(
        "--ab-seed", type=int, default=None, help="seed of the A/B assignment (default: random)"
    )
    server.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="requests allowed to wait for a batch slot before new ones get 429 "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for; also the default for requests without "
        "one (default: up to max_model_len)",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds after which a request still running is aborted (default: %(default)s)",
    )
    server.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted; larger ones get 413 (default: %(default)s)",
    )
    server.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a request's headers, from the connection opening or "
        "the request's first byte; then the connection is closed (default: %(default)s)",
    )
    server.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may stall between chunks before a 408 (default: %(default)s)",
    )
    server.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="parse special-token text (such as <|im_start|>) inside chat message content as "
        "control tokens, for trusted clients; by default it is plain text (completion prompts "
        "are always parsed)",
    )
    add_routing_arguments(parser)
    add_engine_arguments(parser)


def default_served_name(config: EngineConfig) -> str:
    """The basename of --model (a default model name is its own basename)."""
    return Path(config.model.rstrip("/\\")).name or config.model


def settings_from_args(args: argparse.Namespace, config: EngineConfig) -> ServerSettings:
    settings = ServerSettings(
        served_model_names=tuple(args.served_model_name or (default_served_name(config),)),
        host=args.host,
        port=args.port,
        ab_split=args.ab_split,
        ab_seed=args.ab_seed,
        max_queue_len=args.max_queue_len,
        max_tokens_limit=args.max_tokens_limit,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )
    if settings.ab_split is not None and not config.speculation_enabled:
        raise ConfigError("--ab-split needs speculation: set --speculative-method")
    return settings


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from specdec.api.app import create_app
    from specdec.api.slow_clients import header_timeout_protocol
    from specdec.engine.async_engine import AsyncEngine, loop_hooks_from_env
    from specdec.engine.llm_engine import LLMEngine

    config = config_from_args(args)
    settings = settings_from_args(args, config)  # refuse bad server flags before loading models
    routing = routing_from_args(args, config, settings)
    engine = LLMEngine(config)  # pulls the default pair on first run, with progress bars
    hooks = loop_hooks_from_env()
    if hooks.active:
        logger.warning("test hooks active: %s", hooks)
    async_engine = AsyncEngine(engine, max_queue_len=settings.max_queue_len, hooks=hooks)
    draft_engine = None
    if routing.serve_draft:
        draft = build_draft_engine(engine, routing.draft_num_kv_blocks)
        draft_engine = AsyncEngine(draft, max_queue_len=settings.max_queue_len)
        logger.info("serving the draft model as %r too (plain decode)", routing.draft_served_name)
    app = create_app(async_engine, settings, draft_engine, routing)
    level = str(getattr(args, "log_level", "info")).lower()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=level,
        timeout_graceful_shutdown=5,
        http=header_timeout_protocol(settings.header_timeout_s),
    )
    return 0
