"""Randomized engine stress: seeded arrivals, aborts, preemption, prefix hits, k up to 6.

Each run drives one speculating engine (a draft model, or n-gram lookup) with requests arriving
at random steps, some aborted part-way, on a KV pool small enough to preempt and a token budget
small enough to chunk prompts and the draft's catch-up. At the end: every block is back in the
pool, every greedy request's tokens equal plain greedy decoding of its prompt (an aborted one's
tokens so far are a prefix of them), and no draft forward ran more rows than the budget.

The default suite runs a few hundred requests per proposer; ``pytest -m slow tests/test_stress.py``
also runs thousands.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from specdec.engine.sampling_params import SamplingParams
from test_draft_budget import record_plans, record_rows
from tiny_models import make_engine, noisy_copy

EOS = 1  # the tiny models' eos id
MAX_TOKENS = 16
MAX_MODEL_LEN = 96
BUDGET = 32  # max_num_batched_tokens: prompts and the draft's catch-up are chunked
K_MAX = 6


@pytest.fixture(autouse=True)
def one_thread():
    """Models this small run fastest on one thread (a second one only adds synchronisation)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.05)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    mode: str
    arrival_step: int
    abort_after: int | None  # steps after arrival, or None to run to the end
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


def make_workload(num_requests: int, seed: int) -> list[Request]:
    """Requests drawn from a pool of prompts over a few shared system prompts (prefix hits, and
    repeated prompts) with repetitive tails (n-gram hits); most greedy, some sampled; 'on',
    'auto' and 'off'; about one in eight aborted part-way."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 128) for _ in range(n)] for n in (9, 22, 41, 58)]
    pool = []
    for _ in range(48):
        tail = [rng.randrange(2, 40) for _ in range(rng.randint(1, 10))]
        tail += tail[: rng.randint(0, len(tail))]  # repeats give the n-gram lookup matches
        prefix = rng.choice(prefixes) if rng.random() < 0.75 else []
        pool.append((prefix + tail)[: MAX_MODEL_LEN - MAX_TOKENS])
    out, step = [], 0
    for i in range(num_requests):
        step += rng.choice((0, 0, 1, 1, 2))
        greedy = rng.random() < 0.8
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            max_tokens=rng.randint(1, MAX_TOKENS),
            ignore_eos=rng.random() < 0.5,
            seed=None if greedy else rng.randrange(1 << 30),
        )
        mode = rng.choice(("on", "on", "on", "auto", "off"))
        abort_after = rng.randint(0, 12) if rng.random() < 0.12 else None
        out.append(Request(f"q{i}", rng.choice(pool), params, mode, step, abort_after))
    return out


def plain_reference(target, requests: list[Request]) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy decode of every distinct prompt, MAX_TOKENS tokens, eos ignored (shorter or
    eos-stopped requests take a prefix), on an engine roomy enough never to preempt."""
    engine = make_engine(
        target,
        speculative_method="none",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=2048,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    prompts = sorted({tuple(r.prompt) for r in requests})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engine.generate([list(p) for p in prompts], params)
    return {p: o.output_token_ids for p, o in zip(prompts, outs, strict=True)}


def expected_tokens(full: list[int], params: SamplingParams) -> list[int]:
    want = full[: params.max_tokens]
    if not params.ignore_eos and EOS in want:
        want = want[: want.index(EOS) + 1]
    return want


def run_stress(target, draft, method: str, num_requests: int, seed: int) -> dict[str, int]:
    """One stressed run; asserts as the module docstring says and returns what it exercised."""
    requests = make_workload(num_requests, seed)
    reference = plain_reference(target, requests)
    engine = make_engine(
        target,
        draft,
        speculative_method=method,
        num_speculative_tokens=K_MAX,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=40,  # 160 slots: a few sequences at a time, preemption when they grow
        max_num_seqs=8,
        max_num_batched_tokens=BUDGET,
        ngram_n_min=1,
    )
    free0 = engine.allocator.num_free_blocks
    draft_rows = record_rows(engine.proposer.runner) if method == "draft_model" else []
    target_rows = record_rows(engine.target_runner)
    plans = record_plans(engine)
    by_id = {r.request_id: r for r in requests}
    pending = list(requests)
    live: dict[str, int] = {}  # request id -> step it arrived
    step = aborted = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            engine.add_request(r.request_id, r.prompt, r.params, r.mode)
            live[r.request_id] = step
        for rid, arrived in list(live.items()):
            r = by_id[rid]
            if r.abort_after is not None and step - arrived >= r.abort_after:
                assert engine.abort(rid)
                del live[rid]
                aborted += 1
        for out in engine.step():
            r = by_id[out.request_id]
            r.tokens = list(out.output_token_ids)
            if out.finished:
                r.finished = True
                live.pop(out.request_id, None)
        step += 1

    assert engine.allocator.num_free_blocks == free0, "KV blocks leaked"
    checked = 0
    for r in requests:
        if r.params.temperature > 0:
            if r.finished:
                assert 1 <= len(r.tokens) <= r.params.max_tokens
            continue
        want = expected_tokens(reference[tuple(r.prompt)], r.params)
        if r.finished:
            assert r.tokens == want, (r.request_id, r.mode)
            checked += 1
        else:  # aborted: what it produced so far is the start of the plain output
            assert r.tokens == want[: len(r.tokens)], (r.request_id, r.mode)
    assert max(target_rows) <= BUDGET
    if method == "draft_model":
        assert max(draft_rows) <= BUDGET
        assert any(i.num_draft_catchup_tokens for p in plans for i in p.scheduled)
    # The run exercised what it is meant to.
    assert checked > num_requests // 2 and aborted > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.prefix_hits > 0
    assert engine.spec_stats.num_accepted_tokens > 0
    assert any(i.num_spec_tokens == K_MAX for p in plans for i in p.scheduled)
    return {
        "requests": num_requests,
        "greedy_checked": checked,
        "aborted": aborted,
        "steps": step,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hit_tokens": engine.allocator.prefix_hits,
        "draft_tokens": engine.spec_stats.num_draft_tokens,
        "accepted_tokens": engine.spec_stats.num_accepted_tokens,
        "catchup_chunks": sum(1 for p in plans for i in p.scheduled if i.num_draft_catchup_tokens),
        "max_draft_rows": max(draft_rows, default=0),
    }


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_stress_few_hundred_requests(target, draft, method):
    run_stress(target, draft, method, num_requests=300, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_stress_thousands_of_requests(target, draft, method):
    run_stress(target, draft, method, num_requests=3000, seed=2)
