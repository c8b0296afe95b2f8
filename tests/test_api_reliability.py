"""Hostile input against a real server: text that is not valid Unicode, raw line separators in
the output, out-of-range sampling parameters, forged control tokens, a schema that matches the
validator, slow clients. Every refusal is an OpenAI error body, counted in the metrics, on a
connection that stays open.
"""

from __future__ import annotations

import re

import httpx
import pytest
from helpers_server import (
    ServerProcess,
    build_script_model,
    metric_value,
    run_uvicorn,
    start_servers,
)

from api.middleware import UnhandledErrorMiddleware

MODEL = "script"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
REJECTED = "specdec:request_rejected_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_reliability")
    build_script_model(root / MODEL)
    srv = ServerProcess(root / MODEL, None, [], root / "server.log")
    start_servers(srv)
    yield srv
    srv.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def local_address(response: httpx.Response) -> tuple:
    """The client side (host, port) of the connection that carried ``response``."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


def post_raw(client: httpx.Client, path: str, raw_json: str) -> httpx.Response:
    """Send JSON text as is: ``\\ud800`` escapes stay escapes, as a client may write them."""
    return client.post(
        path, content=raw_json.encode(), headers={"content-type": "application/json"}
    )


# ---- 1. text that is not valid Unicode ---------------------------------------------------------

SURROGATE_BODIES = [
    (TEXT, '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (TEXT, '{"prompt": ["a\\udfffb"], "max_tokens": 2}', "prompt"),
    (TEXT, '{"prompt": "\\ud800", "max_tokens": 2, "stream": true}', "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "x\\ud800y"}], "max_tokens": 2}',
     "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": "x\\ud800y"}], "max_tokens": 2, '
     '"stream": true}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "param"), SURROGATE_BODIES)
def test_lone_surrogates_get_400_and_keep_the_connection(server, path, raw, param):
    before = metric_value(server.metrics(), REJECTED, status="400")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        error = assert_openai_error(post_raw(client, path, raw), 400)
        assert error["param"] == param
        assert "surrogate" in error["message"]
        first = local_address(r := post_raw(client, path, raw))
        assert r.status_code == 400
        # The same keep-alive connection serves the next request.
        r = client.post(TEXT, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert local_address(r) == first
    assert metric_value(server.metrics(), REJECTED, status="400") == before + 2
    server.wait_idle()


def test_unknown_routes_are_counted(server, http):
    before = server.metrics()
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get(CHAT), 405)
    after = server.metrics()
    for status in ("404", "405"):
        assert metric_value(after, REJECTED, status=status) == (
            metric_value(before, REJECTED, status=status) + 1
        )


def test_unexpected_exception_is_a_counted_500_that_keeps_the_connection():
    counted: list[int] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/boom":
            raise RuntimeError("bug")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = UnhandledErrorMiddleware(app, on_error=counted.append)
    with run_uvicorn(middleware) as url, httpx.Client(base_url=url, timeout=10) as client:
        r = client.get("/boom")
        error = assert_openai_error(r, 500)
        assert error["type"] == "internal_error"
        again = client.get("/ok")
        assert again.status_code == 200 and again.text == "ok"
        assert local_address(again) == local_address(r)
    assert counted == [500]


# ---- 4, 8. sampling parameter ranges; error messages -------------------------------------------

OUT_OF_RANGE = [
    ("repetition_penalty", 1e-38),
    ("repetition_penalty", 2.5),
    ("temperature", 2.5),
    ("top_k", 2**70),
    ("seed", 2**64),
    ("top_p", 0),
    ("min_p", -0.5),
    ("frequency_penalty", -3),
    ("max_tokens", 0),
    ("max_completion_tokens", 0),
    ("stop", ["", "x"]),
    ("stop", [str(i) for i in range(20)]),
    ("stop_token_ids", [-4]),
    ("stop_token_ids", [2**80]),
]


@pytest.mark.parametrize(("name", "value"), OUT_OF_RANGE)
def test_out_of_range_parameters_get_400(server, http, name, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, name: value}
    error = assert_openai_error(http.post(CHAT, json=body), 400)
    param = "max_tokens" if name == "max_completion_tokens" else name
    assert error["param"] == param
    message = error["message"]
    # No doubled word ("stop stop strings must be ...").
    assert not re.search(r"\b([a-z_]+)\s+\1\b", message), message
    if name != "max_completion_tokens":
        assert message.count(name) == 1, message


def test_accepted_extremes_generate(server, http):
    for extreme in ({"repetition_penalty": 0.01}, {"repetition_penalty": 2, "temperature": 2}):
        body = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "seed": 3, **extreme}
        r = http.post(TEXT, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    server.wait_idle()
