"""Load generation: when each request is sent, and how many may be in flight.

Two ways to load a server, combinable: a fixed concurrency (N clients, each sending its next
request as soon as the previous one finishes), and an arrival process at ``request_rate``
requests/s whose gaps are Gamma-distributed with shape ``burstiness`` and mean 1/rate
(burstiness 1 is a Poisson process; below 1 arrivals bunch up, above 1 they even out). With a
rate, ``concurrency`` caps the requests in flight; an infinite rate sends everything at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
from specdec.evals.datasets import Prompt
from specdec.evals.metrics import RequestRecord


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = 1  # None: no cap
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0  # Gamma shape of the inter-arrival times

    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency={self.concurrency}")
        if math.isfinite(self.request_rate):
            parts.append(f"rate={self.request_rate:g}/s")
            if self.burstiness != 1.0:
                parts.append(f"burstiness={self.burstiness:g}")
        return ", ".join(parts) or "all at once"


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests; all 0 for an infinite rate."""
    if n <= 0:
        return []
    if not math.isfinite(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    # Gamma(shape=b, scale=1/(rate*b)) has mean 1/rate for every b; the first request goes at 0.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


Sender = Callable[[Prompt, int], Awaitable[RequestRecord]]
"""(prompt, request index) -> the finished request's record."""


async def run_load(
    send: Sender,
    prompts: Sequence[Prompt],
    load: LoadSpec,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every prompt under ``load``; return records in prompt order and the wall duration
    from the first send to the last completion."""
    offsets = arrival_offsets(len(prompts), load.request_rate, load.burstiness, seed)
    limit = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    start = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        delay = start + offsets[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            record = await send(prompts[index], index)
        else:
            async with limit:
                record = await send(prompts[index], index)
        if on_done is not None:
            on_done(record)
        return record

    records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return list(records), time.perf_counter() - start
