"""The one JSON encoder of every body the server writes (responses, errors, stream events).

JSON allows U+2028 LINE SEPARATOR, U+2029 PARAGRAPH SEPARATOR and U+0085 NEXT LINE raw inside
strings, and SSE splits lines only at CR and LF, but clients that split lines like Python's
``str.splitlines`` (httpx ``iter_lines``, JavaScript before ES2019's JSON superset) cut an event
in two at them. They are written as ``\\u2028``-style escapes instead: the same JSON value, and
the only place these characters can occur in encoder output is inside a string.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def dumps(payload: Any) -> str:
    """Compact JSON with line-breaking characters escaped (json escapes the C0 controls)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


class JSONText(JSONResponse):
    """A JSON response encoded by ``dumps``."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
