"""Model routing: which engine answers the ``model`` a request names.

The target answers its served names (``--served-model-name``). When the engine has a draft model,
the draft is served as a model of its own too (``--draft-served-model-name``; by default the
basename of ``--draft-model``, with ``-draft`` appended when that is already a target name): a
request naming it is decoded plainly by the draft alone. It runs on a second, light engine loop
(``build_draft_engine``) that uses the draft's weights already in memory (they are not loaded
again) with a KV pool of its own, ``--draft-num-kv-blocks`` blocks of the draft's size only. The
speculative engine's pool is shared by target and draft blocks of the same ids and its scheduler,
prefix cache and step timing all assume a target forward per sequence, so a separate loop is the
change that leaves the speculative path untouched.

``--router-model-name NAME`` (e.g. ``auto``) adds a router name. A request naming it goes to the
draft when all of these hold, otherwise to the target:
- it sets ``max_tokens`` (or ``max_completion_tokens``) to at most ``--route-max-tokens``;
- its prompt has at most ``--route-max-prompt-tokens`` tokens;
- it does not ask for speculation ``on`` (body field or header), which only the target can do.

Whatever was asked, the response's ``model`` field and the ``X-Specdec-Model`` header name the
model that answered.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specdec.api.ab import ArmAssigner
from specdec.api.errors import APIError
from specdec.api.settings import ServerSettings
from specdec.engine.async_engine import AsyncEngine
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError
from specdec.engine.kv_cache import GIB, bytes_per_block
from specdec.engine.llm_engine import LLMEngine

MODEL_HEADER = "X-Specdec-Model"
DRAFT_NAME_SUFFIX = "-draft"
# The draft's own pool by default: this share of the speculative engine's block count, and at
# most this many bytes (a GPU's main pool is most of the device).
DEFAULT_DRAFT_POOL_DIVISOR = 4
DEFAULT_DRAFT_POOL_MAX_BYTES = GIB // 4
DEFAULT_ROUTE_MAX_TOKENS = 64
DEFAULT_ROUTE_MAX_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class RoutingSettings:
    """``serve_draft``: serve the draft model (when there is one) under ``draft_served_name``.
    ``draft_num_kv_blocks``: the draft engine's pool (None: the main pool's block count / 4, at
    most 0.25 GiB, at least one max_model_len sequence). ``router_name``: the optional router model name; it sends
    a request to the draft when ``max_tokens <= route_max_tokens`` and the prompt has at most
    ``route_max_prompt_tokens`` tokens."""

    serve_draft: bool = True
    draft_served_name: str | None = None
    draft_num_kv_blocks: int | None = None
    router_name: str | None = None
    route_max_tokens: int = DEFAULT_ROUTE_MAX_TOKENS
    route_max_prompt_tokens: int = DEFAULT_ROUTE_MAX_PROMPT_TOKENS

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(self.draft_served_name != "", "--draft-served-model-name must not be empty")
        check(self.router_name != "", "--router-model-name must not be empty")
        check(
            self.draft_num_kv_blocks is None or self.draft_num_kv_blocks >= 1,
            f"draft_num_kv_blocks must be >= 1, got {self.draft_num_kv_blocks}",
        )
        check(
            self.route_max_tokens >= 1,
            f"route_max_tokens must be >= 1, got {self.route_max_tokens}",
        )
        check(
            self.route_max_prompt_tokens >= 1,
            f"route_max_prompt_tokens must be >= 1, got {self.route_max_prompt_tokens}",
        )


def resolve_routing(
    routing: RoutingSettings, config: EngineConfig, settings: ServerSettings
) -> RoutingSettings:
    """Fill in the draft's served name and refuse name clashes (before any model is loaded).

    A server without a draft model serves none, so a router name has nothing to route to."""
    targets = settings.served_model_names
    draft = routing.draft_served_name
    if not (routing.serve_draft and config.draft_model):
        if routing.router_name is not None:
            raise ConfigError(
                "--router-model-name needs the draft model served: a --draft-model with "
                "--speculative-method draft_model, and not --no-serve-draft"
            )
        return dataclasses.replace(routing, serve_draft=False, draft_served_name=None)
    if draft is None:
        draft = Path(config.draft_model.rstrip("/\\")).name or config.draft_model
        if draft in targets:
            draft += DRAFT_NAME_SUFFIX
    elif draft in targets:
        raise ConfigError(f"--draft-served-model-name {draft!r} is also a target's served name")
    if routing.router_name is not None and routing.router_name in (*targets, draft):
        raise ConfigError(f"--router-model-name {routing.router_name!r} is also a served name")
    return dataclasses.replace(routing, draft_served_name=draft)


def build_draft_engine(engine: LLMEngine, num_blocks: int | None = None) -> LLMEngine:
    """A plain-decode engine over ``engine``'s draft model: the same weights object (nothing is
    loaded), speculation off, its own KV pool of ``num_blocks`` blocks (default: a quarter of the
    main pool's block count, at most 0.25 GiB, at least one max_model_len sequence)."""
    if engine.draft is None:
        raise ConfigError("this engine has no draft model to serve")
    config = engine.config
    max_len = min(config.max_model_len, engine.draft.arch.max_position_embeddings)
    need = -(-max_len // config.page_size)
    if num_blocks is None:
        per_block = bytes_per_block([engine.draft.arch], config.page_size, engine.dtype)
        share = engine.allocator.num_blocks // DEFAULT_DRAFT_POOL_DIVISOR
        num_blocks = max(need, min(share, DEFAULT_DRAFT_POOL_MAX_BYTES // per_block))
    if num_blocks < need:
        raise ConfigError(
            f"--draft-num-kv-blocks {num_blocks} cannot hold one sequence of max_model_len="
            f"{max_len} ({need} blocks of {config.page_size} tokens)"
        )
    draft_config = dataclasses.replace(
        config,
        model=config.draft_model or "",
        draft_model=None,
        speculative_method="none",
        speculative_mode="off",
        quantization=engine.draft.model.quantization,  # the draft's own weights, as they are
        draft_quantization="none",
        spec_tree_max_nodes=0,  # the served draft decodes plainly: no drafts, no trees
        num_kv_blocks=num_blocks,
        controller_warmup=False,
    )
    return LLMEngine(draft_config, target=engine.draft, progress=False, clock=engine.clock)


@dataclass(frozen=True)
class Backend:
    """One model the server generates with: its name in responses, engine loop and A/B arms."""

    name: str
    root: str  # what it was loaded from (--model / --draft-model)
    engine: AsyncEngine
    assigner: ArmAssigner

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


class ModelRouter:
    """Names -> backends. The target's names, the draft's name when served, the router name."""

    def __init__(
        self,
        target: Backend,
        target_names: tuple[str, ...],
        draft: Backend | None = None,
        routing: RoutingSettings | None = None,
    ) -> None:
        self.target = target
        self.target_names = target_names
        self.draft = draft
        self.routing = routing or RoutingSettings(serve_draft=False)
        if self.routing.router_name is not None and draft is None:
            raise ConfigError("a router model name needs the draft model served")
        self.router_name = self.routing.router_name

    @property
    def names(self) -> list[str]:
        """Every name a request may use, as /v1/models lists them."""
        names = list(self.target_names)
        if self.draft is not None:
            names.append(self.draft.name)
        if self.router_name is not None:
            names.append(self.router_name)
        return names

    @property
    def backends(self) -> list[Backend]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def resolve(self, name: str | None) -> str:
        """The requested name (None: the target's); 404 for a name this server does not serve."""
        if name is None:
            return self.target.name
        if name in self.names:
            return name
        raise APIError(
            404,
            f"the model {name!r} does not exist on this server (it serves: "
            f"{', '.join(self.names)})",
            param="model",
            code="model_not_found",
        )

    def route(
        self,
        requested: str,
        num_prompt_tokens: int,
        max_tokens: int | None,
        body_mode: str | None,
        header_mode: str | None,
    ) -> Backend:
        """The backend for a request that named ``requested`` (already resolved); ``max_tokens``
        is the one the request set (None when it did not)."""
        if self.draft is not None and requested == self.draft.name:
            return self.draft
        if requested != self.router_name or self.draft is None:
            return self.target
        r = self.routing
        wants_on = (body_mode or (header_mode or "").strip().lower()) == "on"
        short = max_tokens is not None and max_tokens <= r.route_max_tokens
        if short and num_prompt_tokens <= r.route_max_prompt_tokens and not wants_on:
            return self.draft
        return self.target


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model routing")
    group.add_argument(
        "--serve-draft",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve the draft model as a model of its own, plain decode on its weights "
        "already loaded (default: %(default)s; only with a draft model)",
    )
    group.add_argument(
        "--draft-served-model-name",
        default=None,
        help="the draft's name in `model` (default: the basename of --draft-model, with "
        f"'{DRAFT_NAME_SUFFIX}' appended when a target name has it)",
    )
    group.add_argument(
        "--draft-num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks of the served draft's own pool (default: the main pool's block count "
        f"/ {DEFAULT_DRAFT_POOL_DIVISOR}, at most 0.25 GiB, at least one max_model_len sequence)",
    )
    group.add_argument(
        "--router-model-name",
        default=None,
        help="a model name (e.g. auto) whose requests go to the draft when short, else to the "
        "target (default: none)",
    )
    group.add_argument(
        "--route-max-tokens",
        type=int,
        default=DEFAULT_ROUTE_MAX_TOKENS,
        help="router: a request goes to the draft only if it sets max_tokens to at most this "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--route-max-prompt-tokens",
        type=int,
        default=DEFAULT_ROUTE_MAX_PROMPT_TOKENS,
        help="router: ... and its prompt has at most this many tokens (default: %(default)s)",
    )


def routing_from_args(
    args: argparse.Namespace, config: EngineConfig, settings: ServerSettings
) -> RoutingSettings:
    routing = RoutingSettings(
        serve_draft=args.serve_draft,
        draft_served_name=args.draft_served_model_name,
        draft_num_kv_blocks=args.draft_num_kv_blocks,
        router_name=args.router_model_name,
        route_max_tokens=args.route_max_tokens,
        route_max_prompt_tokens=args.route_max_prompt_tokens,
    )
    return resolve_routing(routing, config, settings)
