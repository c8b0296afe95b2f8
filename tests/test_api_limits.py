"""Admission control and liveness of a real server: 429 beyond the queue limit, disconnects and
timeouts abort and free blocks, /health follows the engine loop (503 once it dies).

Two servers start in parallel: ``slow`` sleeps 25 ms per engine step (SPECDEC_STEP_DELAY_S) so a
request can be caught mid-generation, with one batch slot, a queue of one and a 2.5 s request
timeout; ``doomed`` has its engine loop raise after 6 steps (SPECDEC_FAIL_AFTER_STEPS).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers_server import (
    ServerProcess,
    build_script_model,
    metric_value,
    sse_events,
    start_servers,
)

MODEL = "script"
MESSAGES = [{"role": "user", "content": "Say hi."}]
# Plain decode: one token per step, so 200 tokens take 200 steps (5 s at 25 ms a step).
LONG = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "speculative": "off"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_limits")
    build_script_model(root / MODEL)
    slow = ServerProcess(
        root / MODEL,
        root / MODEL,
        ["--max-num-seqs", "1", "--max-queue-len", "1", "--request-timeout", "2.5"],
        root / "slow.log",
        env={"SPECDEC_STEP_DELAY_S": "0.025"},
    )
    doomed = ServerProcess(
        root / MODEL, root / MODEL, [], root / "doomed.log", env={"SPECDEC_FAIL_AFTER_STEPS": "6"}
    )
    start_servers(slow, doomed)
    yield slow, doomed
    slow.stop()
    doomed.stop()


@pytest.fixture(scope="module")
def slow(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def doomed(servers) -> ServerProcess:
    return servers[1]


def read_data_lines(lines: Iterator[str], n: int) -> list[str]:
    """Read ``n`` data lines from a live stream. The caller keeps ``lines`` referenced: a
    discarded line iterator closes the connection (which is a disconnect)."""
    data = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line)
            if len(data) == n:
                break
    return data


def test_queue_limit_gives_429_with_retry_after(slow):
    url = f"{slow.url}/v1/chat/completions"
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json={**LONG, "stream": True}) as running,
    ):
        running_lines = running.iter_lines()
        read_data_lines(running_lines, 2)  # role chunk + first token: it is in the batch
        with http.stream("POST", url, json={**LONG, "stream": True}) as waiting:
            assert waiting.status_code == 200
            _, health = slow.health()
            assert health["num_requests_running"] == 1 and health["num_requests_waiting"] == 1

            refused = http.post(url, json=LONG)
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            error = refused.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"

            client = openai.OpenAI(base_url=f"{slow.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
            # The refusals left the engine as it was.
            _, after = slow.health()
            assert after["num_requests_waiting"] == 1
    slow.wait_idle()
    assert metric_value(slow.metrics(), "specdec:request_rejected_total", status="429") == 2


def test_disconnect_mid_stream_aborts_and_frees_blocks(slow):
    before = metric_value(slow.metrics(), "specdec:request_success_total", finished_reason="abort")
    url = f"{slow.url}/v1/chat/completions"
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        read_data_lines(lines, 4)
        _, health = slow.health()
        assert health["num_requests_running"] == 1
        assert health["num_free_blocks"] < health["num_blocks"]
    # Leaving the block closed the connection half-way through the stream.
    slow.wait_idle(timeout=2.0)  # far less than the 5 s the request would have run
    after = metric_value(slow.metrics(), "specdec:request_success_total", finished_reason="abort")
    assert after == before + 1


def test_disconnect_while_waiting_for_a_non_streamed_answer(slow):
    name = "specdec:request_success_total"
    before = slow.metrics()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{slow.url}/v1/chat/completions", json=LONG, timeout=0.4)
    slow.wait_idle(timeout=2.0)
    after = slow.metrics()

    def delta(reason: str) -> float:
        return metric_value(after, name, finished_reason=reason) - metric_value(
            before, name, finished_reason=reason
        )

    # Aborted for the disconnect, not ended by the 2.5 s request timeout.
    assert delta("abort") == 1 and delta("timeout") == 0


def test_request_timeout_aborts(slow):
    url = f"{slow.url}/v1/chat/completions"
    r = httpx.post(url, json=LONG, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_timeout"
    slow.wait_idle()

    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    assert any(e["choices"][0]["delta"].get("content") for e in events[:-2])
    slow.wait_idle()


def test_health_follows_the_engine_loop(doomed):
    status, health = doomed.health()
    assert status == 200 and health["ready"] is True

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "speculative": "off"}
    url = f"{doomed.url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    # A few tokens, then the loop raised: the open stream is told, not left hanging.
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_unavailable"
    assert "injected fault" in events[-2]["error"]["message"]

    status, health = doomed.health()
    assert status == 503 and health["ready"] is False
    assert "injected fault" in health["reason"]
    assert health["error"]["type"] == "service_unavailable"

    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert metric_value(doomed.metrics(), "specdec:engine_loop_alive") == 0
    assert doomed.proc.poll() is None  # the process lives on; only the engine is gone
