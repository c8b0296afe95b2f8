"""Benchmark of `specdec cluster` on one machine: what the ingress and router cost per request
against the single-process server, and the prefix-cache hit rate of prefix-affine routing
against Serve's default policy on a shared-prefix workload.

Tiny random-weight model (no tokenizer; prompts are token ids), so the numbers isolate the
serving path: HTTP, the ingress, Ray Serve's handle and router, the replica's stream. Model
compute is the same in every arm, a few milliseconds.

    python -m specdec.evals.cluster_bench --out docs/results/cluster

1. Overhead: the single server and clusters of 1 and 2 replicas run side by side; requests go
   to them in turn (interleaved, so machine drift hits every arm alike), one at a time:
   a 1-token completion (the fixed cost per request) and a 32-token stream (adds the cost per
   streamed output). Medians over ``--rounds``.
2. Prefix hit rate: two 2-replica clusters, ``--routing prefix`` and ``--routing pow2``, each
   get the same request sequence (``--groups`` shared prefixes of ``--prefix-blocks`` full KV
   blocks, a distinct suffix each, groups drawn at random), ``--concurrency`` at a time. Each
   replica's KV pool (``--kv-blocks``) holds about half the groups' prefixes: routed by prefix,
   a replica sees half the groups and keeps them; spread at random, each sees all and evicts.
   Hit rate = prompt tokens served from the prefix cache / prompt tokens looked up, summed over
   replicas (the engine's own counters).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PAGE = 16
ENGINE = dict(
    device="cpu", dtype="float32", num_threads=1, page_size=PAGE, max_model_len=512,
    max_num_seqs=8, max_num_batched_tokens=512, speculative_method="none",
    controller_warmup=False,
)  # fmt: skip


def build_model(path: Path, vocab: int = 512) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))


def cpu_flags() -> list[str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return []
    for line in out.splitlines():
        if line.startswith("Flags:"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    return []


def completion(client: httpx.Client, prompt: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True})  # fmt: skip
    r.raise_for_status()
    return time.perf_counter() - t0


def stream(client: httpx.Client, prompt: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]", lines[-1]
    return time.perf_counter() - t0


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median_ms": 1000 * statistics.median(ordered),
        "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
        "n": len(ordered),
    }


def overhead(urls: dict[str, str], rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    clients = {arm: httpx.Client(base_url=url, timeout=60) for arm, url in urls.items()}
    times: dict[str, dict[str, list[float]]] = {a: {"1_token": [], "stream_32": []} for a in urls}
    for c in clients.values():  # warm-up: first requests pay lazy set-up
        for _ in range(3):
            completion(c, [rng.randrange(2, 500) for _ in range(32)], 1)
    for _ in range(rounds):
        prompt = [rng.randrange(2, 500) for _ in range(32)]  # the same prompt for every arm
        arms = list(clients)
        rng.shuffle(arms)
        for arm in arms:
            times[arm]["1_token"].append(completion(clients[arm], prompt, 1))
            times[arm]["stream_32"].append(stream(clients[arm], [7, *prompt], 32))
    for c in clients.values():
        c.close()
    result = {arm: {kind: _summary(v) for kind, v in kinds.items()} for arm, kinds in times.items()}
    base = result["single"]
    for kinds in result.values():
        for kind, s in kinds.items():
            s["extra_ms_vs_single"] = s["median_ms"] - base[kind]["median_ms"]
    return result


def shared_prefix_workload(
    groups: int, prefix_blocks: int, requests: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 500) for _ in range(prefix_blocks * PAGE)] for _ in range(groups)]
    return [
        prefixes[rng.randrange(groups)] + [rng.randrange(2, 500) for _ in range(PAGE)]
        for _ in range(requests)
    ]


def run_workload(url: str, prompts: list[list[int]], concurrency: int) -> float:
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while True:
                with lock:
                    if not queue:
                        return
                    _, prompt = queue.pop(0)
                try:
                    completion(c, prompt, 4)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:3]}")
    return time.perf_counter() - t0


def hit_rates(url: str) -> dict:
    time.sleep(1.5)  # one more report period, so every replica's counters are in
    health = httpx.get(f"{url}/health", timeout=30).json()
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    per: dict[str, dict[str, float]] = {}
    for line in metrics.splitlines():
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            if line.startswith(f"specdec:{name}{{"):
                replica = line.split('replica="', 1)[1].split('"', 1)[0]
                per.setdefault(replica, {})[name] = float(line.rsplit(" ", 1)[1])
    queries = sum(p.get("prefix_cache_queries_total", 0.0) for p in per.values())
    hits = sum(p.get("prefix_cache_hits_total", 0.0) for p in per.values())
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens_looked_up": queries,
        "prompt_tokens_hit": hits,
        "per_replica": {
            r: p.get("prefix_cache_hits_total", 0.0) / p["prefix_cache_queries_total"]
            for r, p in sorted(per.items())
            if p.get("prefix_cache_queries_total")
        },
        "replicas": len(health["replicas"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/results/cluster"))
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-blocks", type=int, default=12)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import ray
    from ray import serve
    from specdec.api.cluster.background import BackgroundCluster
    from specdec.api.cluster.options import ClusterOptions
    from specdec.api.settings import ServerSettings
    from specdec.engine.config import EngineConfig
    from specdec.evals.environment import environment_info, git_commit

    tmp = Path(tempfile.mkdtemp(prefix="cluster_bench_"))
    model = tmp / "tiny"
    build_model(model)
    settings = ServerSettings(served_model_names=("tiny",))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    started: list[BackgroundCluster] = []
    single = None

    def cluster(replicas: int, routing: str, kv_blocks: int) -> BackgroundCluster:
        config = EngineConfig(model=str(model), num_kv_blocks=kv_blocks, **ENGINE)
        options = ClusterOptions(replicas=replicas, routing=routing, replica_cpus=0.5,
                                 stats_period_s=0.5)  # fmt: skip
        c = BackgroundCluster(config, settings, options).start()
        started.append(c)
        return c

    try:
        from specdec.api.cluster.background import free_port

        port = free_port()
        flags = [f"--{k.replace('_', '-')}" for k in ENGINE]
        cmd = [sys.executable, "-m", "specdec.api.cli", "--log-level", "WARNING", "serve",
               "--model", str(model), "--port", str(port), "--num-kv-blocks", "256",
               "--no-controller-warmup"]  # fmt: skip
        for flag, value in zip(flags, ENGINE.values(), strict=True):
            if not isinstance(value, bool):
                cmd += [flag, str(value)]
        single = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        one = cluster(1, "prefix", 256)
        two = cluster(2, "prefix", 256)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or single.poll() is not None:
                raise RuntimeError("the single server did not start")
            time.sleep(0.2)
        urls = {"single": f"http://127.0.0.1:{port}", "cluster_1": one.url, "cluster_2": two.url}
        over = overhead(urls, args.rounds, args.seed)
        for c in (one, two):
            c.stop()
        started.clear()
        single.terminate()
        single.wait(30)

        prompts = shared_prefix_workload(args.groups, args.prefix_blocks, args.requests, args.seed)
        arms = {
            "prefix": cluster(2, "prefix", args.kv_blocks),
            "pow2": cluster(2, "pow2", args.kv_blocks),
        }
        routing: dict[str, dict] = {}
        for name, c in arms.items():
            seconds = run_workload(c.url, prompts, args.concurrency)
            routing[name] = {"seconds": seconds, **hit_rates(c.url)}
    finally:
        for c in started:
            c.stop()
        if single is not None and single.poll() is None:
            single.kill()
        serve.shutdown()
        ray.shutdown()

    result = {
        "meta": {
            "command": "python -m specdec.evals.cluster_bench " + " ".join(argv or sys.argv[1:]),
            "commit": git_commit(),
            "environment": environment_info(),
            "cpu_flags": cpu_flags(),
            "model": "tiny random Qwen2 (2 layers, hidden 128, vocab 512), fp32, 1 torch thread "
            "per engine, no speculation",
            "ray": ray.__version__,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        },
        "overhead": over,
        "prefix_routing": routing,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "cluster_bench.md").write_text(render(result))
    print(render(result))
    return 0


def render(result: dict) -> str:
    meta = result["meta"]
    env = meta["environment"]
    lines = [
        "# `specdec cluster` on one machine: ingress overhead and prefix-affine routing",
        "",
        f"Command: `{meta['command']}` at commit {meta['commit']}; {env['cpu']} "
        f"({env['cpu_count']} cores; {', '.join(meta['cpu_flags'])}), Ray {meta['ray']}, "
        f"{meta['model']}.",
        "",
        "## Time per request, one request at a time (medians, interleaved arms)",
        "",
        "| arm | 1-token completion ms | extra vs single | 32-token stream ms | extra vs single |",
        "|---|---|---|---|---|",
    ]
    for arm, kinds in result["overhead"].items():
        a, b = kinds["1_token"], kinds["stream_32"]
        lines.append(
            f"| {arm} | {a['median_ms']:.1f} (p90 {a['p90_ms']:.1f}) | "
            f"{a['extra_ms_vs_single']:+.1f} | {b['median_ms']:.1f} (p90 {b['p90_ms']:.1f}) | "
            f"{b['extra_ms_vs_single']:+.1f} |"
        )
    args = meta["args"]
    lines += [
        "",
        f"## Prefix-cache hit rate: {args['requests']} requests, {args['groups']} shared prefixes "
        f"of {args['prefix_blocks']} blocks x {PAGE} tokens, concurrency {args['concurrency']}, "
        f"2 replicas of {args['kv_blocks']} KV blocks each",
        "",
        "| routing | hit rate (prompt tokens) | per replica | wall s |",
        "|---|---|---|---|",
    ]
    for name, r in result["prefix_routing"].items():
        per = ", ".join(f"{v:.2f}" for v in r["per_replica"].values())
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {per} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
