"""Model routing: the draft served as its own model (a plain-decode engine on the draft's weights,
not loaded twice) and the router name `auto` that sends short requests to it.

The server runs the script model as target and draft with ``--router-model-name auto
--route-max-tokens 16 --route-max-prompt-tokens 64``.
"""

from __future__ import annotations

import argparse
import dataclasses

import httpx
import pytest
from helpers_server import (
    ServerProcess,
    build_script_model,
    metric_value,
    run_uvicorn,
    script_text,
    sse_events,
    start_servers,
)
from specdec.api import model_routing
from specdec.api.ab import ArmAssigner
from specdec.api.app import create_app
from specdec.api.cli import main as cli_main
from specdec.api.errors import APIError
from specdec.api.model_routing import (
    MODEL_HEADER,
    Backend,
    ModelRouter,
    RoutingSettings,
    add_routing_arguments,
    build_draft_engine,
    resolve_routing,
    routing_from_args,
)
from specdec.api.settings import ServerSettings
from specdec.engine.async_engine import AsyncEngine
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError, InvalidRequestError
from specdec.engine.kv_cache import bytes_per_block
from specdec.engine.sampling_params import SamplingParams
from tiny_models import hf_greedy, make_engine, tiny_hf_model

MODEL = "script"
DRAFT = "script-draft"  # the draft directory has the target's basename, so "-draft" is appended
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_routing")
    build_script_model(root / MODEL)
    args = ["--router-model-name", "auto", "--route-max-tokens", "16"]
    args += ["--route-max-prompt-tokens", "64"]
    srv = ServerProcess(root / MODEL, root / MODEL, args, root / "server.log")
    start_servers(srv)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def chat(http, model, **fields) -> httpx.Response:
    body = {"model": model, "messages": MSG, "temperature": 0, **fields}
    return http.post(CHAT, json=body)


# ---- the engine that serves the draft ---------------------------------------------------------
def test_draft_engine_shares_the_weights_and_decodes_like_the_draft_alone(monkeypatch):
    target_hf, draft_hf = tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=3)
    engine = make_engine(target_hf, draft_hf)
    draft = build_draft_engine(engine)
    assert draft.target is engine.draft  # the very weights object: nothing loaded twice
    assert draft.proposer is None and draft.policy is None
    # A quarter of the main pool (128 blocks), but at least one max_model_len sequence (256 / 4).
    assert draft.allocator.num_blocks == 64
    free = draft.allocator.num_free_blocks
    prompts = [[5, 9, 2, 7], [3, 3, 8, 1, 4, 6]]
    outs = draft.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == hf_greedy(draft_hf, prompt, 12)
    assert draft.allocator.num_free_blocks == free
    # A large main pool: the quarter is capped by bytes.
    big = make_engine(target_hf, draft_hf, num_kv_blocks=1024)
    per_block = bytes_per_block([big.draft.arch], big.config.page_size, big.dtype)
    monkeypatch.setattr(model_routing, "DEFAULT_DRAFT_POOL_MAX_BYTES", 100 * per_block)
    assert build_draft_engine(big).allocator.num_blocks == 100
    # An engine without a draft has nothing to serve.
    with pytest.raises(ConfigError, match="no draft model"):
        build_draft_engine(make_engine(target_hf))
    # A pool that cannot hold one max_model_len sequence is refused.
    with pytest.raises(ConfigError, match="--draft-num-kv-blocks 2 cannot hold one sequence"):
        build_draft_engine(engine, num_blocks=2)


# ---- names and the routing rule ---------------------------------------------------------------
def _settings(*names: str) -> ServerSettings:
    return ServerSettings(served_model_names=names or ("tgt",))


def test_resolve_routing_names_and_clashes():
    pair = EngineConfig(model="/m/tgt", draft_model="/m/small")
    assert resolve_routing(RoutingSettings(), pair, _settings()).draft_served_name == "small"
    same = EngineConfig(model="/m/tgt", draft_model="/other/tgt")
    assert resolve_routing(RoutingSettings(), same, _settings()).draft_served_name == "tgt-draft"
    with pytest.raises(ConfigError, match="also a target"):
        resolve_routing(RoutingSettings(draft_served_name="tgt"), pair, _settings())
    with pytest.raises(ConfigError, match="also a served name"):
        resolve_routing(RoutingSettings(router_name="small"), pair, _settings())
    # Without a draft (or with --no-serve-draft) nothing is served and a router is refused.
    none = EngineConfig(model="/m/tgt", draft_model=None, speculative_method="none")
    assert resolve_routing(RoutingSettings(), none, _settings()).serve_draft is False
    assert (
        resolve_routing(RoutingSettings(serve_draft=False), pair, _settings()).serve_draft is False
    )
    for config, routing in ((none, RoutingSettings()), (pair, RoutingSettings(serve_draft=False))):
        with pytest.raises(ConfigError, match="needs the draft model served"):
            resolve_routing(dataclasses.replace(routing, router_name="auto"), config, _settings())
    for bad in (
        {"route_max_tokens": 0},
        {"route_max_prompt_tokens": 0},
        {"draft_num_kv_blocks": 0},
        {"router_name": ""},
        {"draft_served_name": ""},
    ):
        with pytest.raises(ConfigError):
            RoutingSettings(**bad)


def test_routing_flags_parse():
    parser = argparse.ArgumentParser()
    add_routing_arguments(parser)
    args = parser.parse_args(["--router-model-name", "auto", "--route-max-tokens", "8"])
    pair = EngineConfig(model="/m/tgt", draft_model="/m/small")
    routing = routing_from_args(args, pair, _settings())
    assert (routing.router_name, routing.route_max_tokens, routing.draft_served_name) == (
        "auto",
        8,
        "small",
    )
    assert (
        routing_from_args(parser.parse_args(["--no-serve-draft"]), pair, _settings()).serve_draft
        is False
    )


def test_cli_refuses_a_router_without_a_draft_before_loading_models(capsys):
    code = cli_main(
        ["serve", "--model", "/nonexistent", "--speculative-method", "none"]
        + ["--router-model-name", "auto"]
    )
    assert code == 2 and "needs the draft model served" in capsys.readouterr().err


def test_route_rule():
    a, b = object(), object()
    target = Backend("tgt", "/m/tgt", a, ArmAssigner("auto", True))  # type: ignore[arg-type]
    draft = Backend("small", "/m/small", b, ArmAssigner("off", False))  # type: ignore[arg-type]
    routing = RoutingSettings(router_name="auto", route_max_tokens=16, route_max_prompt_tokens=64)
    router = ModelRouter(target, ("tgt", "alias"), draft, routing)
    assert router.names == ["tgt", "alias", "small", "auto"]
    assert router.resolve(None) == "tgt"
    with pytest.raises(APIError) as err:
        router.resolve("nope")
    assert err.value.status_code == 404 and err.value.code == "model_not_found"
    route = router.route
    assert route("alias", 1000, None, None, None) is target
    assert route("small", 1000, None, None, None) is draft
    assert route("auto", 64, 16, None, None) is draft
    assert route("auto", 65, 16, None, None) is target  # long prompt
    assert route("auto", 10, 17, None, None) is target  # long output
    assert route("auto", 10, None, None, None) is target  # no max_tokens: could run long
    assert route("auto", 10, 8, "on", None) is target  # only the target speculates
    assert route("auto", 10, 8, None, " ON ") is target
    assert route("auto", 10, 8, "auto", "on") is draft  # the body wins over the header
    with pytest.raises(ConfigError):
        ModelRouter(target, ("tgt",), None, routing)


# ---- through the server -----------------------------------------------------------------------
def test_models_lists_target_draft_and_router(server, http):
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, DRAFT, "auto"]
    target, draft, router = models
    assert target["draft_model"] == draft["root"] and draft["draft_model"] is None
    assert router["root"] == "router" and router["max_model_len"] == 256
    assert http.get(f"/v1/models/{DRAFT}").json()["id"] == DRAFT


def test_draft_model_answers_alone(server, http):
    before = server.metrics()
    r = chat(http, DRAFT, max_tokens=6)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == DRAFT and r.headers[MODEL_HEADER] == DRAFT
    assert r.headers["X-Specdec-Arm"] == "plain"
    assert body["choices"][0]["message"]["content"] == script_text(6)
    spec = body["usage"]["speculative"]
    assert spec["draft_tokens"] == 0 and spec["mean_accepted_length"] == 1.0
    after = server.metrics()
    name = "specdec:generation_tokens_total"
    draft_tokens = metric_value(after, name, model_name=DRAFT, arm="plain")
    assert draft_tokens - metric_value(before, name, model_name=DRAFT, arm="plain") == 6
    # The speculative engine did not see it.
    target_tokens = metric_value(after, name, model_name=MODEL)
    assert target_tokens == metric_value(before, name, model_name=MODEL)


def test_draft_model_streams(server, http):
    body = {"model": DRAFT, "messages": MSG, "max_tokens": 5, "temperature": 0, "stream": True}
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200 and r.headers[MODEL_HEADER] == DRAFT
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert {c["model"] for c in chunks} == {DRAFT}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == script_text(5)


def test_router_picks_by_the_documented_rule(server, http):
    short = chat(http, "auto", max_tokens=8)
    assert short.headers[MODEL_HEADER] == DRAFT and short.json()["model"] == DRAFT
    long_output = chat(http, "auto", max_tokens=17)
    assert long_output.headers[MODEL_HEADER] == MODEL and long_output.json()["model"] == MODEL
    unbounded = chat(http, "auto", max_tokens=None)
    assert unbounded.headers[MODEL_HEADER] == MODEL
    long_prompt = chat(http, "auto", max_tokens=8, messages=[{"role": "user", "content": "x" * 80}])
    assert long_prompt.headers[MODEL_HEADER] == MODEL
    on = chat(http, "auto", max_tokens=8, speculative="on")
    assert on.headers[MODEL_HEADER] == MODEL and on.headers["X-Specdec-Arm"] == "spec"
    text = http.post("/v1/completions", json={"model": "auto", "prompt": "hi", "max_tokens": 4})
    assert text.status_code == 200 and text.json()["model"] == DRAFT


def test_bad_model_input_changes_nothing(server, http):
    before = server.wait_idle()
    missing = chat(http, "nope", max_tokens=4)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert DRAFT in error["message"] and "auto" in error["message"]
    # Only the target speculates: 'on' for the draft is a 400 from its engine.
    on = chat(http, DRAFT, max_tokens=4, speculative="on")
    assert on.status_code == 400 and on.json()["error"]["param"] == "speculative"
    # The draft's own length limit applies.
    too_long = chat(http, DRAFT, max_tokens=300)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert server.wait_idle()["engine_steps"] == before["engine_steps"]


def test_server_without_a_draft_does_not_list_one():
    engine = AsyncEngine(make_engine(tiny_hf_model("qwen2", seed=0)))
    app = create_app(engine, ServerSettings(served_model_names=("tiny",)))
    with run_uvicorn(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        for name in ("tiny-draft", "auto"):
            r = http.post(
                "/v1/completions", json={"model": name, "prompt": [3, 4], "max_tokens": 2}
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        ok = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
        assert ok.status_code == 200 and ok.headers[MODEL_HEADER] == "tiny"


def test_engine_rejects_speculation_on_for_the_draft_engine():
    engine = make_engine(tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1))
    draft = build_draft_engine(engine)
    with pytest.raises(InvalidRequestError):
        draft.add_request("r", [3, 4], SamplingParams(max_tokens=2), "on")
    assert not draft.has_unfinished()
