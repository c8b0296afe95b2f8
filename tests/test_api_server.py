"""A real `specdec serve` process on the tiny script model, driven by the openai client and httpx:
chat and text completions, streaming and not, usage, UTF-8, concurrency, disconnects, A/B arms and
metrics."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from helpers_server import (
    SCRIPT,
    ServerProcess,
    build_script_model,
    metric_value,
    script_text,
    sse_events,
    start_servers,
)
from helpers_tokenizer import build_byte_level_tokenizer
from specdec.engine.tokenizer import Tokenizer

MODEL = "script"  # the basename of the model directory
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_server")
    build_script_model(root / MODEL)
    srv = ServerProcess(root / MODEL, root / MODEL, [], root / "server.log")
    start_servers(srv)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_byte_level_tokenizer())


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def speculative_usage(usage) -> dict:
    return usage.model_extra["speculative"]


def stream_chat(client, **kwargs) -> tuple[str, list, object]:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, temperature=0, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, chunks[-1].usage


def test_models_and_health(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    # The draft (here the target's own directory) is served too, under "<basename>-draft".
    assert [m["id"] for m in models["data"]] == [MODEL, f"{MODEL}-draft"]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 200
    missing = httpx.get(f"{server.url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    status, health = server.health()
    assert status == 200 and health["ready"] is True
    assert health["num_blocks"] == 256 and health["speculation"]["method"] == "draft_model"


def test_chat_completion_text_usage_and_arm(server, client, tokenizer):
    # 'on': the draft here is the target itself, as costly as a target step, so in 'auto' the
    # controller rightly declines to speculate; this test is about the response, not that choice.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=18, temperature=0,
        extra_body={"speculative": "on"},
    )  # fmt: skip
    assert raw.headers["x-specdec-arm"] == "spec"
    resp = raw.parse()
    assert resp.choices[0].message.content == SCRIPT * 2 == script_text(18)
    assert resp.choices[0].finish_reason == "length"
    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES))
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 18
    assert resp.usage.total_tokens == prompt_tokens + 18
    spec = speculative_usage(resp.usage)
    assert spec["arm"] == "spec" and spec["mode"] == "on"
    # The draft is the target itself: every greedy draft is accepted.
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] == spec["draft_tokens"]
    assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_length"] > 1.0


@pytest.mark.parametrize("mode", ["on", "off"])
def test_streamed_text_equals_non_streamed(client, mode):
    extra = {"speculative": mode}
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=23, temperature=0, extra_body=extra
    )
    text, chunks, _ = stream_chat(client, max_tokens=23, extra_body=extra)
    assert text == full.choices[0].message.content == script_text(23)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"

    # A prompt without the trigger gives random bytes (invalid UTF-8 included): same rule.
    kwargs = dict(model=MODEL, prompt="abc", max_tokens=40, temperature=0, extra_body=extra)
    plain = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == plain and plain


def test_multibyte_utf8_survives_streaming(server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 27,
        "temperature": 0,
        "stream": True,
        "speculative": "off",  # one token per step: deltas end mid-character all the time
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = sse_events(raw.decode("utf-8").splitlines())  # strict: invalid UTF-8 would raise
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == script_text(27)
    assert {"é", "中", "👋"} <= set("".join(deltas))
    assert len([d for d in deltas if d]) >= 10  # really streamed, piece by piece


def test_stop_strings(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stop=["中👋"]
    )
    assert resp.choices[0].message.content == "Hi é"
    assert resp.choices[0].finish_reason == "stop"
    text, chunks, _ = stream_chat(client, max_tokens=30, stop="👋")
    assert text == "Hi é中" and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_prompt_forms(server, client, tokenizer):
    ids = tokenizer.encode("Tell me.\n")
    for prompt in ("Tell me.\n", ids, [ids], ["Tell me.\n"]):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
        assert resp.choices[0].text == SCRIPT
        assert resp.usage.prompt_tokens == len(ids)
    bad = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_32_concurrent_streams_complete_with_correct_usage(server, tokenizer):
    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES))

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, object, str | None]:
        n = 9 + i % 11
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": ("on", "off", "auto")[i % 3]},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return n, text, usage, finish

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for i, (n, text, usage, finish) in enumerate(results):
        assert text == script_text(n), i
        assert finish == "length"
        assert usage.completion_tokens == n and usage.prompt_tokens == prompt_tokens
        assert usage.total_tokens == n + prompt_tokens
        assert speculative_usage(usage)["arm"] == ("spec", "plain", "spec")[i % 3]
    server.wait_idle()


def test_arm_from_header_and_body(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 9, "temperature": 0}
    text = server.metrics()
    plain_tokens = metric_value(text, "specdec:generation_tokens_total", arm="plain")
    spec_tokens = metric_value(text, "specdec:generation_tokens_total", arm="spec")

    r = httpx.post(url, json=base, headers={"X-Specdec-Speculative": "off"}, timeout=30)
    assert r.status_code == 200 and r.headers["X-Specdec-Arm"] == "plain"
    spec = r.json()["usage"]["speculative"]
    assert spec["arm"] == "plain" and spec["draft_tokens"] == 0
    assert r.json()["choices"][0]["message"]["content"] == SCRIPT

    # The body field wins over the header.
    r = httpx.post(
        url, json={**base, "speculative": "on"}, headers={"X-Specdec-Speculative": "off"}
    )
    assert r.headers["X-Specdec-Arm"] == "spec"
    assert r.json()["usage"]["speculative"]["draft_tokens"] > 0

    r = httpx.post(url, json=base, headers={"X-Specdec-Speculative": "sometimes"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Specdec-Speculative"

    text = server.metrics()
    assert metric_value(text, "specdec:generation_tokens_total", arm="plain") == plain_tokens + 9
    assert metric_value(text, "specdec:generation_tokens_total", arm="spec") == spec_tokens + 9


def test_metrics_exposition(server, client, tokenizer):
    before = server.metrics()
    client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"speculative": "on"},
    )
    text = server.metrics()
    for name in (
        "specdec:time_to_first_token_seconds_bucket",
        "specdec:time_per_output_token_seconds_bucket",
        "specdec:inter_token_latency_seconds_bucket",
        "specdec:e2e_request_latency_seconds_bucket",
        "specdec:num_requests_running",
        "specdec:num_requests_waiting",
        "specdec:kv_cache_usage_perc",
        "specdec:prompt_tokens_total",
        "specdec:generation_tokens_total",
        "specdec:spec_decode_num_drafts_total",
        "specdec:spec_decode_num_draft_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_per_pos_total",
        "specdec:spec_decode_mean_k",
        "specdec:spec_decode_speculating_fraction",
        "specdec:spec_decode_cost_model",
        "specdec:spec_decode_acceptance_estimate",
    ):
        assert f"\n{name}{{" in text, name
    # The policy's inputs: its cost fit has seen the steps; the acceptance estimate is a chance.
    cost = "specdec:spec_decode_cost_model"
    assert metric_value(text, cost, coefficient="num_observations") > 0
    assert metric_value(text, cost, coefficient="machine_pace") > 0
    assert 0 < metric_value(text, "specdec:spec_decode_acceptance_estimate", position="0") <= 1

    def delta(name: str, **labels: str) -> float:
        return metric_value(text, name, **labels) - metric_value(before, name, **labels)

    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES))
    assert delta("specdec:prompt_tokens_total", arm="spec") == prompt_tokens
    assert delta("specdec:generation_tokens_total", arm="spec") == 12
    assert delta("specdec:e2e_request_latency_seconds_count", arm="spec") == 1
    drafted = delta("specdec:spec_decode_num_draft_tokens_total", arm="spec")
    assert drafted > 0 and delta("specdec:spec_decode_num_accepted_tokens_total") == drafted
    assert delta("specdec:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert delta("specdec:spec_decode_num_drafts_total", arm="plain") == 0
