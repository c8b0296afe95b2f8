"""Greedy generation through continuous batching equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch
from specdec.engine.sampling_params import SamplingParams
from tiny_models import hf_greedy, make_engine, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_qwen():
    return tiny_hf_model("qwen2", seed=0)


def prompts(n: int = 7, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 30, 45, 5, 62, 12][:n]
    return [torch.randint(2, 128, (k,), generator=g).tolist() for k in lengths]


def run_staggered(engine, prompt_list, params=GREEDY, spec=None, every: int = 2):
    """Submit one prompt every `every` steps while the batch keeps running."""
    pending = list(enumerate(prompt_list))
    results: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params, spec)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[1:])] = out.output_token_ids
        step += 1
    return [results[i] for i in range(len(prompt_list))]


def expected(hf, prompt_list, n=24):
    return [hf_greedy(hf, p, n) for p in prompt_list]


def test_staggered_continuous_batching_matches_transformers(hf_qwen):
    engine = make_engine(hf_qwen)
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    assert run_staggered(engine, ps) == expected(hf_qwen, ps)
    assert engine.allocator.num_free_blocks == free0


def test_llama_family_through_the_engine():
    hf = tiny_hf_model("llama", seed=3)
    engine = make_engine(hf)
    ps = prompts(4, seed=1)
    assert [o.output_token_ids for o in engine.generate(ps, GREEDY)] == expected(hf, ps)


def test_chunked_prefill_small_budget_matches(hf_qwen):
    # 17 tokens per step: long prompts are split over several steps, mixed with decodes.
    engine = make_engine(hf_qwen, max_num_batched_tokens=17)
    ps = prompts()
    assert run_staggered(engine, ps, every=1) == expected(hf_qwen, ps)


def test_tiny_block_budget_forces_preemption_and_still_matches(hf_qwen):
    # 24 blocks of 4 tokens cannot hold 7 sequences of up to 86 tokens: preemption must happen.
    engine = make_engine(hf_qwen, num_kv_blocks=24, max_model_len=90)
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    assert run_staggered(engine, ps, every=1) == expected(hf_qwen, ps)
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_free_blocks == free0


def test_prefix_caching_with_shared_system_prompt(hf_qwen):
    system = list(range(5, 5 + 21))  # 21 tokens: 5 full blocks of 4
    ps = [system + tail for tail in ([40, 41], [50, 51, 52, 53], [60], [70, 71, 72, 73, 74, 75])]
    engine = make_engine(hf_qwen)
    free0 = engine.allocator.num_free_blocks
    first = engine.generate(ps[:1], GREEDY)
    rest = engine.generate(ps[1:], GREEDY)
    outs = first + rest
    assert [o.output_token_ids for o in outs] == expected(hf_qwen, ps)
    assert all(o.num_cached_prompt_tokens >= 20 for o in rest)
    assert engine.allocator.num_free_blocks == free0


def test_prefix_caching_off_computes_everything(hf_qwen):
    engine = make_engine(hf_qwen, enable_prefix_caching=False)
    system = list(range(5, 30))
    outs = engine.generate([system + [1, 2], system + [3]], GREEDY)
    outs += engine.generate([system + [4]], GREEDY)
    assert all(o.num_cached_prompt_tokens == 0 for o in outs)


def test_shortest_prompt_first_policy_still_matches(hf_qwen):
    engine = make_engine(hf_qwen, scheduling_policy="spf", max_num_seqs=2)
    ps = prompts()
    assert [o.output_token_ids for o in engine.generate(ps, GREEDY)] == expected(hf_qwen, ps)


def test_same_seed_same_output_and_sampling_differs_across_seeds(hf_qwen):
    engine = make_engine(hf_qwen)
    p = prompts(1)[0]
    runs = [
        engine.generate(
            [p], SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)
        )[0]
        for s in (7, 7, 8)
    ]
    assert runs[0].output_token_ids == runs[1].output_token_ids
    assert runs[0].output_token_ids != runs[2].output_token_ids
    # A seeded request gives the same tokens when it shares the batch with others.
    mixed = engine.generate(
        [p, prompts(2)[1]],
        [
            SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
        ],
    )
    assert mixed[0].output_token_ids == runs[0].output_token_ids
