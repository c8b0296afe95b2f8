"""OpenAI-style error bodies for every failure, including the ones FastAPI would answer itself.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status:
request validation (FastAPI's 422 becomes a 400 naming the parameter), engine errors (their own
status), unknown routes and methods. Unexpected exceptions (500) are answered by
api.middleware.UnhandledErrorMiddleware.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from specdec.api.json_text import JSONText
from specdec.engine.async_engine import QueueFullError
from specdec.engine.errors import SpecdecError
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error answered as OpenAI does: status, message, type, param, code, extra headers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_engine(cls, exc: SpecdecError) -> APIError:
        """Map an engine error (raised before any state change) onto its HTTP answer."""
        headers = {}
        code = None
        if isinstance(exc, QueueFullError):
            headers["Retry-After"] = str(exc.retry_after_s)
            code = "queue_full"
        elif exc.status_code == 503:
            code = "engine_unavailable"
        return cls(exc.status_code, exc.message, exc.error_type, exc.param, code, headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONText:
        return JSONText(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Location parts pydantic adds for union members and wrappers ("str", "list[str]", ...): not
# parameter names, so they are left out of the reported param.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|literal|function-.*|.*[\[\]'\-].*)$")


def _param_from_loc(loc: Sequence[Any]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        text = str(item)
        if _TYPE_TAG.match(text) or text[:1].isupper():
            break
        parts.append(("." if parts else "") + text)
    return "".join(parts) or None


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """One 400 naming the first offending parameter, in words a client can act on."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    param = _param_from_loc(first.get("loc", ()))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    if param is None:
        return APIError(400, "the request body must be a JSON object matching the schema")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param)
    same = [e for e in errors if _param_from_loc(e.get("loc", ())) == param]
    reasons = "; ".join(dict.fromkeys(str(e.get("msg", "invalid")) for e in same[:3]))
    return APIError(400, f"invalid value for {param}: {reasons}", param=param)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Answer every error OpenAI-style; ``on_error(status)`` is told of each refused request."""

    def answer(exc: APIError) -> JSONText:
        if on_error is not None:
            on_error(exc.status_code)
        return exc.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONText:
        return answer(exc)

    @app.exception_handler(SpecdecError)
    async def _engine_error(request: Request, exc: SpecdecError) -> JSONText:
        return answer(APIError.from_engine(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONText:
        return answer(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONText:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        if on_error is not None:
            on_error(exc.status_code)
        return JSONText(
            error_body(message, kind),
            status_code=exc.status_code,
            headers=dict(exc.headers or {}),
        )

    # Unexpected exceptions are answered by api.middleware.UnhandledErrorMiddleware, which
    # (unlike an exception handler for Exception) keeps the connection open.


def openapi_error_schema() -> dict[str, Any]:
    """JSON schema of the error body, for the OpenAPI document."""
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
