"""The serving benchmark: the same workload per arm and load level, against a running server."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import httpx
from specdec.engine.errors import SpecdecError
from specdec.evals.bench_report import request_dict
from specdec.evals.datasets import Prompt
from specdec.evals.loadgen import LoadSpec, run_load
from specdec.evals.metrics import RequestRecord, aggregate
from specdec.evals.sse_client import RequestSpec, send_request


class ServerUnreachableError(SpecdecError):
    """The server did not answer (not running, wrong address, not ready)."""

    status_code = 503


@dataclass(frozen=True)
class Arm:
    name: str  # "spec" | "plain" | "default"
    speculative: str | None  # the per-request field sent; None sends none (server default)


@dataclass
class BenchConfig:
    base_url: str
    request: RequestSpec
    arms: list[Arm]
    loads: list[LoadSpec]
    warmup: int = 1
    prime_cache: bool = True
    slo: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    request_timeout: float = 600.0
    connect_timeout: float = 10.0


def choose_arms(ab: bool, speculative: str | None) -> list[Arm]:
    """--ab: the spec arm (auto unless --speculative on) and the plain arm (off)."""
    if ab:
        spec_mode = speculative if speculative in ("auto", "on") else "auto"
        return [Arm("spec", spec_mode), Arm("plain", "off")]
    if speculative is None:
        return [Arm("default", None)]
    return [Arm("plain" if speculative == "off" else "spec", speculative)]


def probe_server(base_url: str, timeout: float) -> list[str]:
    """Model ids the server lists; raise ServerUnreachableError with what to do when it cannot."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(
            f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc or 'no answer'}); "
            f"start it with `specdec serve` or pass the right --base-url"
        ) from None
    if response.status_code != 200:
        raise ServerUnreachableError(
            f"the server at {base_url} answered GET /v1/models with HTTP {response.status_code}"
            f" ({response.text[:200]}); is it still loading?"
        )
    try:
        return [m["id"] for m in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ServerUnreachableError(
            f"{url} did not return an OpenAI model list; is {base_url} a specdec server?"
        ) from None


def select_prompts(pool: Sequence[Prompt], n: int) -> list[Prompt]:
    """``n`` prompts taking categories in turn (so a short run covers them all), cycling when
    the pool is smaller than ``n``."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in pool:
        by_cat.setdefault(p.category, []).append(p)
    interleaved: list[Prompt] = []
    for i in range(max(len(v) for v in by_cat.values())):
        interleaved += [v[i] for v in by_cat.values() if i < len(v)]
    return [interleaved[i % len(interleaved)] for i in range(n)]


async def _run_all(cfg: BenchConfig, prompts: Sequence[Prompt], progress: bool) -> list[dict]:
    from tqdm import tqdm

    timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits) as client:
        # Every arm and load level sees the same prefix-cache state: each prompt once, untimed.
        if cfg.prime_cache:
            prime = replace(cfg.request, max_tokens=1, speculative=cfg.arms[0].speculative)
            for p in dict.fromkeys(prompts):
                await send_request(client, prime, p)
        for arm in cfg.arms:
            spec = replace(cfg.request, speculative=arm.speculative)
            for i in range(cfg.warmup):
                await send_request(client, spec, prompts[i % len(prompts)], cfg.seed + i)
        runs = []
        for load in cfg.loads:
            for arm in cfg.arms:
                spec = replace(cfg.request, speculative=arm.speculative)
                bar = tqdm(
                    total=len(prompts),
                    desc=f"{arm.name} {load.label()}",
                    unit="req",
                    disable=not progress,
                )

                async def send(prompt: Prompt, index: int, spec=spec) -> RequestRecord:
                    return await send_request(client, spec, prompt, cfg.seed + index)

                records, duration = await run_load(
                    send, prompts, load, cfg.seed, on_done=lambda _, bar=bar: bar.update()
                )
                bar.close()
                runs.append(_run_dict(arm, load, records, prompts, duration, cfg))
        return runs


def _run_dict(
    arm: Arm,
    load: LoadSpec,
    records: Sequence[RequestRecord],
    prompts: Sequence[Prompt],
    duration: float,
    cfg: BenchConfig,
) -> dict:
    return {
        "arm": arm.name,
        "speculative": arm.speculative,
        "concurrency": load.concurrency,
        "request_rate": load.request_rate if math.isfinite(load.request_rate) else None,
        "burstiness": load.burstiness,
        "server_arms": dict(Counter(r.arm or "unreported" for r in records)),
        "metrics": aggregate(records, duration, cfg.slo),
        "requests": [request_dict(p.id, r) for p, r in zip(prompts, records, strict=True)],
    }


def run_bench(cfg: BenchConfig, prompts: Sequence[Prompt], progress: bool = True) -> list[dict]:
    """Run every load level x arm; return one dict per run (metrics + per-request rows)."""
    return asyncio.run(_run_all(cfg, prompts, progress))
