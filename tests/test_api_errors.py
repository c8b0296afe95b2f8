"""Bad input against a real server: OpenAI-style errors with the right status, never FastAPI's 422,
never a 500, and no engine state change; the A/B split; fuzzing of the app's own OpenAPI schema.

The server runs with ``--speculative-mode on --ab-split 0.5 --ab-seed 7 --max-tokens-limit 8 --max-body-bytes 20000``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from helpers_server import ServerProcess, build_script_model, metric_value, start_servers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "script"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LIMIT = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_errors")
    build_script_model(root / MODEL)
    args = [
        "--speculative-mode",
        "on",
        "--ab-split",
        "0.5",
        "--ab-seed",
        "7",
        "--max-tokens-limit",
        str(LIMIT),
    ]
    args += ["--max-body-bytes", "20000", "--served-model-name", MODEL, "alias"]
    srv = ServerProcess(root / MODEL, root / MODEL, args, root / "server.log")
    start_servers(srv)
    yield srv
    srv.stop()


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MSG, **fields}


def text(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", **fields}


# (name, path, json body, expected status, expected error param)
BAD_JSON_BODIES = [
    ("no messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown role", CHAT, chat(messages=[{"role": "bot", "content": "x"}]), 400,
     "messages[0].role"),
    ("content is a number", CHAT, chat(messages=[{"role": "user", "content": 3}]), 400,
     "messages[0].content"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content"),
    ("null user content", CHAT, chat(messages=[{"role": "user", "content": None}]), 400,
     "messages[0]"),
    ("tool message without content", CHAT, chat(messages=[{"role": "tool"}]), 400,
     "messages[0]"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("temperature < 0", CHAT, chat(temperature=-0.5), 400, "temperature"),
    ("temperature string", CHAT, chat(temperature="0.5"), 400, "temperature"),
    ("temperature bool", CHAT, chat(temperature=True), 400, "temperature"),
    ("top_p 0", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p > 1", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top_k < -1", CHAT, chat(top_k=-2), 400, "top_k"),
    ("min_p > 1", CHAT, chat(min_p=2), 400, "min_p"),
    ("presence_penalty", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("max_tokens 0", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens string", CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens over limit", CHAT, chat(max_tokens=LIMIT + 1), 400, "max_tokens"),
    ("max_completion_tokens over limit", CHAT, chat(max_completion_tokens=99), 400,
     "max_tokens"),
    ("seed too large", CHAT, chat(seed=2**70), 400, "seed"),
    ("n = 2", CHAT, chat(n=2), 400, "n"),
    ("n = 0", CHAT, chat(n=0), 400, "n"),
    ("logprobs", CHAT, chat(logprobs=True), 400, "logprobs"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("json mode", CHAT, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("logit_bias", CHAT, chat(logit_bias={"5": 10}), 400, "logit_bias"),
    ("unknown field", CHAT, chat(frobnicate=1), 400, "frobnicate"),
    ("unknown stream option", CHAT, chat(stream=True, stream_options={"x": 1}), 400,
     "stream_options.x"),
    ("too many stops", CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("empty stop", CHAT, chat(stop=[""]), 400, "stop"),
    ("stop of numbers", CHAT, chat(stop=[1, 2]), 400, "stop"),
    ("bad speculative", CHAT, chat(speculative="maybe"), 400, "speculative"),
    ("unknown model", CHAT, chat(model="gpt-5"), 404, "model"),
    ("unknown model, text", TEXT, text(model="gpt-5"), 404, "model"),
    ("empty prompt", TEXT, text(prompt=""), 400, "prompt"),
    ("empty id prompt", TEXT, text(prompt=[]), 400, "prompt"),
    ("batched prompts", TEXT, text(prompt=["a", "b"]), 400, "prompt"),
    ("token id out of vocab", TEXT, text(prompt=[5, 10**6]), 400, "prompt"),
    ("negative token id", TEXT, text(prompt=[-1]), 400, "prompt"),
    ("prompt too long", TEXT, text(prompt=[5] * 300), 400, "prompt"),
    ("prompt + max_tokens too long", TEXT, text(prompt=[5] * 250, max_tokens=LIMIT), 400,
     "max_tokens"),
    ("echo", TEXT, text(echo=True), 400, "echo"),
    ("text logprobs", TEXT, text(logprobs=2), 400, "logprobs"),
    ("best_of", TEXT, text(best_of=3), 400, "best_of"),
    ("suffix", TEXT, text(suffix="x"), 400, "suffix"),
    ("body is a list", CHAT, [1, 2], 400, None),
    ("body is a string", TEXT, "hello", 400, None),
    ("body is null", CHAT, None, 400, None),
]  # fmt: skip


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def test_bad_requests_get_openai_errors_and_change_nothing(server, http):
    _, before = server.health()
    metrics_before = server.metrics()
    failures = []
    for name, path, body, status, param in BAD_JSON_BODIES:
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        try:
            error = assert_openai_error(r, status)
            assert error["param"] == param, error
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)

    _, after = server.health()
    assert after["engine_steps"] == before["engine_steps"]
    assert after["num_free_blocks"] == after["num_blocks"]
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    name = "specdec:request_success_total"
    assert metric_value(server.metrics(), name) == metric_value(metrics_before, name)


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"{bad json", {"content-type": "application/json"}, 400),
        (b"", {"content-type": "application/json"}, 400),
        (b'{"model": "script", "messages": [', {"content-type": "application/json"}, 400),
        (b"\xff\xfe\x00garbage", {"content-type": "application/json"}, 400),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', {"content-type": "text/plain"}, 400),
        (b"x" * 20001, {"content-type": "application/json"}, 413),
    ],
)
def test_malformed_bodies(http, content, headers, status):
    error = assert_openai_error(http.post(CHAT, content=content, headers=headers), status)
    if status == 413:
        assert error["code"] == "request_too_large"


def test_oversized_chunked_body_gets_413(http):
    def chunks():
        for _ in range(30):
            yield b" " * 1000

    assert_openai_error(http.post(CHAT, content=chunks()), 413)


def test_routes_and_methods(http):
    assert_openai_error(http.get(CHAT), 405)
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/models/gpt-5"), 404)


def test_model_aliases(http):
    for name in (MODEL, "alias", None):
        body = chat(model=name, max_tokens=2) if name else {"messages": MSG, "max_tokens": 2}
        r = http.post(CHAT, json=body)
        assert r.status_code == 200 and r.json()["model"] == MODEL


def test_max_tokens_limit_is_the_default(http):
    r = http.post(CHAT, json=chat(temperature=0, ignore_eos=True))
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == LIMIT
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_ab_split_assigns_arms_and_labels_metrics(server, http):
    before = server.metrics()
    arms = []
    for _ in range(40):
        r = http.post(CHAT, json=chat(max_tokens=4, temperature=0))
        assert r.status_code == 200
        arm = r.headers["X-Specdec-Arm"]
        spec = r.json()["usage"]["speculative"]
        assert spec["arm"] == arm
        assert (spec["draft_tokens"] > 0) == (arm == "spec")
        arms.append(arm)
    # Binomial(40, 0.5): outside [8, 32] has probability < 1e-4 (and the seed is fixed).
    assert 8 <= arms.count("spec") <= 32

    # A choice in the header or body is never overridden by the split.
    for _ in range(6):
        r = http.post(CHAT, json=chat(max_tokens=2), headers={"X-Specdec-Speculative": "off"})
        assert r.headers["X-Specdec-Arm"] == "plain"
        r = http.post(CHAT, json=chat(max_tokens=2, speculative="on"))
        assert r.headers["X-Specdec-Arm"] == "spec"

    after = server.metrics()
    for arm in ("spec", "plain"):
        name = "specdec:request_success_total"
        counted = metric_value(after, name, arm=arm) - metric_value(before, name, arm=arm)
        assert counted == arms.count(arm) + 6
        name = "specdec:spec_decode_num_draft_tokens_total"
        drafted = metric_value(after, name, arm=arm) - metric_value(before, name, arm=arm)
        assert (drafted > 0) == (arm == "spec")


def test_openapi_has_no_422(http):
    schema = http.get("/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"])
    chat_op = schema["paths"][CHAT]["post"]
    assert {"400", "404", "413", "429", "503"} <= set(chat_op["responses"])
    assert any(p["name"] == "X-Specdec-Speculative" for p in chat_op["parameters"])


# ---- fuzzing ----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_fuzz_fields_never_500(server, http, data):
    """Valid bodies with one to three fields replaced by arbitrary JSON values."""
    path = data.draw(st.sampled_from([CHAT, TEXT]))
    body = chat(max_tokens=2) if path == CHAT else text(max_tokens=2)
    fields = list(body) + [
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream", "logprobs",
        "stream_options", "speculative", "stop_token_ids", "frequency_penalty", "ignore_eos",
    ]  # fmt: skip
    for _ in range(data.draw(st.integers(1, 3))):
        body[data.draw(st.sampled_from(fields))] = data.draw(JSON_VALUES)
    # json.dumps writes NaN/Infinity for non-finite floats, as some clients do.
    content = json.dumps(body)
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert_openai_error(r, r.status_code)


def test_schemathesis_finds_no_server_errors(server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @settings(
            max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(case=schema.as_strategy(generation_mode=mode))
        def check(case) -> None:
            response = case.call(base_url=server.url, timeout=30)
            if response.status_code >= 500 or response.status_code == 422:
                failures.append(f"{case.method} {case.path} {case.body!r} -> {response.text}")
            assert response.status_code < 500 and response.status_code != 422

        check()
    assert not failures
    server.wait_idle()
