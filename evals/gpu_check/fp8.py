"""Device-check stage for FP8 weights (`--quantization fp8`): the check's random target again in
fp8, its logits against the bf16 model's on one prompt, and its decode step beside bf16's at each
batch size (graphed on CUDA, as the engine runs it) against the HBM roofline of the bytes it reads.
"""

from __future__ import annotations

from typing import Any

import torch
from specdec.engine.cuda_graphs import GraphedForward
from specdec.engine.models.quant import quantize_model
from specdec.evals.gpu_check.context import CheckContext
from specdec.evals.gpu_check.models import Timer, eager_step, kv_bytes_per_token, random_model
from specdec.evals.gpu_check.timing import TARGET_SEED, get_rig


def stage_fp8_weights(ctx: CheckContext) -> dict[str, Any]:
    rig = get_rig(ctx)
    # The rig's target again (its seed), in fp8, set up as the engine runs it.
    fp8 = random_model(rig.t_arch, ctx.dtype, ctx.device, seed=TARGET_SEED)
    quantize_model(fp8, "fp8")
    fp8 = ctx.fast_model(fp8)
    out: dict[str, Any] = {
        "bf16_weight_bytes": rig.target.weight_bytes(),
        "fp8_weight_bytes": fp8.weight_bytes(),
    }
    # One prompt through both (eager: the forward the graphs capture), every row's logits.
    prompt = torch.randint(
        0,
        rig.t_arch.vocab_size,
        (min(ctx.context_len, 256),),
        generator=torch.Generator().manual_seed(7),
    ).tolist()
    logits = {}
    for name, model in (("bf16", rig.target), ("fp8", fp8)):
        logits[name] = eager_step(
            model, rig.t_kv, rig.t_backend, ctx.page_size, [prompt], [0], rig.tables[:1]
        ).float()
    a, b = logits["bf16"], logits["fp8"]
    out["logits_relative_error"] = ((b - a).norm() / a.norm()).item()
    out["top1_agreement"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()

    graphs = None
    pages = len(rig.tables[0])
    if ctx.device.type == "cuda":
        scratch = [rig.t_kv.layers[0][0].shape[0] - 1]
        graphs = GraphedForward(
            fp8, rig.t_kv.layers, rig.t_backend, ctx.page_size, pages, scratch, ctx.dtype
        )
        graphs.capture(ctx.batch_sizes, [1])

    def fp8_step(ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        tables = rig.tables[: len(ids)]
        if graphs is not None:
            return graphs.run(ids, starts, tables)
        return eager_step(fp8, rig.t_kv, rig.t_backend, ctx.page_size, ids, starts, tables)

    timer, iters, ctx_len = Timer(ctx.device), ctx.iters, ctx.context_len
    bandwidth = ctx.results.get("stages", {}).get("bandwidth", {}).get("gb_per_s")
    kv_token = kv_bytes_per_token(rig.t_arch, ctx.dtype)
    rows = []
    for batch in ctx.batch_sizes:
        ids, starts = [[1]] * batch, [ctx_len] * batch
        row: dict[str, Any] = {"batch": batch}
        # Interleaved, so a drift of the device's clock falls on both formats.
        for name, step in (("bf16", rig.target_step), ("fp8", fp8_step), ("bf16", rig.target_step)):
            ms = timer.median_ms(lambda f=step, i=ids, s=starts: f(i, s), iters)
            row[f"{name}_decode_ms"] = min(ms, row.get(f"{name}_decode_ms", ms))
        row["fp8_over_bf16"] = row["fp8_decode_ms"] / row["bf16_decode_ms"]
        if bandwidth:
            read = out["fp8_weight_bytes"] + batch * (ctx_len + 1) * kv_token
            row["fp8_roofline_ms"] = read / (bandwidth * 1e9) * 1e3
            row["fp8_vs_roofline"] = row["fp8_decode_ms"] / row["fp8_roofline_ms"]
        rows.append(row)
        ctx.log(
            f"  batch {batch}: bf16 {row['bf16_decode_ms']:.3f} ms, fp8 {row['fp8_decode_ms']:.3f}"
        )
    out["rows"] = rows
    # Random weights give no text to judge; the logits must stay those of the same model.
    out["pass"] = out["logits_relative_error"] < 0.25 and out["top1_agreement"] > 0.5
    return out
