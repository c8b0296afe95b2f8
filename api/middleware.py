"""ASGI middleware: body size and time limits (413, 408 before parsing), the last-resort 500."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from specdec.api.errors import error_body
from specdec.api.json_text import dumps
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class UnhandledErrorMiddleware:
    """Answers an exception no handler took with an OpenAI-style 500, counted in the metrics.

    Starlette's own last resort sends its 500 and then re-raises, and uvicorn closes the
    connection of an exception that reaches it; answering here instead keeps a keep-alive
    connection usable. An exception after the response started (a broken stream) cannot be
    answered: it is logged, counted and re-raised so the server ends that response.
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if self.on_error is not None:
                self.on_error(500)
            if started:
                raise
            message = f"internal server error: {type(exc).__name__}"
            await _reply(send, 500, message, type="internal_error", keep_alive=True)


class BodySizeLimitMiddleware:
    """Reads the body up front (at most ``max_bytes``) and replays it to the app.

    A declared ``Content-Length`` over the limit is refused without reading; a chunked body is
    refused as soon as it grows past the limit. A body whose next chunk takes longer than
    ``timeout_s`` to arrive (a client that declares 100 bytes and sends one) gets a 408 and the
    connection is closed. Reading first also means a handler never starts work on a body that
    turns out too large or never arrives.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_reject: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _reply(send, 400, "Content-Length is not an integer")
                    return
        if declared is not None and declared > self.max_bytes:
            await self._too_large(send)
            return

        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                if self.on_reject is not None:
                    self.on_reject(408)
                await _reply(
                    send,
                    408,
                    f"the request body did not arrive within {self.timeout_s} s",
                    code="request_timeout",
                )
                return
            if message["type"] == "http.disconnect":
                return  # the client left before finishing its body: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards only http.disconnect can arrive

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject(413)
        await _reply(
            send,
            413,
            f"request body exceeds the server limit of {self.max_bytes} bytes",
            code="request_too_large",
        )


async def _reply(
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    type: str = "invalid_request_error",
    keep_alive: bool = False,
) -> None:
    """Send an error body; ``keep_alive=False`` closes the connection (its body is unread)."""
    payload = dumps(error_body(message, type, None, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if not keep_alive:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
