"""ASGI middleware that refuses request bodies over a size limit with a 413 before parsing."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


class BodySizeLimitMiddleware:
    """Reads the body up front (at most ``max_bytes``) and replays it to the app.

    A declared ``Content-Length`` over the limit is refused without reading; a chunked body is
    refused as soon as it grows past the limit. Reading first also means a handler never starts
    work on a body that turns out too large.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_reject: Callable[[int], None] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

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
            message = await receive()
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


async def _reply(send: Send, status: int, message: str, code: str | None = None) -> None:
    payload = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})
