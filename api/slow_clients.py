"""Time limits on clients that send a request slowly (or never finish it).

uvicorn's ``timeout_keep_alive`` only closes a connection idle between requests. Two more limits:
- headers: ``HeaderTimeoutH11Protocol`` closes a connection whose request line and headers are
  not complete ``header_timeout_s`` after the connection opened or after the first byte of a
  request arrived (with a 408 when part of a request came), a limit the ASGI app cannot set
  since it only sees whole headers;
- body: api.middleware.BodySizeLimitMiddleware answers 408 when a body chunk takes longer than
  its ``body_timeout_s`` to arrive.
"""

from __future__ import annotations

import asyncio

import h11
from specdec.api.errors import error_body
from specdec.api.json_text import dumps
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = dumps(error_body("the request headers did not arrive in time")).encode()
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY
)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a time limit on receiving a request's headers."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None and self.conn.trailing_data[0]:
                self._arm_header_timer()  # a new request started arriving
        else:
            self._cancel_header_timer()  # headers complete: the body has its own limit

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.conn.trailing_data[0]:  # a partial request: tell the client why
                self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn's ``http`` option, with ``seconds`` as its limit."""
    return type(
        "HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": seconds}
    )
