"""Device-check parity stages: FlashInfer vs the torch reference, graphs vs eager, sampling
kernels vs their torch twins, and greedy speculative == greedy plain through the engine.

Each stage returns a dict of numbers plus ``"pass"``. Criteria follow bf16 arithmetic: relative
errors against a float32 reference, with FlashInfer required to be as close to it as the torch
backend in bf16 is (both see the same rounded inputs), not bitwise equal to anything.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from scipy import stats
from specdec.engine import noise
from specdec.engine.attention.base import build_attention_metadata, tree_mask_from_parents
from specdec.engine.gpu_sampling import TorchKernels, sample_from_probs, verify_drafts, warp_probs
from specdec.engine.kv_cache import ModelKV
from specdec.engine.sampling_params import SamplingParams
from specdec.evals.gpu_check.context import CheckContext
from specdec.evals.gpu_check.engine import random_model_engine
from specdec.evals.gpu_check.models import (
    arch_for,
    eager_step,
    make_pool,
    random_model,
    relative_error,
)

# (page_size, q_lens, kv_lens): long prompt, decodes at page boundaries, verifies, mid-prompt chunk.
ATTENTION_CASES = [
    (16, [300, 1, 5, 9, 1], [300, 517, 40, 129, 16]),
    (16, [1] * 8, [1, 16, 17, 100, 255, 256, 257, 1000]),
    (16, [37, 1, 5, 16], [37, 70, 21, 32]),
    # Token trees (FlashInfer's custom-mask path): trees of 16 and 64 nodes beside a prompt
    # chunk, a decode and a 5-row chain verify.
    (16, [300, 1, 16, 5, 64], [300, 517, 40, 129, 100]),
]
# Per case, the sequences verified as trees: sequence index -> number of nodes (random shapes).
TREE_SEQS: dict[int, dict[int, int]] = {3: {2: 16, 4: 64}}
BF16_TOLERANCE = 1e-2


def _tables(kv_lens: list[int], page_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    need = [-(-kv // page_size) for kv in kv_lens]
    ids = list(range(sum(need) + 4))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    return tables


def _tree_masks(q_lens: list[int], trees: dict[int, int], seed: int) -> list | None:
    """Random tree masks (node j's parent drawn from nodes before it) for the sequences in
    `trees`, None for the others; None when there are no trees."""
    if not trees:
        return None
    rng = random.Random(seed)
    masks: list = [None] * len(q_lens)
    for i, n in trees.items():
        assert q_lens[i] == n
        masks[i] = tree_mask_from_parents([-1] + [rng.randrange(j) for j in range(1, n)])
    return masks


def stage_attention_parity(ctx: CheckContext) -> dict[str, Any]:
    """One attention call per head layout and batch: FlashInfer (bf16) and torch (bf16) against
    the torch backend in float32 on the same (rounded) inputs."""
    rows, ok = [], True
    dev, dt = ctx.device, ctx.dtype
    for shape in ctx.parity_shapes:
        arch = arch_for(shape)
        for case, (page, q_lens, kv_lens) in enumerate(ATTENTION_CASES):
            trees = TREE_SEQS.get(case, {})
            tree_masks = _tree_masks(q_lens, trees, seed=case)
            gen = torch.Generator().manual_seed(len(rows))
            tables = _tables(kv_lens, page, len(rows))
            blocks = max(max(t) for t in tables) + 1
            pool_shape = (blocks, page, arch.num_key_value_heads, arch.head_dim)
            pools = [torch.randn(pool_shape, generator=gen).to(dev, dt) for _ in range(2)]
            t = sum(q_lens)
            heads = (arch.num_attention_heads, arch.num_key_value_heads, arch.num_key_value_heads)
            qkv = [torch.randn(t, h, arch.head_dim, generator=gen).to(dev, dt) for h in heads]
            outs = {}
            for name, backend, dtype in (
                ("flashinfer", ctx.attention_backend(arch), dt),
                ("torch_bf16", ctx.torch_backend(arch), dt),
                ("ref_fp32", ctx.torch_backend(arch), torch.float32),
            ):
                meta = build_attention_metadata(q_lens, kv_lens, tables, page, dev, tree_masks)
                backend.plan(meta)
                kc, vc = (p.to(dtype).clone() for p in pools)
                q, k, v = (x.to(dtype) for x in qkv)
                outs[name] = backend.forward(q, k, v, kc, vc, meta).float()
            err_fi = relative_error(outs["flashinfer"], outs["ref_fp32"])
            err_tb = relative_error(outs["torch_bf16"], outs["ref_fp32"])
            ok &= err_fi < BF16_TOLERANCE
            rows.append(
                {
                    "shape": shape,
                    "heads": list(heads[:2]) + [arch.head_dim],
                    "q_lens": q_lens,
                    "kv_lens": kv_lens,
                    "tree_nodes": sorted(trees.values()),
                    "rel_err_flashinfer": err_fi,
                    "rel_err_torch_bf16": err_tb,
                }
            )
    worst = max(r["rel_err_flashinfer"] for r in rows)
    return {"cases": rows, "worst_rel_err": worst, "pass": ok}


def _pool_copy(kv: ModelKV, dtype: torch.dtype) -> ModelKV:
    return ModelKV([(k.to(dtype).clone(), v.to(dtype).clone()) for k, v in kv.layers])


def _model_steps(vocab: int, seed: int) -> list[tuple[list[list[int]], list[int]]]:
    """Prefill three prompts; then a mixed step (decode, 5-row verify, chunk, new prompt); then
    a pure-decode step. Sequence i always uses block table i."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    return [
        ([toks(37), toks(100), toks(64)], [0, 0, 0]),
        ([toks(1), toks(5), toks(20), toks(50)], [37, 100, 64, 0]),
        ([toks(1), toks(1), toks(1), toks(1)], [38, 105, 84, 50]),
    ]


def stage_model_parity(ctx: CheckContext) -> dict[str, Any]:
    """Whole random-weight models, three steps: the GPU fast path (FlashInfer attention and fused
    kernels) and the torch layers, both in bf16, against the same model in float32 on torch."""
    page, out, ok = ctx.page_size, {}, True
    for shape in ctx.parity_shapes:
        arch = arch_for(shape)
        model = random_model(arch, ctx.dtype, ctx.device, seed=1)
        pool = make_pool(arch, 4 * 16 + 4, page, ctx.dtype, ctx.device, seed=2)
        tables = [list(range(i * 16, (i + 1) * 16)) for i in range(4)]
        steps = _model_steps(arch.vocab_size, seed=3)
        logits: dict[str, list[torch.Tensor]] = {}
        for name, backend, ops in (
            ("flashinfer", ctx.attention_backend(arch), ctx.fused_ops()),
            ("torch_bf16", ctx.torch_backend(arch), None),
        ):
            model.use_fused_ops(ops)
            kv = _pool_copy(pool, ctx.dtype)
            logits[name] = [
                eager_step(model, kv, backend, page, ids, starts, tables[: len(ids)])
                for ids, starts in steps
            ]
            del kv
        model = model.float()
        kv32 = _pool_copy(pool, torch.float32)
        ref_backend = ctx.torch_backend(arch)
        ref = [
            eager_step(model, kv32, ref_backend, page, ids, starts, tables[: len(ids)])
            for ids, starts in steps
        ]
        res: dict[str, Any] = {"fused_ops": ctx.fused_ops() is not None}
        for name in ("flashinfer", "torch_bf16"):
            res[f"rel_err_{name}"] = [
                relative_error(g, r) for g, r in zip(logits[name], ref, strict=True)
            ]
            agree = [
                float((g.argmax(-1) == r.argmax(-1)).float().mean())
                for g, r in zip(logits[name], ref, strict=True)
            ]
            res[f"top1_agree_{name}"] = agree
        worst_fi, worst_tb = max(res["rel_err_flashinfer"]), max(res["rel_err_torch_bf16"])
        res["pass"] = worst_fi <= 1.5 * worst_tb + 2e-3
        ok &= res["pass"]
        out[shape] = res
        del model, kv32, pool, logits, ref
        ctx.free_memory()
    return {"shapes": out, "pass": ok}


def stage_graph_parity(ctx: CheckContext) -> dict[str, Any]:
    """Graph replays (3 real rows padded to 4; decode and a 5-row verify) against eager
    FlashInfer steps at lengths other than the capture's; padding must touch no real block.

    Graph-mode plans always split the KV range, eager plans may not, so the two sum attention in
    different orders; over a deep random model that bf16 difference grows to a few percent of
    the logits. The bar is therefore relative: graph vs eager may differ by no more than two
    correct bf16 implementations do (eager FlashInfer with fused kernels vs the torch layers),
    times 1.5, plus 2e-3, and never by more than that or 1e-2, whichever is larger."""
    from specdec.engine.cuda_graphs import GraphedForward

    out, ok, page = {}, True, ctx.page_size
    for shape in (ctx.target_shape, ctx.draft_shape):
        arch = arch_for(shape)
        model = ctx.fast_model(random_model(arch, ctx.dtype, ctx.device, seed=4))
        # Tables use blocks 0..59; 60..69 stay unused (must stay untouched); 70 is scratch.
        num_blocks, scratch = 71, [70]
        graph_kv = make_pool(arch, num_blocks, page, ctx.dtype, ctx.device, seed=5)
        eager_kv = _pool_copy(graph_kv, ctx.dtype)
        torch_kv = _pool_copy(graph_kv, ctx.dtype)
        graphed = GraphedForward(
            model, graph_kv.layers, ctx.attention_backend(arch), page, 20, scratch, ctx.dtype
        )
        graphed.capture([4], [1, 5])
        eager = ctx.attention_backend(arch)
        tables = [list(range(i * 20, (i + 1) * 20)) for i in range(3)]
        errs, spread = {}, {}
        for q_len, starts in ((1, [100, 37, 250]), (5, [64, 129, 200])):
            ids = [[(7 * i + j) % arch.vocab_size for j in range(q_len)] for i in range(3)]
            got = graphed.run(ids, starts, tables).clone()
            want = eager_step(model, eager_kv, eager, page, ids, starts, tables)
            errs[f"q_len_{q_len}"] = relative_error(got, want)
            model.use_fused_ops(None)
            plain = eager_step(model, torch_kv, ctx.torch_backend(arch), page, ids, starts, tables)
            ctx.fast_model(model)
            spread[f"q_len_{q_len}"] = relative_error(plain, want)
        untouched = torch.arange(60, 70, device=ctx.device)
        clean = all(
            torch.equal(g[i][untouched], e[i][untouched])
            for g, e in zip(graph_kv.layers, eager_kv.layers, strict=True)
            for i in (0, 1)
        )
        bar = max(BF16_TOLERANCE, 1.5 * max(spread.values()) + 2e-3)
        res = {
            "rel_err_vs_eager": errs,
            "rel_err_eager_vs_torch_layers": spread,
            "bar": bar,
            "padding_touched_no_real_block": clean,
        }
        res["pass"] = clean and max(errs.values()) <= bar
        ok &= res["pass"]
        out[shape] = res
        del model, graph_kv, eager_kv, torch_kv, graphed
        ctx.free_memory()
    return {"shapes": out, "pass": ok}


def _first_token_p_values(kernels, device: torch.device, seed: int) -> list[float]:
    """Two interleaved row classes with different (p, q) and draft counts 0..3: chi-square of each
    class's first emitted token against its target row 0 (lossless verification)."""
    rows, k, vocab = 8000, 3, 16
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(2, k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, k, vocab, generator=gen) * 1.5, -1)
    cls = torch.arange(rows) % 2
    drafts = torch.multinomial(q[cls].view(-1, vocab), 1, generator=gen).view(rows, k)
    n = torch.randint(0, k + 1, (rows,), generator=gen).tolist()
    res = verify_drafts(
        p[cls].to(device),
        drafts.to(device),
        q[cls].to(device),
        n,
        [False] * rows,
        [None] * rows,
        [0] * rows,
        kernels,
    )
    first = res.output_token_ids[:, 0].cpu()
    out = []
    for c in range(2):
        observed = torch.bincount(first[cls == c], minlength=vocab).double()
        expected = p[c, 0].double() / p[c, 0].double().sum() * observed.sum()
        out.append(float(stats.chisquare(observed, expected)[1]))
    return out


def stage_sampling_parity(ctx: CheckContext) -> dict[str, Any]:
    """Warp parity against the torch kernels at the real vocabulary, lossless verification by
    chi-square, and per-request seeding independent of the row a request occupies."""
    kernels = ctx.sampling_kernels()
    vocab = arch_for(ctx.target_shape).vocab_size
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.1, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02),
    ] * 4
    logits = torch.randn(len(params), vocab, device=ctx.device) * 4
    want = warp_probs(logits, params, TorchKernels())
    got = warp_probs(logits, params, kernels)
    warp_err = float((got - want).abs().max())
    p_values = _first_token_p_values(kernels, ctx.device, seed=6)

    probs = torch.softmax(torch.randn(6, 1000, device=ctx.device), -1)
    seen = set()
    for row in (0, 2, 5):
        seeds: list[int | None] = [None, 7, None, None, 9, None]
        seeds[row] = 123
        order = list(range(6))
        order[0], order[row] = order[row], order[0]
        draws = []
        for pos in range(5):
            positions = [pos + 10 * b for b in range(6)]
            positions[row] = pos
            out = sample_from_probs(probs[order], [False] * 6, seeds, positions, kernels)
            draws.append(int(out[row]))
        seen.add(tuple(draws))
    # The counter-based noise is the same words on the device as on the CPU.
    seeds, positions = [0, 5, 2**63 + 1, -7], [0, 3, 99, 2**33]
    cpu_u = noise.uniforms(noise.stream_keys(seeds, positions, noise.TOKEN, "cpu"), vocab)
    dev_u = noise.uniforms(noise.stream_keys(seeds, positions, noise.TOKEN, ctx.device), vocab)
    same_noise = torch.equal(cpu_u, dev_u.cpu())
    res = {
        "warp_max_abs_diff": warp_err,
        "verify_first_token_p_values": p_values,
        "seeded_row_position_independent": len(seen) == 1,
        "seeded_noise_equals_cpu": same_noise,
    }
    res["pass"] = warp_err < 1e-4 and min(p_values) > 1e-4 and len(seen) == 1 and same_noise
    return res


def stage_engine_greedy(ctx: CheckContext) -> dict[str, Any]:
    """LLMEngine on the device: greedy speculative output == greedy plain output, with a random
    draft (nearly every draft rejected) and with the target as its own draft (nearly all
    accepted). A mismatch is reported with the target's logit gap between the two tokens at the
    first divergence: a gap within bf16 noise is a numerical near-tie, anything else is a bug."""
    t_shape, d_shape = ("tiny", "tiny-draft") if ctx.cpu_smoke else ("1.5b", "0.5b")
    t_arch = arch_for(t_shape)
    d_arch = arch_for(d_shape, vocab_size=t_arch.vocab_size)
    target = random_model(t_arch, ctx.dtype, ctx.device, seed=7)
    draft = random_model(d_arch, ctx.dtype, ctx.device, seed=8)
    rng = random.Random(9)
    prompts = [[rng.randrange(t_arch.vocab_size) for _ in range(n)] for n in (20, 33, 47, 60)]
    params = SamplingParams(temperature=0, max_tokens=8 if ctx.cpu_smoke else 32, ignore_eos=True)
    out: dict[str, Any] = {}
    ok = True
    for label, draft_model, draft_arch in (
        ("random_draft", draft, d_arch),
        ("self_draft", target, t_arch),
    ):
        engine = random_model_engine(
            ctx,
            (t_shape, t_arch, target),
            (label, draft_arch, draft_model),
            num_kv_blocks=1024,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            controller_warmup=False,
        )
        plain = [o.output_token_ids for o in engine.generate(prompts, params, speculative="off")]
        spec = [o.output_token_ids for o in engine.generate(prompts, params, speculative="on")]
        mismatches = []
        for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
            if a != b:
                d = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
                gap = _logit_gap(ctx, target, t_arch, prompts[i] + a[:d], a[d], b[d])
                mismatches.append({"request": i, "position": d, "logit_gap": gap})
        res = {
            "requests": len(prompts),
            "identical": len(prompts) - len(mismatches),
            "acceptance_rate": engine.spec_stats.acceptance_rate,
            "mismatches": mismatches,
            "graph_runs": engine.target_runner.num_graph_runs,
            "sampling_kernels": type(engine.sampling_kernels).__name__,
        }
        # A divergence at a logit gap under 0.1 (bf16 logits of size ~10 carry ~0.05 of noise)
        # is a near-tie flipped by rounding; a larger gap means speculation changed the output.
        res["pass"] = all(m["logit_gap"] < 0.1 for m in mismatches)
        ok &= res["pass"]
        out[label] = res
        del engine
        ctx.free_memory()
    return {"runs": out, "pass": ok}


def _logit_gap(ctx, model, arch, prefix: list[int], token_a: int, token_b: int) -> float:
    page = ctx.page_size
    pages = -(-len(prefix) // page) + 1
    kv = make_pool(arch, pages, page, ctx.dtype, ctx.device, seed=10)
    logits = eager_step(
        model, kv, ctx.attention_backend(arch), page, [prefix], [0], [list(range(pages))]
    )[-1]
    return abs(float(logits[token_a] - logits[token_b]))
