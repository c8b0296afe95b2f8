"""The GPU path's single device check: FlashInfer parity, CUDA-graph parity, sampling kernels,
greedy speculative == plain, step timings and oracle end-to-end time per token.

    python -m specdec.evals.gpu_check OUT_DIR            # on a CUDA machine (evals/gpu_check/gpu_check.sh wraps it)
    python -m specdec.evals.gpu_check OUT_DIR --cpu-smoke  # CPU-side parts at tiny shapes, torch path

It runs its stages in order under a time budget (default 450 s, for an 8-minute device slot),
skipping what no longer fits; each stage's result (or its error) is written to
``OUT_DIR/gpu_check_<date>_<device>.json`` as soon as it finishes, so a run cut short still leaves
its numbers. The last thing printed is a table of the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from specdec.evals.environment import environment_info
from specdec.evals.gpu_check.context import CheckContext
from specdec.evals.gpu_check.engine import stage_engine_controller
from specdec.evals.gpu_check.fp8 import stage_fp8_weights
from specdec.evals.gpu_check.models import arch_for
from specdec.evals.gpu_check.parity import (
    stage_attention_parity,
    stage_engine_greedy,
    stage_graph_parity,
    stage_model_parity,
    stage_sampling_parity,
)
from specdec.evals.gpu_check.summary import format_table, summarize
from specdec.evals.gpu_check.timing import (
    stage_bandwidth,
    stage_e2e,
    stage_kernel_profile,
    stage_step_timing,
)
from specdec.evals.gpu_check.trees import stage_tree_timing

Stage = Callable[[CheckContext], dict[str, Any]]


def stage_environment(ctx: CheckContext) -> dict[str, Any]:
    info: dict[str, Any] = {"environment": environment_info(), "pass": True}
    # Without this attribute tvm-ffi (under FlashInfer) JIT-builds a DLPack addon at import.
    info["torch_dlpack_c_exchange_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": props.total_memory / (1 << 30),
            "torch_cuda": torch.version.cuda,
        }
        try:
            nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
            info["nvcc"] = nvcc.stdout.strip().splitlines()[-1] if nvcc.stdout else None
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvcc"] = f"unavailable: {exc}"
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception as exc:
        info["flashinfer"] = f"not importable: {type(exc).__name__}: {exc}"
    return info


def stage_jit(ctx: CheckContext) -> dict[str, Any]:
    """Compile every FlashInfer module the later stages use in one parallel ninja build, then
    run the engine's own start-up self-test (what `--attention-backend auto` does)."""
    from flashinfer.jit import build_jit_specs, gen_act_and_mul_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module
    from specdec.engine.attention import selection

    shapes = {*ctx.parity_shapes, ctx.target_shape, ctx.draft_shape}
    head_dims = sorted({arch_for(s).head_dim for s in shapes} | {128})  # 128: the self-test
    dt = ctx.dtype
    # The FA2 prefill module serves prefill/verify and (with tensor cores) decode alike.
    specs = [
        gen_batch_prefill_module("fa2", dt, dt, dt, torch.int32, d, d, 0, False, False, False)
        for d in head_dims
    ]
    specs.append(gen_sampling_module())
    # The decoder's fused element-wise kernels (engine.models.fused_ops).
    specs += [gen_norm_module(), gen_act_and_mul_module("silu"), gen_rope_module()]
    start = time.perf_counter()
    build_jit_specs(specs, verbose=False)
    built = time.perf_counter() - start
    # A module's first load runs ninja again in its own folder, which has no build log from the
    # parallel build above, so it would compile everything a second time. Libraries at the
    # ahead-of-time path load with no ninja at all: put them there.
    for spec in specs:
        spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
        if not spec.aot_path.exists():
            shutil.copy2(spec.jit_library_path, spec.aot_path)
    start = time.perf_counter()
    ok, reason = selection.flashinfer_status(ctx.device)
    fused = ctx.fused_ops() is not None
    return {
        "fused_ops": fused,
        "head_dims": head_dims,
        "build_seconds": built,
        "self_test_ok": ok,
        "self_test_reason": reason,
        "self_test_seconds": time.perf_counter() - start,
        "pass": ok,
    }


# (name, function, seconds it needs at least, needs a FlashInfer build, runs only on CUDA).
# Parity of the attention kernels first (everything else rests on it), then the timings the
# targets are about, then the slower whole-model and engine checks.
STAGES: list[tuple[str, Stage, float, bool, bool]] = [
    ("environment", stage_environment, 0, False, False),
    ("jit", stage_jit, 0, True, True),
    ("bandwidth", stage_bandwidth, 5, False, False),
    ("attention_parity", stage_attention_parity, 10, True, False),
    ("step_timing", stage_step_timing, 60, True, False),
    ("fp8_weights", stage_fp8_weights, 40, True, False),
    ("kernel_profile", stage_kernel_profile, 15, True, False),
    ("e2e", stage_e2e, 40, True, False),
    ("tree_timing", stage_tree_timing, 30, True, False),
    ("engine_controller", stage_engine_controller, 60, True, False),
    ("graph_parity", stage_graph_parity, 30, True, True),
    ("sampling_parity", stage_sampling_parity, 20, True, False),
    ("model_parity", stage_model_parity, 60, True, False),
    ("engine_greedy", stage_engine_greedy, 40, True, False),
]

# The stages that time the shared random-weight rig (`timing.get_rig`).
RIG_STAGES = {"step_timing", "fp8_weights", "kernel_profile", "e2e", "tree_timing"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir", type=Path, help="folder for the JSON results and the table")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, torch path, CPU")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip stages past this")
    p.add_argument("--parity-shapes", default="0.5b,1.5b,7b")
    p.add_argument("--target-shape", default="7b")
    p.add_argument("--draft-shape", default="0.5b")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--accept-rates", default="0.5,0.8,0.95")
    p.add_argument("--tree-batch-sizes", default="1,4,16", help="tree_timing batch sizes")
    p.add_argument("--tree-nodes", default="8,16,32,64", help="tree_timing nodes per tree")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=30, help="timed repetitions per median")
    p.add_argument("--e2e-steps", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--engine-batch", type=int, default=64, help="engine_controller requests")
    p.add_argument("--engine-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--engine-rounds", type=int, default=5, help="arms interleaved per round")
    p.add_argument(
        "--engine-gc-freeze",
        action="store_true",
        help="engine_controller: gc.freeze() the start-up heap before the timed rounds",
    )
    p.add_argument("--only", default="", help="comma-separated stage names to run")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make_context(args: argparse.Namespace) -> CheckContext:
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --cpu-smoke")
    return CheckContext(
        device=torch.device("cpu" if smoke else "cuda"),
        dtype=torch.float32 if smoke else torch.bfloat16,
        cpu_smoke=smoke,
        out_dir=args.out_dir,
        parity_shapes=["tiny"] if smoke else args.parity_shapes.split(","),
        target_shape="tiny" if smoke else args.target_shape,
        draft_shape="tiny-draft" if smoke else args.draft_shape,
        batch_sizes=[1, 2] if smoke else _ints(args.batch_sizes),
        ks=[1, 2] if smoke else _ints(args.ks),
        accept_rates=[float(a) for a in args.accept_rates.split(",")][: 1 if smoke else None],
        tree_batch_sizes=[1, 2] if smoke else _ints(args.tree_batch_sizes),
        tree_nodes=[4, 8] if smoke else _ints(args.tree_nodes),
        context_len=16 if smoke else args.context_len,
        iters=2 if smoke else args.iters,
        e2e_steps=2 if smoke else args.e2e_steps,
        page_size=args.page_size,
        engine_batch=args.engine_batch,
        engine_tokens=args.engine_tokens,
        engine_rounds=args.engine_rounds,
        engine_gc_freeze=args.engine_gc_freeze,
        deadline=time.monotonic() + args.budget_s,
    )


def results_path(ctx: CheckContext) -> Path:
    gpu = ctx.results["stages"].get("environment", {}).get("gpu", {}).get("name", "cpu")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower() or "device"
    return ctx.out_dir / f"gpu_check_{time.strftime('%Y%m%d')}_{slug}.json"


def run_stage(
    ctx: CheckContext, name: str, fn: Stage, min_s: float, needs_fi: bool, gpu_only: bool
) -> None:
    stages = ctx.results["stages"]
    if gpu_only and ctx.device.type != "cuda":
        stages[name] = {"status": "skipped", "reason": "needs CUDA"}
        return
    if ctx.remaining() < min_s:
        stages[name] = {"status": "skipped", "reason": "time budget"}
        return
    # A failed build leaves nothing to run; a failed self-test still lets the stages say why.
    jit_ok = stages.get("jit", {}).get("status") == "ok"
    if needs_fi and ctx.device.type == "cuda" and name != "jit" and not jit_ok:
        stages[name] = {"status": "skipped", "reason": "FlashInfer JIT build failed (see jit)"}
        return
    ctx.log(f"stage {name} ...")
    start = time.perf_counter()
    try:
        data = fn(ctx)
        stages[name] = {"status": "ok", **data}
    except Exception as exc:
        text = traceback.format_exc()
        stages[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[-4000:]}
        stages[name]["traceback"] = text[-4000:]
        print(text[-4000:], flush=True)
    stages[name]["seconds"] = time.perf_counter() - start
    ctx.log(f"stage {name}: {stages[name]['status']} in {stages[name]['seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = make_context(args)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ctx.results = {
        "command": " ".join(
            [sys.executable, "-m", "specdec.evals.gpu_check", *(argv or sys.argv[1:])]
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_smoke": ctx.cpu_smoke,
        "options": {k: str(v) for k, v in vars(args).items()},
        "stages": {},
    }
    only = {s for s in args.only.split(",") if s}
    selected = [s for s in STAGES if not only or s[0] in only or s[0] in ("environment", "jit")]
    last_rig_stage = max((i for i, s in enumerate(selected) if s[0] in RIG_STAGES), default=-1)
    path, table = None, ""
    for i, (name, fn, min_s, needs_fi, gpu_only) in enumerate(selected):
        run_stage(ctx, name, fn, min_s, needs_fi, gpu_only)
        if i == last_rig_stage:
            ctx.free_memory()  # the timing rig (models, pools, graphs) is not needed after this
        path = results_path(ctx)
        ctx.results["summary"] = summarize(ctx.results)
        path.write_text(json.dumps(ctx.results, indent=1, default=str))
        table = format_table(ctx.results)  # rewritten too: a run cut short keeps its table
        (ctx.out_dir / "gpu_check_table.txt").write_text(table + "\n")
    print(f"results: {path}")
    print(table, flush=True)
    return 1 if any(s["status"] == "failed" for s in ctx.results["stages"].values()) else 0
