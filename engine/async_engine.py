"""AsyncEngine: the LLMEngine loop in its own thread, bridged to asyncio request handlers.

Invariant 9: the API never blocks the engine and the engine never blocks the API. Handlers put
commands (add, abort) into a thread-safe inbox and return to the event loop; the loop thread drains
the inbox between steps, steps the engine, and hands each step's outputs back to the event loop in
one ``call_soon_threadsafe`` call, which appends them to per-request ``asyncio.Queue``s. Text is
already detokenized incrementally by the engine's output state, off the model forward.

Requests are validated by ``LLMEngine.add_request`` on the loop thread (the engine is not
thread-safe); the handler awaits that verdict, so a rejected request gets its error before any
response header is sent and leaves no engine state behind (invariant 10).

When the loop dies (an exception inside a step), every open request gets ``EngineDeadError``, new
requests are refused with it, and ``is_alive`` turns False so ``/health`` reports 503.

Test hooks, read from the environment by ``loop_hooks_from_env`` when a server starts (unset, they
cost one comparison per step):
- ``SPECDEC_FAIL_AFTER_STEPS=N`` makes the loop raise once the engine has run N steps: how the
  server tests kill the loop of a real server process;
- ``SPECDEC_STEP_DELAY_S=T`` sleeps T seconds after every step, so tests can catch a request
  mid-generation (disconnects, timeouts, queue limits) on a tiny model that is otherwise too fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from specdec.engine.errors import SpecdecError
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.outputs import RequestOutput
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import SpecStats

logger = logging.getLogger(__name__)

FAIL_AFTER_STEPS_ENV = "SPECDEC_FAIL_AFTER_STEPS"
STEP_DELAY_ENV = "SPECDEC_STEP_DELAY_S"


class EngineDeadError(SpecdecError):
    """The engine loop is not running (it died, or the server is shutting down)."""

    status_code = 503
    error_type = "service_unavailable"


class QueueFullError(SpecdecError):
    """More requests are waiting than ``max_queue_len`` allows; the client should retry later."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InjectedFault(RuntimeError):
    """Raised inside the loop by the ``SPECDEC_FAIL_AFTER_STEPS`` test hook."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state published by the loop thread after every iteration (read by /health and
    /metrics without touching the engine from the event loop)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0
    mean_k: float = 0.0
    speculating_fraction: float = 0.0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    # The adaptive policy's inputs: its step-cost terms (the machine's pace, the predicted time
    # and goodput of its last decision) and its engine-wide acceptance estimate per draft
    # position; empty for other policies.
    controller_costs: tuple[tuple[str, float], ...] = ()
    acceptance_estimate: tuple[float, ...] = ()
    loop_time: float = 0.0  # time.monotonic() of the iteration that published this


class OutputStream:
    """Async iteration over a request's outputs: ``get()`` until the finished one."""

    finished: bool

    async def get(self) -> RequestOutput:
        raise NotImplementedError

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.get()


class RequestStream(OutputStream):
    """The outputs of one request, in order, as the engine produces them.

    Iterating yields ``RequestOutput``s until the finished one; an engine failure is raised from
    the iteration as ``EngineDeadError``.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side: enqueue one output or error (called via call_soon_threadsafe)."""
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    speculative: str | None
    arrival_time: float | None
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str


@dataclass(frozen=True)
class LoopHooks:
    """Test-only fault injection and slow-down of the loop (see the module docstring)."""

    fail_after_steps: int | None = None
    step_delay_s: float = 0.0

    @property
    def active(self) -> bool:
        return self.fail_after_steps is not None or self.step_delay_s > 0


def loop_hooks_from_env() -> LoopHooks:
    fail = os.environ.get(FAIL_AFTER_STEPS_ENV, "").strip()
    delay = os.environ.get(STEP_DELAY_ENV, "").strip()
    return LoopHooks(int(fail) if fail else None, float(delay) if delay else 0.0)


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():  # the handler gave up waiting (client gone or timed out)
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _copy_stats(stats: SpecStats) -> SpecStats:
    # The engine keeps mutating the sequence's SpecStats; the event loop gets a frozen copy.
    return dataclasses.replace(
        stats,
        accepted_per_pos=list(stats.accepted_per_pos),
        drafted_per_pos=list(stats.drafted_per_pos),
        judged_per_pos=list(stats.judged_per_pos),
        accepted_per_rank=list(stats.accepted_per_rank),
    )


class AsyncEngine:
    """Runs ``engine`` on a dedicated thread; coroutine-friendly add/abort/stream."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queue_len: int | None = None,
        hooks: LoopHooks | None = None,
        idle_poll_s: float = 0.1,
    ) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.hooks = hooks or LoopHooks()
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # Guards the dead flag together with the inbox, so no command slips in after the final
        # drain of a dying loop (it would wait forever for a verdict).
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._snapshot = EngineSnapshot()

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="specdec-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop; open requests get EngineDeadError."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """True while the loop thread runs and has not failed (the /health condition)."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._error is None
            and not self._stop.is_set()
        )

    @property
    def error(self) -> str | None:
        """Why the loop died, if it did."""
        return self._error

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ---- requests (event-loop side) ---------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        speculative: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Submit a request and wait until the loop has accepted or rejected it.

        Raises the engine's SpecdecError (400/404), QueueFullError (429) or EngineDeadError (503);
        a rejected request changes nothing in the engine.
        """
        stream = RequestStream(request_id, asyncio.get_running_loop())
        prompt_value = prompt if isinstance(prompt, str) else list(prompt)
        self._submit(_Add(request_id, prompt_value, params, speculative, arrival_time, stream))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so the loop undoes it in order
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking); its blocks return to the pool."""
        with self._lock:
            if self._error is None and not self._stop.is_set():
                self._inbox.put(_Abort(request_id))

    def _submit(self, command: _Add) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine loop has stopped: {self._error}")
            if self._thread is None or self._stop.is_set():
                raise EngineDeadError("the engine loop is not running")
            self._inbox.put(command)

    # ---- the loop (engine thread) -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._publish_snapshot()  # idle: keep the liveness timestamp fresh
                if self.hooks.step_delay_s > 0:
                    time.sleep(self.hooks.step_delay_s)
            self._shut_down(EngineDeadError("the server is shutting down"))
        except BaseException as exc:
            logger.exception("engine loop died")
            self._shut_down(EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}"))

    def _step(self) -> None:
        fail_after = self.hooks.fail_after_steps
        if fail_after is not None and self.engine.num_steps >= fail_after:
            raise InjectedFault(
                f"injected fault after {self.engine.num_steps} steps ({FAIL_AFTER_STEPS_ENV})"
            )
        steps_before = self.engine.num_steps
        outputs = self.engine.step()
        self._publish_snapshot()  # before delivery: a client never sees a stale /health
        self._deliver(outputs)
        if not outputs and self.engine.num_steps == steps_before:
            time.sleep(0.001)  # nothing could be scheduled this time; do not spin on the CPU

    def _drain_inbox(self, block: bool) -> None:
        commands: list[_Add | _Abort] = []
        try:
            if block:
                commands.append(self._inbox.get(timeout=self.idle_poll_s))
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        if not commands:
            return
        verdicts: list[tuple[RequestStream, BaseException | None]] = []
        for command in commands:
            if isinstance(command, _Add):
                verdicts.append((command.stream, self._handle_add(command)))
            else:
                self.engine.abort(command.request_id)
                self._streams.pop(command.request_id, None)
        # Publish first, so a client that hears "accepted" and asks /health sees its request.
        self._publish_snapshot()
        for stream, error in verdicts:
            self._call_soon(stream.loop, _resolve, stream.accepted, error)

    def _handle_add(self, cmd: _Add) -> BaseException | None:
        """Admit one request into the engine; returns the error that refuses it, if any."""
        if self.max_queue_len is not None and self._queue_depth(extra=1) > self.max_queue_len:
            return QueueFullError(
                f"the server queue is full ({self.max_queue_len} requests waiting); retry later",
            )
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, cmd.speculative, cmd.arrival_time
            )
        except SpecdecError as exc:
            return exc
        self._streams[cmd.request_id] = cmd.stream
        return None

    def _queue_depth(self, extra: int = 0) -> int:
        """Requests that could not start now (waiting beyond the free batch slots), counting
        ``extra`` more waiting ones."""
        scheduler = self.engine.scheduler
        free_slots = max(0, scheduler.max_num_seqs - len(scheduler.running))
        return max(0, len(scheduler.waiting) + extra - free_slots)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = (
                self._streams.pop(out.request_id, None)
                if out.finished
                else self._streams.get(out.request_id)
            )
            if stream is None:  # aborted meanwhile
                continue
            out = dataclasses.replace(out, spec_stats=_copy_stats(out.spec_stats))
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            self._call_soon(loop, _put_all, items)

    def _publish_snapshot(self) -> None:
        engine = self.engine
        controller = engine.policy.stats() if engine.policy is not None else {}
        self._snapshot = EngineSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_free_blocks=engine.allocator.num_free_blocks,
            num_blocks=engine.allocator.num_blocks,
            kv_usage=engine.allocator.usage,
            num_steps=engine.num_steps,
            mean_k=float(controller.get("mean_k", 0.0)),
            speculating_fraction=float(controller.get("speculating_fraction", 0.0)),
            acceptance_rate=engine.spec_stats.acceptance_rate,
            mean_accepted_length=engine.spec_stats.mean_accepted_length,
            controller_costs=tuple(
                (name.removeprefix("cost_"), float(value))
                for name, value in controller.items()
                if name.startswith("cost_")
            ),
            acceptance_estimate=tuple(float(a) for a in controller.get("acceptance_prior", ())),
            loop_time=time.monotonic(),
        )

    def _shut_down(self, error: EngineDeadError) -> None:
        with self._lock:
            self._error = self._error or (None if self._stop.is_set() else error.message)
            pending: list[_Add | _Abort] = []
            try:
                while True:
                    pending.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
        for command in pending:
            if isinstance(command, _Add):
                self._call_soon(command.stream.loop, _resolve, command.stream.accepted, error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._call_soon(stream.loop, stream.put, error)
        with contextlib.suppress(Exception):  # the engine may be in any state after a failure
            self._publish_snapshot()

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)
