"""Device-check stage for the whole engine loop: throughput of plain decode, fixed-k speculation
and the adaptive controller at a large batch, side by side in one process.

With random weights the draft almost never agrees with the target (acceptance near 0), which is
the case the issue's batch-64 target is about: speculation cannot pay, so the controller must
find that out (from its start-up calibration and the first verifies) and stay within 3% of plain,
while fixed k pays the full price of drafting and verifying.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.loader import LoadedModel
from specdec.engine.models import ModelArch
from specdec.engine.models.decoder import DecoderLM
from specdec.engine.sampling_params import SamplingParams
from specdec.evals.gpu_check.context import CheckContext
from specdec.evals.gpu_check.models import arch_for, random_model

ARMS = {"plain": "off", "fixed_k": "on", "adaptive": "auto"}

Named = tuple[str, ModelArch, DecoderLM]  # (shape name, architecture, model)


def random_model_engine(ctx: CheckContext, target: Named, draft: Named, **config: Any) -> LLMEngine:
    """An `LLMEngine` on the check's device over already built models (k_max 4; FlashInfer on
    the GPU, torch on the CPU); ``config`` sets the sizes."""
    cfg = EngineConfig(
        model=f"random-{target[0]}",
        draft_model=f"random-{draft[0]}",
        device=ctx.device.type,
        dtype="bfloat16" if ctx.dtype == torch.bfloat16 else "float32",
        attention_backend="flashinfer" if ctx.use_flashinfer else "torch",
        page_size=ctx.page_size,
        num_speculative_tokens=4,
        **config,
    )
    return LLMEngine(
        cfg,
        target=LoadedModel(Path("."), target[1], target[2], None, 0.0),
        draft=LoadedModel(Path("."), draft[1], draft[2], None, 0.0),
        progress=False,
    )


def _device_memory_now(ctx: CheckContext) -> dict[str, int] | None:
    """Free device bytes and torch's allocator counters; resets torch's peak counter."""
    if ctx.device.type != "cuda":
        return None
    torch.cuda.synchronize(ctx.device)
    now = {
        "free": torch.cuda.mem_get_info(ctx.device)[0],
        "torch_reserved": torch.cuda.memory_reserved(ctx.device),
        "torch_allocated": torch.cuda.memory_allocated(ctx.device),
        "torch_peak_allocated": torch.cuda.max_memory_allocated(ctx.device),
    }
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return now


def _graph_pool_free_bytes(device: torch.device) -> int:
    """Bytes reserved by private (CUDA-graph) pools on ``device`` that no live tensor holds."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(
        seg["total_size"] - seg["allocated_size"]
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device") == index and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def _runtime_memory(
    ctx: CheckContext, engine: LLMEngine, before: dict[str, int] | None
) -> dict[str, Any] | None:
    """What the engine took beyond its KV pools (its models were built before it) once all of its
    steps ran, against the estimate it set aside (`specdec.engine.device_memory`). torch's counters tell
    its caching allocator (blocks it holds, peak of live tensors, graph captures included) from
    allocations outside it."""
    after = _device_memory_now(ctx)
    if before is None or after is None:
        return None
    runners = [engine.target_runner, engine.proposer.runner]
    kv = sum(k.nbytes + v.nbytes for r in runners for k, v in r.kv.layers)
    taken = before["free"] - after["free"] - kv
    torch_reserved = after["torch_reserved"] - before["torch_reserved"] - kv
    peak_live = after["torch_peak_allocated"] - before["torch_allocated"] - kv
    # Blocks torch's allocator caches but no tensor holds are handed back when an allocation
    # would otherwise fail, so what the engine needs is its peak of live tensors, plus the free
    # part of the CUDA graphs' private pools (kept for replays), plus what was allocated outside
    # torch (library handles, loaded kernels, graph executables).
    pools = _graph_pool_free_bytes(ctx.device)
    needed = peak_live + pools + (taken - torch_reserved)
    estimated = engine.runtime_reserve_bytes
    return {
        "kv_pool_bytes": kv,
        "taken_bytes": taken,
        "torch_reserved_bytes": torch_reserved,
        "torch_allocated_now_bytes": after["torch_allocated"] - before["torch_allocated"] - kv,
        "torch_peak_live_bytes": peak_live,
        "graph_pool_free_bytes": pools,
        "needed_bytes": needed,
        "estimated_bytes": estimated,
        "needed_vs_estimated": needed / estimated if estimated else None,
        "taken_vs_estimated": taken / estimated if estimated else None,
        "pass": needed <= estimated,
    }


class _ControllerClock:
    """Adds up the host seconds an engine spends in its policy's per-step calls (``decide`` and
    ``observe``), all on the step's critical path; ``overlap_seconds`` stays 0 (the policy does no
    work while the device runs the target forward)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self.overlap_seconds = 0.0
        policy = engine.policy
        for name in ("decide", "observe"):
            setattr(policy, name, self._timed(name, getattr(policy, name)))

    def reset(self) -> None:
        self.seconds = self.overlap_seconds = 0.0

    def _timed(self, name: str, fn):
        overlapped = False

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if overlapped:
                    self.overlap_seconds += time.perf_counter() - t0
                else:
                    self.seconds += time.perf_counter() - t0

        return timed


class _GcClock:
    """Adds up the seconds Python's cyclic garbage collector pauses the process, and counts its
    collections of the oldest generation (the ones that scan the whole heap)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full_collections = 0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def reset(self) -> None:
        self.seconds, self.full_collections = 0.0, 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full_collections += info.get("generation") == 2


def stage_engine_controller(ctx: CheckContext) -> dict[str, Any]:
    """Generate a batch of requests per arm, arms interleaved over rounds; tokens per second of
    wall time, median over rounds. The controller is calibrated at engine start, as in serving."""
    smoke = ctx.cpu_smoke
    t_shape, d_shape = ctx.target_shape, ctx.draft_shape
    batch = 4 if smoke else ctx.engine_batch
    prompt_len, out_len = (8, 8) if smoke else (64, ctx.engine_tokens)
    t_arch = arch_for(t_shape)
    d_arch = arch_for(d_shape, vocab_size=t_arch.vocab_size)
    target = random_model(t_arch, ctx.dtype, ctx.device, seed=21)
    draft = random_model(d_arch, ctx.dtype, ctx.device, seed=22)
    memory_before = _device_memory_now(ctx)
    start = time.perf_counter()
    engine = random_model_engine(
        ctx,
        (t_shape, t_arch, target),
        (d_shape, d_arch, draft),
        num_kv_blocks=batch * (-(-(prompt_len + out_len + 16) // ctx.page_size)) + 64,
        max_model_len=prompt_len + out_len + 16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(512, batch * prompt_len),
        controller_warmup=True,
    )
    setup_s = time.perf_counter() - start
    rng = random.Random(23)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    engine.generate([[1, 2, 3]], params, speculative="off")  # first-step allocations

    tok_per_s: dict[str, list[float]] = {arm: [] for arm in ARMS}
    per_step: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    if ctx.engine_gc_freeze:
        # What a serving process can do once at start-up: the heap built so far (models,
        # graphs, tokenizer tables) lives as long as the engine, so full collections skip it.
        gc.collect()
        gc.freeze()
    host = _ControllerClock(engine)
    gc_clock = _GcClock()
    controller_stats: list[dict[str, Any]] = []
    rounds = 1 if smoke else ctx.engine_rounds
    for r in range(rounds):
        if r and ctx.remaining() < 20:
            break
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            prompts = [
                [rng.randrange(t_arch.vocab_size) for _ in range(prompt_len)] for _ in range(batch)
            ]
            accepted_before = engine.spec_stats.num_accepted_tokens
            steps_before, graphs_before = engine.num_steps, engine.target_runner.num_graph_runs
            host.reset()
            gc_clock.reset()
            _sync(ctx)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, speculative=ARMS[arm])
            _sync(ctx)
            wall = time.perf_counter() - t0
            tokens = sum(len(o.output_token_ids) for o in outs)
            tok_per_s[arm].append(tokens / wall)
            steps = max(1, engine.num_steps - steps_before)
            per_step[arm].append(
                {
                    "steps": steps,
                    "wall_ms": wall / steps * 1e3,
                    "controller_ms": host.seconds / steps * 1e3,
                    "controller_overlapped_ms": host.overlap_seconds / steps * 1e3,
                    "gc_ms": gc_clock.seconds / steps * 1e3,
                    "gc_full_collections": gc_clock.full_collections,
                    "target_graph_replays": engine.target_runner.num_graph_runs - graphs_before,
                }
            )
            if arm == "adaptive":
                s = engine.policy.stats()
                controller_stats.append(
                    {
                        "round": r,
                        "accepted_tokens": engine.spec_stats.num_accepted_tokens - accepted_before,
                        **{k: v for k, v in s.items() if k != "acceptance_by_request"},
                    }
                )
            st = per_step[arm][-1]
            ctx.log(
                f"  engine batch {batch} round {r} {arm}: {tokens / wall:.1f} tok/s, "
                f"{st['wall_ms']:.2f} ms/step over {st['steps']} steps "
                f"({st['target_graph_replays']} graph replays), controller "
                f"{st['controller_ms']:.3f} ms/step (+{st['controller_overlapped_ms']:.3f} "
                f"overlapping the forward), gc {st['gc_ms']:.3f} ms/step "
                f"({st['gc_full_collections']} full)"
            )
    gc_clock.close()
    if ctx.engine_gc_freeze:
        gc.unfreeze()
    medians = {arm: statistics.median(v) for arm, v in tok_per_s.items() if v}
    ratio = medians["adaptive"] / medians["plain"]
    free_ok = engine.allocator.num_free_blocks == engine.allocator.num_blocks
    draft_runner = engine.proposer.runner
    graph_runs = {
        "target": engine.target_runner.num_graph_runs,
        "draft": draft_runner.num_graph_runs,
        "draft_forwards": engine.proposer.num_forwards,
    }
    kernels = type(engine.sampling_kernels).__name__
    engine_steps = engine.num_steps
    memory = _runtime_memory(ctx, engine, memory_before)
    del engine
    ctx.free_memory()
    return {
        "target_shape": t_shape,
        "draft_shape": d_shape,
        "batch": batch,
        "prompt_len": prompt_len,
        "output_tokens": out_len,
        "engine_setup_s_incl_calibration": setup_s,
        "tok_per_s": tok_per_s,
        "per_step": per_step,
        "gc_frozen_at_start": ctx.engine_gc_freeze,
        "median_gc_ms_per_step": {
            arm: statistics.median(r["gc_ms"] for r in v) for arm, v in per_step.items() if v
        },
        "median_controller_ms_per_step": {
            arm: statistics.median(r["controller_ms"] for r in v)
            for arm, v in per_step.items()
            if v
        },
        "median_tok_per_s": medians,
        "adaptive_vs_plain": ratio,
        "fixed_k_vs_plain": medians["fixed_k"] / medians["plain"],
        "controller": controller_stats,
        "graph_runs": graph_runs,
        "sampling_kernels": kernels,
        "engine_steps": engine_steps,
        "kv_blocks_all_free_after": free_ok,
        "runtime_memory": memory,
        "pass": ratio >= 0.97 and free_ok,
    }


def _sync(ctx: CheckContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
