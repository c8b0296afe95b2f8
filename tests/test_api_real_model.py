"""Smoke test of `specdec serve` on the real default pair (skipped unless it is in the cache)."""

from __future__ import annotations

import openai
import pytest
from helpers_server import ServerProcess, start_servers
from specdec.engine.weights import COMPLETE_MARKER, specdec_home

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for name in (TARGET, DRAFT):
        if not (specdec_home() / "models" / name / COMPLETE_MARKER).exists():
            pytest.skip(f"{name} is not in the cache: run `specdec pull`")
    engine_args = ["--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory", "0.25"]
    engine_args += ["--speculative-mode", "on", "--no-controller-warmup"]
    log = tmp_path_factory.mktemp("api_real") / "server.log"
    srv = ServerProcess(TARGET, DRAFT, [], log, engine_args=engine_args)
    # Loading 8 GB of fp32 weights takes ~1.5 min alone on two cores, longer beside other tests.
    start_servers(srv, timeout=420.0)
    yield srv
    srv.stop()


def test_chat_completion_with_speculation(server):
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    raw = client.chat.completions.with_raw_response.create(
        model=TARGET,
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=16,
        temperature=0,
    )
    assert raw.headers["x-specdec-arm"] == "spec"
    resp = raw.parse()
    text = resp.choices[0].message.content
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"
    assert "def" in text or "python" in text.lower(), text
    spec = resp.usage.model_extra["speculative"]
    assert spec["mode"] == "on" and spec["draft_tokens"] > 0
    assert spec["accepted_tokens"] > 0 and spec["acceptance_rate"] > 0
