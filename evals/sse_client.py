"""One streamed OpenAI-API request, timed as the client sees it.

Sends a chat or text completion with ``stream: true`` (and ``stream_options.include_usage`` so the
server reports exact token counts), reads the server-sent events and records when each chunk that
carries output text arrives. The server's ``X-Specdec-Arm`` header and ``usage.speculative``
counters are kept when present.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from specdec.evals.datasets import Prompt
from specdec.evals.metrics import RequestRecord

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ARM_HEADER = "x-specdec-arm"


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run shares."""

    model: str
    endpoint: str = "chat"  # "chat" | "completions"
    max_tokens: int = 128
    temperature: float = 0.0
    speculative: str | None = None  # the per-request switch: "auto" | "on" | "off" | None
    ignore_eos: bool = False


def request_body(spec: RequestSpec, prompt: Prompt, seed: int | None) -> dict:
    body: dict = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.endpoint == "chat":
        body["messages"] = prompt.chat_messages()
    else:
        body["prompt"] = prompt.plain_text()
    if spec.speculative is not None:
        body["speculative"] = spec.speculative
    if seed is not None and spec.temperature > 0:
        body["seed"] = seed  # same seeds in both arms of an A/B run
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Lines of an SSE stream, split only at CR, LF and CRLF as the SSE format defines.

    httpx's ``aiter_lines`` splits like ``str.splitlines``, also at U+2028, U+2029, U+0085 and
    other separators a JSON string may hold raw, which would cut an event in two.
    """
    pending = ""
    async for text in response.aiter_text():
        pending += text
        # A CR at the very end may be the first half of a CRLF: keep it for the next chunk.
        cut = len(pending) - 1 if pending.endswith("\r") else len(pending)
        parts = _SSE_LINE_END.split(pending[:cut])
        pending = parts.pop() + pending[cut:]
        for line in parts:
            yield line
    if pending:
        for line in _SSE_LINE_END.split(pending):
            if line:
                yield line


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace")[:300]
    return f"HTTP {status}: {message}"


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(
    client: httpx.AsyncClient, spec: RequestSpec, prompt: Prompt, seed: int | None = None
) -> RequestRecord:
    """Send one streamed request; never raises for HTTP or stream errors (they go in .error)."""
    record = RequestRecord(send_time=time.perf_counter())
    num_text_chunks = 0
    try:
        async with client.stream(
            "POST", ENDPOINTS[spec.endpoint], json=request_body(spec, prompt, seed)
        ) as response:
            record.arm = response.headers.get(ARM_HEADER)
            if response.status_code != 200:
                record.error = _error_text(response.status_code, await response.aread())
                record.end_time = time.perf_counter()
                return record
            async for line in sse_lines(response):
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    break
                if _chunk_text(chunk, spec.endpoint):
                    num_text_chunks += 1
                    record.chunk_times.append(now)
                    if record.first_token_time is None:
                        record.first_token_time = now
                usage = chunk.get("usage")
                if usage:
                    record.output_tokens = int(usage.get("completion_tokens", 0))
                    record.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    record.speculative = usage.get("speculative")
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_time = time.perf_counter()
    if record.output_tokens == 0:
        # No usage chunk: fall back to counting chunks (a lower bound when chunks hold >1 token).
        record.output_tokens = num_text_chunks
    return record
