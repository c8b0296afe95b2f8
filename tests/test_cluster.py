"""`specdec cluster` end to end on a real local Ray cluster: two engine replicas of the tiny script
model behind the ingress. Streaming, aggregated health and metrics with A/B arms, prefix-affine
routing, 429 back-pressure, a blue-green swap under steady traffic, and a replica killed
mid-stream. One Ray cluster for the module (starting one takes seconds)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

import httpx  # noqa: E402
from helpers_server import (  # noqa: E402
    ServerProcess,
    build_script_model,
    metric_value,
    script_text,
    sse_events,
    start_servers,
)
from ray import serve  # noqa: E402
from specdec.api.cluster.background import BackgroundCluster  # noqa: E402
from specdec.api.cluster.options import ClusterOptions  # noqa: E402
from specdec.api.settings import ServerSettings  # noqa: E402
from specdec.engine.config import EngineConfig  # noqa: E402

MODEL = "script"
MESSAGES = [{"role": "user", "content": "Say hi."}]
TOKEN = "test-admin-token"
MAX_NUM_SEQS = 2
MAX_QUEUE_LEN = 1  # a replica takes 3 requests at once
MAX_QUEUED = 2  # the ingress holds 2 more while both replicas are full


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster") / MODEL
    build_script_model(root)
    config = EngineConfig(
        model=str(root), draft_model=str(root), speculative_method="draft_model",
        device="cpu", dtype="float32", num_threads=1, page_size=16, num_kv_blocks=128,
        max_model_len=256, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256,
        controller_warmup=False,
    )  # fmt: skip
    settings = ServerSettings(
        served_model_names=(MODEL,), ab_split=0.5, ab_seed=0, max_queue_len=MAX_QUEUE_LEN
    )
    options = ClusterOptions(
        replicas=2, max_queued_requests=MAX_QUEUED, stats_period_s=0.3, replica_cpus=1,
        drain_timeout_s=30,
    )  # fmt: skip
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    # Forwarded to the replicas: slow engine steps, so streams last long enough to interleave.
    os.environ["SPECDEC_STEP_DELAY_S"] = "0.01"
    try:
        harness = BackgroundCluster(config, settings, options, admin_token=TOKEN).start()
    finally:
        del os.environ["SPECDEC_STEP_DELAY_S"]
    yield harness
    harness.stop()
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        yield c


def chat(client, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 8, **kw}
    return client.post("/v1/chat/completions", json=body)


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def wait_idle(client) -> dict:
    """Until no replica runs or queues a request and every KV block is free again."""

    def idle():
        h = client.get("/health").json()
        quiet = h["num_requests_running"] == 0 and h["num_requests_waiting"] == 0
        return quiet and h["num_free_blocks"] == h["num_blocks"] and h

    return wait_for(idle, what="an idle cluster with every KV block free")


def test_stream_and_json_through_the_ingress(client):
    r = chat(client, max_tokens=18, speculative="on")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == script_text(18)
    assert r.headers["x-specdec-arm"] == "spec"
    generation, _, replica = r.headers["x-specdec-replica"].partition("/")
    assert generation.startswith("specdec-") and replica
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 11,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]"
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    assert text == script_text(11)
    assert events[-2]["usage"]["completion_tokens"] == 11
    # The single server's validation and error bodies.
    bad = chat(client, temperature=-1)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    unknown = chat(client, model="nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    wait_idle(client)


def test_health_and_metrics_aggregate_replicas_and_arms(client, cluster):
    def served() -> float:
        return metric_value(client.get("/metrics").text, "specdec:request_success_total")

    before = served()
    results: list[httpx.Response] = []

    def one() -> None:
        with httpx.Client(base_url=cluster.url, timeout=60) as c:
            results.append(chat(c, max_tokens=60))

    # Staggered long requests: the prefix holder fills up, so the router spreads them over both
    # replicas; the seeded A/B split puts some in each arm.
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * 6
    replicas_used = {r.headers["x-specdec-replica"] for r in results}
    assert len(replicas_used) == 2, replicas_used
    health = wait_for(
        lambda: (h := client.get("/health").json()) and len(h["replicas"]) == 2 and h,
        what="two replicas in /health",
    )
    assert health["ready"] and health["status"] == "ok"
    assert all(r["ready"] for r in health["replicas"])
    assert health["num_blocks"] == 2 * 128
    metrics = client.get("/metrics").text
    for replica in (r["replica"] for r in health["replicas"]):
        assert metric_value(metrics, "specdec:engine_loop_alive", replica=replica) == 1.0
        assert metric_value(metrics, "specdec:prefix_cache_hit_rate", replica=replica) >= 0.0
        assert metric_value(metrics, "specdec:prefix_cache_queries_total", replica=replica) > 0
    # Request metrics are counted at the ingress, per arm, over both replicas.
    assert served() - before == 6
    spec = metric_value(metrics, "specdec:request_success_total", arm="spec")
    plain = metric_value(metrics, "specdec:request_success_total", arm="plain")
    assert spec >= 1 and plain >= 1


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(client):
    shared = "The quick brown fox jumps over the lazy dog. " * 4  # several 16-token blocks
    seen = []
    for i in range(6):
        r = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": shared + f"Question {i}?", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        seen.append(r.headers["x-specdec-replica"])
    assert len(set(seen)) == 1, seen
    replica = seen[0].partition("/")[2]

    def hit_rate():
        reps = {r["replica"]: r for r in client.get("/health").json()["replicas"]}
        return reps[replica]["prefix_cache_hit_rate"] > 0

    wait_for(hit_rate, what="a prefix-cache hit on the chosen replica")
    metrics = client.get("/metrics").text
    assert metric_value(metrics, "specdec:cluster_routing_decisions_total", reason="affine") >= 5


def test_back_pressure_answers_429_and_the_rest_complete(client, cluster):
    capacity = 2 * (MAX_NUM_SEQS + MAX_QUEUE_LEN)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(base_url=cluster.url, timeout=60) as c:
            r = chat(c, max_tokens=40, speculative="off")
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(capacity + MAX_QUEUED + 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(client)


def _app_names() -> set[str]:
    return set(serve.status().applications)


def test_swap_under_steady_traffic_fails_no_request(client, cluster):
    before = cluster.server.current.name
    # The admin route: a token, and arguments that parse.
    assert client.post("/admin/swap", json={"args": []}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = client.post("/admin/swap", json={"args": ["--seed", "x"]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "args"
    assert cluster.server.current.name == before

    stop = threading.Event()
    failures: list[str] = []
    served_by: list[str] = []

    def steady(stream: bool) -> None:
        with httpx.Client(base_url=cluster.url, timeout=60) as c:
            while not stop.is_set():
                body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "stream": stream}
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        lines = list(r.iter_lines())
                        if r.status_code != 200:
                            failures.append(f"{r.status_code}: {lines}")
                            continue
                        served_by.append(r.headers["x-specdec-replica"].partition("/")[0])
                        if stream:
                            events = sse_events(lines)
                            if events[-1] != "[DONE]" or any("error" in e for e in events[:-1]):
                                failures.append(f"stream: {events}")
                        elif "choices" not in json.loads("".join(lines)):
                            failures.append("".join(lines))
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))

    clients = [threading.Thread(target=steady, args=(s,)) for s in (False, True)]
    for t in clients:
        t.start()
    time.sleep(0.5)
    r = client.post("/admin/swap", json={"args": ["--seed", "7"]}, headers=auth, timeout=300)
    assert r.status_code == 200, r.text
    after = r.json()["generation"]
    assert after != before and cluster.server.current.name == after
    assert cluster.server.current.config.seed == 7
    time.sleep(1.0)
    stop.set()
    for t in clients:
        t.join(60)
    assert failures == []
    assert before in served_by and after in served_by
    # The old generation drains and its application is deleted.
    wait_for(lambda: before not in _app_names(), what="the old application deleted")
    assert after in _app_names()
    wait_idle(client)


def test_cli_joins_the_running_cluster_and_passes_the_engines_429(cluster, tmp_path):
    """`specdec cluster --ray-address`: a second ingress process with its own replica joins
    this module's Ray cluster, serves, and removes its application when stopped. Its replica
    takes one sequence and no queue while Serve may send it more, so the engine's own 429 is
    what a second concurrent request gets."""
    gcs = ray.get_runtime_context().gcs_address
    server = ServerProcess(
        cluster.server.current.config.model, None,
        ["--replicas", "1", "--ray-address", gcs, "--replica-cpus", "0.5",
         "--max-num-seqs", "1", "--max-queue-len", "0", "--max-ongoing-requests", "4"],
        tmp_path / "cluster.log", env={"SPECDEC_STEP_DELAY_S": "0.02"},
    )  # fmt: skip
    server.cmd[server.cmd.index("serve")] = "cluster"
    start_servers(server, timeout=120)
    url = f"{server.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0}
    try:
        r = httpx.post(url, json={**body, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == script_text(5)
        theirs = r.headers["x-specdec-replica"].partition("/")[0]
        assert theirs in _app_names() and theirs != cluster.server.current.name
        with httpx.Client(timeout=60) as c, c.stream("POST", url, json={
            **body, "max_tokens": 60, "stream": True, "speculative": "off"
        }) as long:  # fmt: skip
            assert long.status_code == 200
            busy = c.post(url, json={**body, "max_tokens": 5})
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["code"] == "queue_full"
            assert "server queue is full" in busy.json()["error"]["message"]  # the engine's
            assert busy.headers["retry-after"] == "1"
            assert sse_events(long.iter_lines())[-1] == "[DONE]"
    finally:
        server.stop()
    # uvicorn re-raises the SIGTERM it handled once shut down, which Ray's handler turns into
    # exit status 15.
    assert server.proc.returncode in (0, signal.SIGTERM, -signal.SIGTERM), server.log()
    wait_for(lambda: theirs not in _app_names(), what="the CLI's application deleted")


def test_replica_killed_mid_stream_errors_the_stream_and_others_keep_serving(client):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True,
            "speculative": "off"}  # fmt: skip
    t0 = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        app, _, replica = s.headers["x-specdec-replica"].partition("/")
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert "chat.completion.chunk" in first
        actor = ray.get_actor(f"SERVE_REPLICA::{app}#engine#{replica}", namespace="serve")
        ray.kill(actor, no_restart=True)
        events = sse_events(lines)
    assert time.monotonic() - t0 < 30  # no hang
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unavailable"
    # The other replica keeps serving.
    for _ in range(4):
        r = chat(client)
        assert r.status_code == 200, r.text
        assert r.headers["x-specdec-replica"] != f"{app}/{replica}"
    wait_idle(client)


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load(cluster):
    """A second deployment (1 to 2 replicas, target 1 request in flight each) scales up while
    four clients keep it busy (about 10 s for Serve's decision, 10 s for the replica to load)."""
    config = cluster.server.current.config
    options = ClusterOptions(
        min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.5,
        stats_period_s=0.3, replica_cpus=1,
    )  # fmt: skip
    os.environ["SPECDEC_STEP_DELAY_S"] = "0.02"
    try:
        auto = BackgroundCluster(config, cluster.server.settings, options).start()
    finally:
        del os.environ["SPECDEC_STEP_DELAY_S"]
    stop = threading.Event()
    codes: list[int] = []

    def load() -> None:
        with httpx.Client(base_url=auto.url, timeout=60) as c:
            while not stop.is_set():
                codes.append(chat(c, max_tokens=40, speculative="off").status_code)

    clients = [threading.Thread(target=load) for _ in range(4)]
    try:
        assert len(httpx.get(f"{auto.url}/health").json()["replicas"]) == 1
        for t in clients:
            t.start()
        wait_for(
            lambda: len(httpx.get(f"{auto.url}/health").json()["replicas"]) == 2,
            timeout=60,
            what="a second replica",
        )
    finally:
        stop.set()
        for t in clients:
            t.join(60)
        auto.stop()
    assert codes and set(codes) == {200}
