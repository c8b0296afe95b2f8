"""The engine as the API layer sees it, backed by a Ray Serve deployment of replicas.

``create_app`` and ``OpenAIServing`` talk to an ``AsyncEngine``; ``RemoteEngine`` offers the same
surface (add_request -> stream of ``RequestOutput``s, abort, is_alive, snapshot, and the few
engine attributes the API reads), so the ingress runs the single server's request path
unchanged: the same validation, tokenization, A/B assignment, errors and SSE streaming.

Errors map onto the engine's own: an error object a replica yields is raised as is; Serve's
back-pressure (more requests waiting in the handle than ``max_queued_requests``) becomes
``QueueFullError`` (429); a replica that dies under a request, or no replica at all, becomes
``EngineDeadError`` (503), mid-stream included, so the client gets an error event and
``[DONE]`` rather than a hang.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from specdec.api.cluster.replica import Accepted, EngineRequest, ReplicaInfo
from specdec.engine.async_engine import (
    EngineDeadError,
    EngineSnapshot,
    OutputStream,
    QueueFullError,
)
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.outputs import RequestOutput
from specdec.engine.sampling_params import SamplingParams

# Set by the ingress around each HTTP request: add_request records which replica took it, and
# the ingress answers with that replica's id in a header.
REPLICA_SLOT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "specdec_replica_slot", default=None
)


class _Allocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks


class RemoteCore:
    """The attributes of ``LLMEngine`` that the API layer reads, filled from a replica."""

    check_lengths = LLMEngine.check_lengths  # the same length rules, on max_model_len below

    def __init__(self, config: EngineConfig, info: ReplicaInfo) -> None:
        self.config = config
        self.max_model_len = info.max_model_len
        self.tokenizer = info.tokenizer
        self.allocator = _Allocator(info.num_blocks)
        # The API only asks whether a proposer and a speculation policy exist.
        self.proposer: object | None = "remote" if info.has_proposer else None
        self.policy: object | None = "remote" if info.has_policy else None


def _dead(message: str) -> EngineDeadError:
    return EngineDeadError(message)


class RemoteStream(OutputStream):
    """A request's outputs from its replica; the interface of ``async_engine.RequestStream``."""

    def __init__(
        self,
        request_id: str,
        gen: DeploymentResponseGenerator,
        replica: str,
        on_done: Callable[[str], None],
    ) -> None:
        self.request_id = request_id
        self.replica = replica
        self._gen = gen
        self._on_done = on_done
        self.finished = False

    def _finish(self) -> None:
        self.finished = True
        self._on_done(self.request_id)

    async def get(self) -> RequestOutput:
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._finish()
            raise _dead(f"replica {self.replica} ended the stream early") from None
        except RayError as exc:
            self._finish()
            raise _dead(f"replica {self.replica} failed: {type(exc).__name__}") from exc
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def cancel(self) -> None:
        self._gen.cancel()


class RemoteEngine:
    """``AsyncEngine``'s surface over a deployment handle.

    ``stats``: returns the latest report of each live replica (from the request router), the
    source of ``is_alive`` and ``snapshot``.
    """

    def __init__(
        self,
        handle: DeploymentHandle,
        config: EngineConfig,
        info: ReplicaInfo,
        stats: Callable[[], dict[str, dict[str, Any]]],
    ) -> None:
        self.handle = handle.options(stream=True)
        self.engine = RemoteCore(config, info)
        self.stats = stats
        self._open: dict[str, RemoteStream | DeploymentResponseGenerator] = {}

    # ---- life cycle: the replicas' engines run on their own; the ingress only watches ---------
    def start(self) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        for request_id in list(self._open):
            self.abort(request_id)

    @property
    def is_alive(self) -> bool:
        """True while at least one replica's engine loop runs (a replica Serve lists as running
        that has not reported yet counts as alive)."""
        return any(s.get("alive", True) for s in self.stats().values())

    @property
    def error(self) -> str | None:
        reports = self.stats()
        if not reports:
            return "no engine replica is running"
        if self.is_alive:
            return None
        errors = {s.get("error") for s in reports.values()} - {None}
        return "; ".join(sorted(errors)) or "no engine replica is running"

    @property
    def snapshot(self) -> EngineSnapshot:
        return aggregate_snapshot(list(self.stats().values()))

    @property
    def num_open(self) -> int:
        return len(self._open)

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        speculative: str | None = None,
        arrival_time: float | None = None,
    ) -> RemoteStream:
        """Send the request to a replica chosen by the router; returns once a replica's engine
        accepted it, raising the engine's error otherwise (as ``AsyncEngine.add_request``)."""
        if isinstance(prompt, str):
            raise TypeError("the ingress sends token ids; tokenize before add_request")
        request = EngineRequest(request_id, list(prompt), params, speculative)
        gen = self.handle.generate.remote(request)
        self._open[request_id] = gen
        try:
            first = await gen.__anext__()
        except BackPressureError:
            self._open.pop(request_id, None)
            raise QueueFullError(
                "every replica is busy and the ingress queue is full; retry later"
            ) from None
        except RayError as exc:
            self._open.pop(request_id, None)
            raise _dead(f"the request could not reach a replica: {type(exc).__name__}") from exc
        except BaseException:
            self._open.pop(request_id, None)
            gen.cancel()
            raise
        if isinstance(first, BaseException):
            self._open.pop(request_id, None)
            raise first
        assert isinstance(first, Accepted), f"unexpected first item {type(first).__name__}"
        slot = REPLICA_SLOT.get()
        if slot is not None:
            slot["replica"] = first.replica
        stream = RemoteStream(request_id, gen, first.replica, self._forget)
        self._open[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel the request's stream; its replica aborts it in the engine."""
        opened = self._open.pop(request_id, None)
        if opened is not None:
            opened.cancel()

    def _forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)


def aggregate_snapshot(reports: list[dict[str, Any]]) -> EngineSnapshot:
    """One snapshot for the whole deployment: counts summed, rates averaged over replicas."""
    snaps = [r["snapshot"] for r in reports if "snapshot" in r]
    if not snaps:
        return EngineSnapshot(loop_time=time.monotonic())
    n = len(snaps)
    blocks = sum(s["num_blocks"] for s in snaps)
    free = sum(s["num_free_blocks"] for s in snaps)

    def mean(key: str) -> float:
        return sum(float(s[key]) for s in snaps) / n

    age = min(float(r.get("loop_age_s", 0.0)) for r in reports if "snapshot" in r)
    return EngineSnapshot(
        num_running=sum(s["num_running"] for s in snaps),
        num_waiting=sum(s["num_waiting"] for s in snaps),
        num_free_blocks=free,
        num_blocks=blocks,
        kv_usage=(blocks - free) / blocks if blocks else 0.0,
        num_steps=sum(s["num_steps"] for s in snaps),
        mean_k=mean("mean_k"),
        speculating_fraction=mean("speculating_fraction"),
        acceptance_rate=mean("acceptance_rate"),
        mean_accepted_length=mean("mean_accepted_length"),
        loop_time=time.monotonic() - age,
    )
