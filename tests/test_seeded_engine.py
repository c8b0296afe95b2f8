"""A seeded request's text depends only on its seed and its prompt: not on k, the batch, the load,
the arm (speculation on / auto / off), the proposer or preemption. And sampling kernels are called
once per rule per step, never once per row."""

from __future__ import annotations

import pytest
import torch
from specdec.engine.gpu_sampling import TorchKernels
from specdec.engine.sampling_params import SamplingParams
from tiny_models import make_engine, noisy_copy

TOKENS = 24
PROMPT = [5, 9, 33, 2, 17, 80, 44, 5, 9, 33, 2, 17]  # repeats itself: n-gram lookups find drafts


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=TOKENS, ignore_eos=True, seed=seed, **kw)


@pytest.fixture(scope="module")
def draft(target):
    # A draft close to the target, so that drafts of a seeded request are often accepted.
    return noisy_copy(target, 0.05, seed=1)


def other_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 128, (int(k),), generator=g).tolist() for k in range(6, 6 + n)]


@pytest.fixture(scope="module")
def alone(target):
    """Plain decode of each seeded request alone, on an engine without a proposer."""
    engine = make_engine(target)
    out = {s: engine.generate([PROMPT], seeded(s))[0].output_token_ids for s in (1234, 7, 8, 9, 10)}
    # The first neighbour of `run_loaded`, alone.
    out["r0"] = engine.generate([other_prompts(1)[0]], seeded(100))[0].output_token_ids
    return out


def run_loaded(engine, mode: str) -> dict[str, list[int]]:
    """The seeded request among seeded, unseeded and greedy ones arriving one per step, each with
    its own speculative mode; returns every request's output tokens."""
    requests = [("me", PROMPT, seeded(1234), mode)]
    modes = ["on", "off", "auto"]
    for i, prompt in enumerate(other_prompts(6)):
        if i % 3 == 0:
            params = seeded(100 + i)
        elif i % 3 == 1:
            params = SamplingParams(temperature=1.0, max_tokens=TOKENS, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        requests.insert(i % 4, (f"r{i}", prompt, params, modes[i % 3]))
    out: dict[str, list[int]] = {}
    pending = list(requests)
    while pending or engine.has_unfinished():
        if pending:
            rid, prompt, params, m = pending.pop(0)
            engine.add_request(rid, prompt, params, m)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.output_token_ids
    return out


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_text_is_the_same_alone_under_load_and_in_every_arm(target, draft, alone, method):
    want = alone[1234]
    assert alone[7] != want  # another seed gives another text: the comparisons are not vacuous
    accepted = drafted = 0
    for k in (1, 3, 6):
        engine = make_engine(
            target,
            draft,
            speculative_method=method,
            num_speculative_tokens=k,
            ngram_n_min=1,
            max_num_batched_tokens=32,  # prompts prefill in chunks beside decodes
            speculative_policy="fixed",  # 'auto' speculates on every decode step
        )
        free0 = engine.allocator.num_free_blocks
        for mode in ("on", "auto", "off"):
            out = engine.generate([PROMPT], seeded(1234), speculative=mode)[0]
            assert out.output_token_ids == want, (k, mode, "alone")
            if mode == "on":
                accepted += out.spec_stats.num_accepted_tokens
                drafted += out.spec_stats.num_draft_tokens
            loaded = run_loaded(engine, mode)
            assert loaded["me"] == want, (k, mode, "under load")
            assert loaded["r0"] == alone["r0"]  # a seeded neighbour is stable too
        assert engine.allocator.num_free_blocks == free0
    assert drafted > 0
    if method == "draft_model":
        assert accepted > 0  # speculation really committed drafts of the seeded request


def test_seeded_text_survives_preemption_and_recompute(target, draft, alone):
    engine = make_engine(
        target,
        draft,
        num_kv_blocks=24,  # 96 slots for 5 requests of ~36 tokens: some are preempted
        max_model_len=64,
        num_speculative_tokens=3,
        speculative_mode="on",
    )
    free0 = engine.allocator.num_free_blocks
    seeds = [1234, 7, 8, 9, 10]
    outs = engine.generate([PROMPT] * len(seeds), [seeded(s) for s in seeds])
    assert engine.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == [alone[s] for s in seeds]
    assert engine.allocator.num_free_blocks == free0


def test_seeded_text_with_penalties_and_filters_matches_plain(target, draft):
    """Penalties and filters see the drafts as context at each verify row: the same as plain."""
    params = seeded(5, top_k=40, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.3)
    want = make_engine(target).generate([PROMPT], params)[0].output_token_ids
    engine = make_engine(target, draft, num_speculative_tokens=4, speculative_mode="on")
    out = engine.generate([PROMPT], params)[0]
    assert out.output_token_ids == want
    assert out.spec_stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- batched kernel calls


class CountingKernels(TorchKernels):
    """The CPU stand-in kernels, recording (operation, rows) of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def sample(self, probs, *args):
        self.calls.append(("sample", probs.shape[0]))
        return super().sample(probs, *args)

    def chain(self, draft_probs, draft_token_ids, target_probs, *args):
        self.calls.append(("chain", draft_token_ids.shape[0]))
        return super().chain(draft_probs, draft_token_ids, target_probs, *args)


def test_sampling_kernels_are_called_per_step_not_per_row(target, draft):
    k = 3
    engine = make_engine(
        target,
        draft,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        num_speculative_tokens=k,
        speculative_mode="on",
    )
    kernels = CountingKernels()
    engine.sampling_kernels = kernels
    engine.proposer.kernels = kernels
    free0 = engine.allocator.num_free_blocks
    for i, prompt in enumerate(other_prompts(16)):
        seed = 50 + i if i % 4 == 0 else None  # seeded rows are batched too (in torch)
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=seed)
        engine.add_request(f"r{i}", prompt, params)
    steps = 0
    while engine.has_unfinished():
        kernels.calls.clear()
        before = engine.proposer.num_forwards
        engine.step()
        forwards = engine.proposer.num_forwards - before
        samples = [rows for op, rows in kernels.calls if op == "sample"]
        chains = [rows for op, rows in kernels.calls if op == "chain"]
        # One sample call per draft forward and one for the verify step at most; one chain call
        # per distinct draft count.
        assert len(samples) <= forwards + 1, kernels.calls
        assert len(chains) <= k, kernels.calls
        if steps == 1:  # every sequence decodes: the unseeded rows went in whole calls
            assert max(samples + chains) >= 12, kernels.calls
        steps += 1
    assert steps >= 4
    assert engine.allocator.num_free_blocks == free0
