"""Speculative decoding inside continuous batching: lossless, rolled back exactly, no leaks."""

from __future__ import annotations

import pytest
import torch
from helpers_stats import same_distribution_pvalue
from specdec.engine.errors import ConfigError, InvalidRequestError
from specdec.engine.sampling_params import SamplingParams
from test_engine_greedy import expected, prompts, run_staggered
from tiny_models import make_engine, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def unrelated_draft():
    return tiny_hf_model("qwen2", seed=11, layers=1, hidden=32)


def test_identical_draft_commits_k_plus_one_every_step(target, same_as_target):
    engine = make_engine(target, same_as_target, num_speculative_tokens=3, speculative_mode="on")
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)  # 1 + 4 * 4 tokens
    outs = engine.generate(ps, params)
    assert [o.output_token_ids for o in outs] == expected(target, ps, 17)
    for o in outs:
        assert o.spec_stats.acceptance_rate == 1.0
        assert o.spec_stats.mean_accepted_length == 4.0  # every decode step committed k + 1


def test_unrelated_draft_commits_about_one_and_output_is_identical(target, unrelated_draft):
    engine = make_engine(target, unrelated_draft, num_speculative_tokens=4, speculative_mode="on")
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    assert run_staggered(engine, ps) == expected(target, ps)
    assert engine.spec_stats.acceptance_rate < 0.3
    assert engine.spec_stats.mean_accepted_length < 1.5
    assert engine.allocator.num_free_blocks == free0


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_mixed_batch_speculating_plain_and_prefilling(target, unrelated_draft, method):
    draft = target if method == "draft_model" else None
    engine = make_engine(
        target,
        draft or unrelated_draft,
        speculative_method=method,
        num_speculative_tokens=3,
        max_num_batched_tokens=20,  # long prompts prefill over several steps beside decodes
        # The tiny model's replies rarely repeat a bigram of their context; single-token lookups
        # find a continuation for every 'on' request, so each drafts whatever the timing.
        ngram_n_min=1,
        # This is about the engine mixing speculating, plain and prefilling sequences in one
        # step: a fixed policy makes 'auto' sequences speculate too.
        speculative_policy="fixed",
    )
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    # Repetitive prompts give the n-gram proposer more to find.
    ps = [p + p[: max(2, len(p) // 2)] for p in ps]
    results = {}
    modes = ["on", "off", "auto", "on", "off", "on", "auto"]
    step = 0
    pending = list(enumerate(ps))
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY, modes[i])
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[1:])] = out
        step += 1
    assert [results[i].output_token_ids for i in range(len(ps))] == expected(target, ps)
    for i, mode in enumerate(modes):
        drafted = results[i].spec_stats.num_draft_tokens
        # 'on' and (under the fixed policy) 'auto' requests draft at every decode step the
        # n-gram lookup finds something.
        assert (drafted == 0) if mode == "off" else (drafted > 0)
        assert results[i].arm == ("plain" if mode == "off" else "spec")
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.allocator.num_free_blocks == free0


def test_off_requests_never_run_the_draft(target, same_as_target):
    engine = make_engine(target, same_as_target, speculative_mode="off")
    engine.generate(prompts(3), GREEDY)
    assert engine.proposer.num_forwards == 0
    assert engine.spec_stats.num_draft_tokens == 0


def test_preemption_and_prefix_hits_during_speculation_leak_nothing(target, unrelated_draft):
    """Thousands of accept/reject steps with preemption and cached prefixes: free count returns."""
    engine = make_engine(
        target,
        unrelated_draft,
        num_kv_blocks=40,
        max_model_len=100,
        num_speculative_tokens=4,
        speculative_mode="on",
    )
    free0 = engine.allocator.num_free_blocks
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 128, (12,), generator=g).tolist()
    total_steps = 0
    for round_ in range(6):
        ps = [
            shared + torch.randint(2, 128, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 30, (8,), generator=g)
        ]
        params = [
            SamplingParams(temperature=t, max_tokens=40, ignore_eos=True, seed=round_ * 10 + i)
            for i, t in enumerate([0, 1.0] * 4)
        ]
        before = engine.num_steps
        engine.generate(ps, params)
        total_steps += engine.num_steps - before
        assert engine.allocator.num_free_blocks == free0
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.prefix_hits > 0
    assert engine.spec_stats.num_spec_steps > 500


def test_identical_draft_greedy_spec_matches_with_preemption(target, same_as_target):
    engine = make_engine(
        target,
        same_as_target,
        num_kv_blocks=30,
        max_model_len=90,
        speculative_mode="on",
        num_speculative_tokens=4,
    )
    ps = prompts()
    assert run_staggered(engine, ps, every=1) == expected(target, ps)
    assert engine.scheduler.num_preemptions > 0


def test_max_tokens_inside_an_accepted_run(target, same_as_target):
    engine = make_engine(target, same_as_target, speculative_mode="on", num_speculative_tokens=4)
    for max_tokens in (1, 2, 3, 6, 7):
        out = engine.generate(
            prompts(1), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )[0]
        assert out.output_token_ids == expected(target, prompts(1), max_tokens)[0]
        assert out.finish_reason == "length"


def test_stop_token_inside_an_accepted_run(target, same_as_target):
    ref = expected(target, prompts(1), 24)[0]
    stop_at = 9  # a token that greedy decode produces at position 9 (first occurrence)
    stop_tok = ref[stop_at]
    first = ref.index(stop_tok)
    engine = make_engine(target, same_as_target, speculative_mode="on", num_speculative_tokens=4)
    out = engine.generate(
        prompts(1), SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok])
    )[0]
    assert out.output_token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    plain = make_engine(target, same_as_target, speculative_mode="off")
    assert (
        plain.generate(
            prompts(1), SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok])
        )[0].output_token_ids
        == out.output_token_ids
    )


def test_eos_inside_an_accepted_run(target, same_as_target):
    ref = expected(target, prompts(1), 24)[0]
    eos = ref[7]
    # Build engines whose eos is that token (eos ids come from the model config).
    target.config.eos_token_id = eos
    try:
        engine = make_engine(
            target, same_as_target, speculative_mode="on", num_speculative_tokens=4
        )
        out = engine.generate(prompts(1), SamplingParams(temperature=0, max_tokens=24))[0]
    finally:
        target.config.eos_token_id = 1
    assert out.output_token_ids == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "stop"


def many_sequences_engine(tgt, drf, mode: str):
    """k = 3 and room for thousands of short seeded requests, 64 at a time (distribution tests)."""
    return make_engine(
        tgt,
        drf,
        speculative_mode=mode,
        num_speculative_tokens=3,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        num_kv_blocks=600,
    )


def test_sampled_speculative_output_follows_the_target_distribution():
    """Statistical end-to-end check through the engine: tokens 0..2 of many seeded requests
    with speculation on have the same distribution as plain sampling (two-sample chi-square),
    while a wrong engine (drafts always accepted) is told apart by the same test."""

    vocab = 12
    tgt = tiny_hf_model("qwen2", seed=1, vocab=vocab, hidden=32)
    drf = tiny_hf_model("qwen2", seed=2, vocab=vocab, hidden=32)
    n = 4000
    prompt = [3, 5, 7]

    def run(mode, always_accept=False):
        engine = many_sequences_engine(tgt, drf, mode)
        if always_accept:
            import specdec.engine.llm_engine as le

            original = le.verify_drafts

            def accept_all(target_probs, draft_ids, draft_probs, num_drafts, *rest):
                res = original(target_probs, draft_ids, draft_probs, num_drafts, *rest)
                for b in range(len(num_drafts)):
                    k = int(num_drafts[b])
                    res.output_token_ids[b, :k] = draft_ids[b, :k]
                    res.num_accepted[b] = k
                return res

            le.verify_drafts = accept_all
        try:
            params = [
                SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s)
                for s in range(n)
            ]
            outs = engine.generate([prompt] * n, params)
        finally:
            if always_accept:
                le.verify_drafts = original
        return [tuple(o.output_token_ids) for o in outs]

    plain, spec, wrong = run("off"), run("on"), run("on", always_accept=True)

    for pos in range(3):
        assert same_distribution_pvalue(plain, spec, pos) > 1e-4, pos
    assert min(same_distribution_pvalue(plain, wrong, pos) for pos in (1, 2)) < 1e-4


def test_bad_speculation_input(target, same_as_target):
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make_engine(target, same_as_target, num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make_engine(target, same_as_target, num_speculative_tokens=1000)
    with pytest.raises(ConfigError, match="ngram_n_min"):
        make_engine(target, speculative_method="ngram", ngram_n_min=5, ngram_n_max=2)
    plain = make_engine(target, speculative_method="none")
    with pytest.raises(InvalidRequestError, match="no proposer"):
        plain.add_request("x", [1, 2, 3], GREEDY, "on")
    assert not plain.has_unfinished()
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(target, tiny_hf_model("qwen2", vocab=64))


def test_greedy_steps_build_no_distribution_per_row(target, unrelated_draft, monkeypatch):
    """All-greedy speculative steps verify and draft from picks alone: neither the target's nor
    the draft's rows become vocabulary-wide distributions, and the output is plain decode's."""
    import specdec.engine.llm_engine as llm_engine

    import specdec.proposers as proposers

    def refuse(*args, **kwargs):
        raise AssertionError("a greedy step built a distribution per row")

    monkeypatch.setattr(llm_engine, "probs_for_rows", refuse)
    monkeypatch.setattr(proposers, "probs_for_rows", refuse)
    engine = make_engine(target, unrelated_draft, num_speculative_tokens=3, speculative_mode="on")
    ps = prompts(3)
    assert run_staggered(engine, ps) == expected(target, ps)
    assert engine.spec_stats.num_draft_tokens > 0
