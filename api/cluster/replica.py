"""One engine replica: an ``AsyncEngine`` inside a Ray Serve deployment.

The ingress sends ``EngineRequest``s (prompt already tokenized and checked) to ``generate``, a
streaming method. Its first item says whether the engine took the request: ``Accepted`` (then
the ``RequestOutput``s follow, until the finished one) or the engine's own error object (a
``QueueFullError`` for 429, ``EngineDeadError`` for 503, ...), which the ingress raises again, so
errors leave the cluster with the same status and body as from a single server. An engine
failure mid-stream is yielded as the last item the same way. When the ingress drops a stream
(client gone, timeout), Serve cancels the generator here and the request is aborted, so its KV
blocks return to the pool.

``record_routing_stats`` is Serve's hook for per-replica state that routers see: the engine's
load, health, prefix-cache keys and counters, and its engine-side metrics exposition.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve
from specdec.api.cluster.metrics import ReplicaMetrics
from specdec.api.cluster.prefix import short_keys
from specdec.engine.async_engine import AsyncEngine, loop_hooks_from_env
from specdec.engine.config import EngineConfig
from specdec.engine.errors import SpecdecError
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    """What a replica needs to run one request (the router reads ``prompt_ids`` too)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: str | None = None


@dataclass(frozen=True)
class Accepted:
    """First item of a stream the engine accepted; names the replica that runs it."""

    replica: str


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to validate and tokenize requests like the engine would."""

    replica: str
    max_model_len: int
    num_blocks: int
    page_size: int
    has_proposer: bool
    has_policy: bool
    tokenizer: Any  # engine.tokenizer.Tokenizer | None (pickled with the info)


class EngineReplica:
    """The deployment class (wrapped by ``serve.deployment`` in api.cluster.deploy)."""

    def __init__(
        self, config: EngineConfig, max_queue_len: int | None, model_name: str, generation: str
    ) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.generation = generation
        hooks = loop_hooks_from_env()
        if hooks.active:
            logger.warning("test hooks active: %s", hooks)
        self.core = LLMEngine(config, progress=False)
        self.engine = AsyncEngine(self.core, max_queue_len=max_queue_len, hooks=hooks)
        self.engine.start()
        self.metrics = ReplicaMetrics(model_name)
        self._num_ongoing = 0

    def describe(self) -> ReplicaInfo:
        core = self.core
        return ReplicaInfo(
            replica=self.replica_id,
            max_model_len=core.max_model_len,
            num_blocks=core.allocator.num_blocks,
            page_size=core.config.page_size,
            has_proposer=core.proposer is not None,
            has_policy=core.policy is not None,
            tokenizer=core.tokenizer,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        self._num_ongoing += 1
        try:
            try:
                stream = await self.engine.add_request(
                    request.request_id, request.prompt_ids, request.params, request.speculative
                )
            except SpecdecError as exc:
                yield exc
                return
            yield Accepted(self.replica_id)
            finished = False
            try:
                async for out in stream:
                    # The ingress knows the prompt; do not ship it back with every output.
                    yield dataclasses.replace(out, prompt_token_ids=[])
                finished = True
            except SpecdecError as exc:  # the engine loop died under this request
                finished = True
                yield exc
            finally:
                if not finished:  # cancelled by the ingress
                    self.engine.abort(request.request_id)
        finally:
            self._num_ongoing -= 1

    def record_routing_stats(self) -> dict[str, Any]:
        snap = self.engine.snapshot
        allocator = self.core.allocator
        return {
            "report_id": time.monotonic_ns(),
            "generation": self.generation,
            "alive": self.engine.is_alive,
            "error": self.engine.error,
            "num_ongoing": self._num_ongoing,
            "snapshot": dataclasses.asdict(snap),
            "loop_age_s": max(0.0, time.monotonic() - snap.loop_time),
            "prefix_keys": short_keys(allocator.cached_block_hashes()),
            "prefix_queries": allocator.prefix_queries,
            "prefix_hits": allocator.prefix_hits,
            "metrics": self.metrics.render(snap, self.engine.is_alive, allocator),
        }

    def check_health(self) -> None:
        """Serve's liveness probe: a replica whose engine loop died is replaced."""
        if not self.engine.is_alive:
            raise RuntimeError(self.engine.error or "the engine loop is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
