"""The cluster's Ray-free parts: prefix keys and index, the routing decision, options and the
deployment options they make, the metrics merge; and that `specdec serve` never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from specdec.api.cluster.metrics import ReplicaMetrics, merge_expositions
from specdec.api.cluster.options import ClusterOptions, deployment_options, replica_capacity
from specdec.api.cluster.prefix import KEY_BYTES, PrefixIndex, choose, prompt_keys, short_keys
from specdec.api.metrics import ServerMetrics
from specdec.api.settings import ServerSettings
from specdec.engine.async_engine import EngineSnapshot
from specdec.engine.block_allocator import BlockAllocator, chain_hash
from specdec.engine.config import EngineConfig
from specdec.engine.errors import ConfigError
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence


def test_prompt_keys_are_the_engine_cache_keys():
    """The router's keys of a prompt equal (truncated) the keys the allocator files the
    prompt's blocks under once computed."""
    page = 4
    ids = list(range(3, 3 + 4 * page + 2))  # 4 full blocks + 2 tokens
    alloc = BlockAllocator(num_blocks=16, page_size=page)
    seq = Sequence(0, "r", ids, SamplingParams(max_tokens=1), "off")
    alloc.allocate(seq, len(ids))
    seq.num_computed_tokens = len(ids)
    alloc.cache_computed_blocks(seq)
    keys = prompt_keys(ids, page)
    assert len(keys) == (len(ids) - 1) // page == 4
    assert set(keys) == set(short_keys(alloc.cached_block_hashes()))
    assert keys[0] == chain_hash(None, ids[:page])[:KEY_BYTES]
    # A block's key names its whole prefix: same block, different history, different key.
    other = prompt_keys([99, *ids[1:]], page)
    assert other[1] != keys[1]
    alloc.free(seq)
    assert alloc.num_free_blocks == 16


def test_index_longest_match_reports_and_ttl():
    idx = PrefixIndex(routed_ttl_s=5.0)
    a = prompt_keys(list(range(40)), 4)
    b = prompt_keys([7, *range(1, 40)], 4)
    idx.routed("r1", a[:6], now=0.0)
    assert idx.match("r1", a) == 6 and idx.match("r2", a) == 0
    assert idx.match("r1", b) == 0  # differs in the first block: no shared prefix
    # A report keeps recently routed keys, then drops them once older than the TTL.
    idx.report("r1", version=1, keys=a[:2], now=1.0)
    assert idx.match("r1", a) == 6
    idx.report("r1", version=1, keys=[], now=100.0)  # the same report again: ignored
    assert idx.match("r1", a) == 6
    idx.report("r1", version=2, keys=a[:2], now=100.0)
    assert idx.match("r1", a) == 2
    idx.keep_only(["r2"])
    assert idx.match("r1", a) == 0


def test_index_bounds_routed_keys():
    idx = PrefixIndex(max_routed_keys=3)
    keys = prompt_keys(list(range(41)), 4)
    idx.routed("r", keys, now=0.0)
    assert idx.match("r", keys) == 0  # the oldest (first) keys were dropped
    idx.routed("r", keys[:3], now=1.0)
    assert idx.match("r", keys) == 3


def test_choose_prefers_the_holder_while_balanced():
    c = choose({"a": 1, "b": 0}, {"a": 5, "b": 1}, imbalance_threshold=2)
    assert c.reason == "affine" and c.ranks == [["a"], ["b"]] and c.matched_blocks == 5
    # Too busy: the least-loaded replica first, the holder still ranked after it.
    c = choose({"a": 4, "b": 1}, {"a": 5, "b": 0}, imbalance_threshold=2)
    assert c.reason == "least_loaded" and c.ranks == [["b"], ["a"]]
    # No replica holds anything: all least-loaded replicas share the first rank.
    c = choose({"a": 0, "b": 0, "c": 3}, {}, imbalance_threshold=2)
    assert c.reason == "least_loaded" and c.ranks == [["a", "b"], ["c"]]
    # Two holders of the longest match: the less loaded one.
    c = choose({"a": 2, "b": 1, "c": 0}, {"a": 3, "b": 3, "c": 1}, imbalance_threshold=2)
    assert c.ranks == [["b"], ["c", "a"]]
    assert choose({}, {}, 1.0).ranks == []


def _config(**kw) -> EngineConfig:
    base = dict(model="m", device="cpu", max_num_seqs=4, page_size=16, controller_warmup=False)
    return EngineConfig(**{**base, **kw})


def test_deployment_options_fixed_and_autoscaling():
    settings = ServerSettings(served_model_names=("m",), max_queue_len=6)
    config = _config()
    fixed = deployment_options(ClusterOptions(replicas=3), config, settings)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    # Serve never sends a replica more than its engine accepts (batch + queue).
    assert fixed["max_ongoing_requests"] == replica_capacity(config, settings) == 10
    router = fixed["request_router_config"]
    assert router["request_router_class"].endswith("PrefixAffinityRouter")
    assert router["request_router_kwargs"]["page_size"] == 16
    auto = deployment_options(
        ClusterOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=2, routing="pow2"),
        config,
        settings,
    )
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 2,
        "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
    }
    assert auto["request_router_config"]["request_router_class"].endswith("PowerOfTwoRouter")
    explicit = deployment_options(ClusterOptions(max_ongoing_requests=2), config, settings)
    assert explicit["max_ongoing_requests"] == 2


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"replicas": 0}, "--replicas"),
        ({"min_replicas": 0}, "--min-replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "must not exceed"),
        ({"max_queued_requests": 0}, "--max-queued-requests"),
        ({"routing": "random"}, "--routing"),
        ({"target_ongoing_requests": 0}, "--target-ongoing-requests"),
        ({"stats_period_s": 0}, "--stats-period"),
        ({"upscale_delay_s": -1}, "--upscale-delay"),
    ],
)
def test_bad_cluster_options_are_refused(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ClusterOptions(**kwargs)


def test_cluster_flags_are_checked_before_ray_starts(capsys):
    from specdec.api.cli import main

    assert main(["cluster", "--model", "m", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_single_server_routing_flags_are_refused_by_the_cluster(capsys):
    from specdec.api.cli import main

    assert main(["cluster", "--model", "m", "--router-model-name", "auto"]) == 2
    assert "--router-model-name: specdec cluster serves the target model only" in (
        capsys.readouterr().err
    )


def _families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def test_merge_labels_replica_samples_and_keeps_ingress_request_metrics():
    ingress = ServerMetrics("m")
    tracker = ingress.tracker("spec", 0.0, 3)
    tracker.finish("stop")
    ingress_text = ingress.render(EngineSnapshot(num_running=9), alive=True)
    replicas = {}
    for name, running in (("r1", 1), ("r2", 2)):
        metrics = ReplicaMetrics("m")
        alloc = BlockAllocator(num_blocks=4, page_size=4)
        alloc.prefix_queries, alloc.prefix_hits = 10 * running, 5
        replicas[name] = metrics.render(EngineSnapshot(num_running=running), True, alloc)
    merged = _families(merge_expositions(ingress_text, replicas))
    running = merged["specdec:num_requests_running"].samples
    # The ingress's own gauge (its sum) is replaced by one sample per replica.
    assert sorted((s.labels["replica"], s.value) for s in running) == [("r1", 1.0), ("r2", 2.0)]
    rate = {s.labels["replica"]: s.value for s in merged["specdec:prefix_cache_hit_rate"].samples}
    assert rate == {"r1": 0.5, "r2": 0.25}
    success = merged["specdec:request_success"].samples
    assert [(s.labels["arm"], s.value) for s in success] == [("spec", 1.0)]
    assert all("replica" not in s.labels for s in success)


def test_single_process_server_does_not_import_ray():
    code = (
        "import sys\n"
        "import specdec.api.cli as cli\n"
        "cli.build_parser()\n"
        "import specdec.api.app, specdec.api.commands.serve, specdec.api.cluster.options\n"
        "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cluster_without_ray_says_how_to_install_it():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if the extra were not installed\n"
        "from specdec.api.cli import main\n"
        "sys.exit(main(['cluster', '--model', 'm']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'specdec[cluster]'" in r.stderr
