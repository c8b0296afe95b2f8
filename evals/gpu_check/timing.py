"""Device-check timing stages: HBM copy bandwidth, plain decode vs k-draft verify steps, draft
steps, and end-to-end time per output token with an oracle draft at a controlled acceptance rate.

Step times are medians of CUDA-event intervals around plan + buffer copies + graph replay (the
host work a real step needs), with replay-only medians beside them. The oracle loop runs the real
kernels of each step (k graphed draft steps with sampling, one graphed verify, the verification
kernel, one host read of its result, as the engine does) but draws each sequence's accepted count
from the acceptance rate: P(j accepted) = a^j (1 - a) for j < k, a^k for j = k, so the expected
tokens per step are (1 - a^(k+1)) / (1 - a). Simplification: the draft runs k one-row steps per
verify; the engine's first draft step also catches up on the previous step's last token.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from specdec.engine.cuda_graphs import GraphedForward
from specdec.engine.gpu_sampling import verify_drafts
from specdec.evals.gpu_check.context import CheckContext
from specdec.evals.gpu_check.models import (
    Timer,
    arch_for,
    contiguous_tables,
    eager_step,
    hbm_copy_bandwidth,
    kv_bytes_per_token,
    make_pool,
    random_model,
)

TARGET_SEED = 21  # the random target's weights (the fp8 stage builds the same model again)


def stage_bandwidth(ctx: CheckContext) -> dict[str, Any]:
    gib, iters = (0.05, 3) if ctx.cpu_smoke else (4.0, 20)
    return {**hbm_copy_bandwidth(ctx.device, gib, iters), "pass": True}


class Rig:
    """Target and draft with their pools, block tables and (on CUDA) captured graphs."""

    def __init__(self, ctx: CheckContext) -> None:
        self.ctx = ctx
        page = ctx.page_size
        self.t_arch = arch_for(ctx.target_shape)
        self.d_arch = arch_for(ctx.draft_shape, vocab_size=self.t_arch.vocab_size)
        self.target = ctx.fast_model(
            random_model(self.t_arch, ctx.dtype, ctx.device, seed=TARGET_SEED)
        )
        self.draft = ctx.fast_model(random_model(self.d_arch, ctx.dtype, ctx.device, seed=22))
        max_b, max_k = max(ctx.batch_sizes + ctx.tree_batch_sizes), max(ctx.ks)
        new_rows = max((ctx.e2e_steps + 2) * (max_k + 1), max(ctx.tree_nodes, default=0) + 1)
        max_tokens = ctx.context_len + new_rows + page
        pages = -(-max_tokens // page)
        num_blocks = max_b * pages + 1  # the last block is the graphs' scratch block
        self.tables = contiguous_tables(max_b, max_tokens, page)
        self.t_kv = make_pool(self.t_arch, num_blocks, page, ctx.dtype, ctx.device, seed=23)
        self.d_kv = make_pool(self.d_arch, num_blocks, page, ctx.dtype, ctx.device, seed=24)
        self.t_backend = ctx.attention_backend(self.t_arch)
        self.d_backend = ctx.attention_backend(self.d_arch)
        self.t_graphs: GraphedForward | None = None
        self.d_graphs: GraphedForward | None = None
        if ctx.device.type == "cuda":
            start = time.perf_counter()
            scratch = [num_blocks - 1]
            self.t_graphs = GraphedForward(
                self.target, self.t_kv.layers, self.t_backend, page, pages, scratch, ctx.dtype
            )
            self.t_graphs.capture(ctx.batch_sizes, [1] + [k + 1 for k in ctx.ks])
            self.d_graphs = GraphedForward(
                self.draft, self.d_kv.layers, self.d_backend, page, pages, scratch, ctx.dtype
            )
            self.d_graphs.capture(ctx.batch_sizes, [1])
            self.capture_seconds = time.perf_counter() - start

    def target_step(self, ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        tables = self.tables[: len(ids)]
        if self.t_graphs is not None:
            return self.t_graphs.run(ids, starts, tables)
        return eager_step(
            self.target, self.t_kv, self.t_backend, self.ctx.page_size, ids, starts, tables
        )

    def draft_step(self, ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        tables = self.tables[: len(ids)]
        if self.d_graphs is not None:
            return self.d_graphs.run(ids, starts, tables)
        return eager_step(
            self.draft, self.d_kv, self.d_backend, self.ctx.page_size, ids, starts, tables
        )


def get_rig(ctx: CheckContext) -> Rig:
    if "rig" not in ctx.cache:
        ctx.cache["rig"] = Rig(ctx)
    return ctx.cache["rig"]


def stage_step_timing(ctx: CheckContext) -> dict[str, Any]:
    rig = get_rig(ctx)
    timer, iters, ctx_len = Timer(ctx.device), ctx.iters, ctx.context_len
    bandwidth = ctx.results.get("stages", {}).get("bandwidth", {}).get("gb_per_s")
    weight_bytes = rig.target.weight_bytes()  # what one decode step reads, embeddings aside
    kv_token = kv_bytes_per_token(rig.t_arch, ctx.dtype)
    rows = []
    for batch in ctx.batch_sizes:
        starts = [ctx_len] * batch

        def target(q_len: int, b: int = batch, s: list[int] = starts) -> torch.Tensor:
            return rig.target_step([[1] * q_len] * b, s)

        def draft(b: int = batch, s: list[int] = starts) -> torch.Tensor:
            return rig.draft_step([[1]] * b, s)

        row: dict[str, Any] = {"batch": batch}
        row["decode_ms"] = timer.median_ms(lambda: target(1), iters)
        row["draft_step_ms"] = timer.median_ms(draft, iters)
        row["verify_ms"] = {}
        for k in ctx.ks:
            row["verify_ms"][k] = timer.median_ms(lambda q=k + 1: target(q), iters)
        graphs = rig.t_graphs
        if graphs is not None:  # the same steps without the host half (plan, copies)
            replay = {}
            for q_len in [1] + [k + 1 for k in ctx.ks]:
                shape = graphs.prepare([[1] * q_len] * batch, starts, rig.tables[:batch])
                replay[q_len - 1] = timer.median_ms(lambda sh=shape, g=graphs: g.replay(*sh), iters)
            row["replay_only_ms_by_k"] = replay
        if bandwidth:
            read = weight_bytes + batch * (ctx_len + 1) * kv_token
            row["roofline_ms"] = read / (bandwidth * 1e9) * 1e3
            row["decode_vs_roofline"] = row["decode_ms"] / row["roofline_ms"]
        row["verify_vs_decode"] = {k: v / row["decode_ms"] for k, v in row["verify_ms"].items()}
        rows.append(row)
        ctx.log(f"  batch {batch}: decode {row['decode_ms']:.3f} ms, verify {row['verify_ms']}")
    out: dict[str, Any] = {
        "target_shape": ctx.target_shape,
        "draft_shape": ctx.draft_shape,
        "context_len": ctx_len,
        "target_weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_token,
        "rows": rows,
        "pass": True,
    }
    if rig.t_graphs is not None:
        out["capture_seconds"] = rig.capture_seconds
        b = min(ctx.batch_sizes)
        starts = [ctx_len] * b
        out[f"eager_decode_ms_batch_{b}"] = timer.median_ms(
            lambda: eager_step(
                rig.target,
                rig.t_kv,
                rig.t_backend,
                ctx.page_size,
                [[1]] * b,
                starts,
                rig.tables[:b],
            ),
            max(5, iters // 3),
        )
    return out


def _oracle_accepted(rng: random.Random, a: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def stage_e2e(ctx: CheckContext) -> dict[str, Any]:
    """Time per output token: plain decode vs speculation with an oracle draft."""
    rig = get_rig(ctx)
    kernels = ctx.sampling_kernels()
    steps, ctx_len, vocab = ctx.e2e_steps, ctx.context_len, rig.t_arch.vocab_size
    rng = random.Random(31)
    results: list[dict[str, Any]] = []
    timer = Timer(ctx.device)
    for batch in ctx.batch_sizes:
        none, no = [None] * batch, [False] * batch
        starts = [ctx_len] * batch
        timer.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            probs = torch.softmax(rig.target_step([[1]] * batch, starts), dim=-1)
            kernels.sample(probs).tolist()  # the engine's one read per step
            starts = [s + 1 for s in starts]
        timer.sync()
        plain = (time.perf_counter() - t0) / steps * 1e3
        results.append({"batch": batch, "k": 0, "accept": None, "tpot_ms": plain})
        for k in ctx.ks:
            for a in ctx.accept_rates:
                if ctx.remaining() < 30:
                    return {"rows": results, "partial": True, "pass": True}
                starts, emitted = [ctx_len] * batch, [0] * batch
                timer.sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    d_probs, d_ids = [], []
                    for j in range(k):
                        logits = rig.draft_step([[1]] * batch, [s + j for s in starts])
                        p = torch.softmax(logits, dim=-1)
                        d_probs.append(p)
                        d_ids.append(kernels.sample(p))
                    t_logits = rig.target_step([[1] * (k + 1)] * batch, starts)
                    t_probs = torch.softmax(t_logits, dim=-1).view(batch, k + 1, vocab)
                    res = verify_drafts(
                        t_probs,
                        torch.stack(d_ids, 1),
                        torch.stack(d_probs, 1),
                        [k] * batch,
                        no,
                        none,
                        [ctx_len] * batch,
                        kernels,
                    )
                    res.num_accepted.tolist()
                    for b in range(batch):
                        n = _oracle_accepted(rng, a, k) + 1
                        starts[b] += n
                        emitted[b] += n
                timer.sync()
                wall = time.perf_counter() - t0
                tokens = sum(emitted) / batch
                results.append(
                    {
                        "batch": batch,
                        "k": k,
                        "accept": a,
                        "tpot_ms": wall / tokens * 1e3,
                        "step_ms": wall / steps * 1e3,
                        "tokens_per_step": tokens / steps,
                        "speedup_vs_plain": plain / (wall / tokens * 1e3),
                    }
                )
        ctx.log(f"  e2e batch {batch}: plain {plain:.3f} ms/token")
    return {"rows": results, "steps": steps, "pass": True}


def stage_kernel_profile(ctx: CheckContext) -> dict[str, Any]:
    """Where a batch-1 target decode step's GPU time goes: kernels of eager steps (the same
    kernels a graph replays, without the launch gaps) by total time, and kernels per step."""
    rig = get_rig(ctx)
    steps, starts = 5, [ctx.context_len]

    def step() -> None:
        eager_step(
            rig.target, rig.t_kv, rig.t_backend, ctx.page_size, [[1]], starts, rig.tables[:1]
        )

    for _ in range(2):
        step()
    Timer(ctx.device).sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        Timer(ctx.device).sync()
    rows = []
    for ev in prof.key_averages():
        device_us = getattr(ev, "device_time_total", 0.0) or 0.0
        if ev.device_type == torch.autograd.DeviceType.CUDA and device_us > 0:
            rows.append({"kernel": ev.key[:120], "calls": ev.count, "total_us": device_us})
    rows.sort(key=lambda r: -r["total_us"])
    total = sum(r["total_us"] for r in rows)
    calls = sum(r["calls"] for r in rows)
    for r in rows:
        r["us_per_step"] = r["total_us"] / steps
        r["calls_per_step"] = r["calls"] / steps
    return {
        "steps": steps,
        "kernel_us_per_step": total / steps,
        "kernels_per_step": calls / steps,
        "top": rows[:25],
        "pass": True,
    }
