"""Token trees through the engine: drafted level by level, verified in the batch's one target
forward, output identical to plain decode, KV moved into place and never leaked or cached wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers_stats import same_distribution_pvalue
from specdec.engine.attention.base import slots_for_positions
from specdec.engine.errors import ConfigError
from specdec.engine.model_runner import RunEntry
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence
from test_engine_greedy import expected, prompts, run_staggered
from tiny_models import make_engine

from specdec.controller.step_cost import StepCostModel

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def noisy_draft(target):
    """The target with a perturbed lm_head: its first choice is often wrong where its second is
    right, which is where a tree gains over a chain."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std() * 0.9)
    return draft


def tree_engine(target, draft, nodes: int = 8, growth: str = "dynamic", **overrides):
    options = dict(num_speculative_tokens=4, speculative_policy="fixed", speculative_mode="on")
    options.update(overrides)
    return make_engine(target, draft, spec_tree_max_nodes=nodes, spec_tree_growth=growth, **options)


@pytest.mark.parametrize("growth", ["dynamic", "static"])
def test_greedy_trees_equal_plain_decode_in_a_mixed_batch(target, noisy_draft, growth):
    engine = tree_engine(target, noisy_draft, growth=growth, max_num_batched_tokens=40)
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    assert run_staggered(engine, ps) == expected(target, ps)
    stats = engine.spec_stats
    assert stats.num_tree_steps > 0 and 1 < stats.nodes_per_tree_step <= 8
    assert sum(stats.accepted_per_rank[1:]) > 0  # some accepted nodes were second choices
    assert engine.allocator.num_free_blocks == free0


def test_a_tree_commits_more_per_target_forward_than_the_chain_of_its_depth(target, noisy_draft):
    ps = prompts(5, seed=3)
    chain = make_engine(
        target, noisy_draft, num_speculative_tokens=4, speculative_policy="fixed",
        speculative_mode="on",
    )  # fmt: skip
    tree = tree_engine(target, noisy_draft, nodes=16)
    outs = [e.generate(ps, GREEDY) for e in (chain, tree)]
    assert [o.output_token_ids for o in outs[0]] == [o.output_token_ids for o in outs[1]]
    assert tree.spec_stats.mean_accepted_length > chain.spec_stats.mean_accepted_length


def test_ngram_trees_equal_plain_decode(target):
    """Prompt lookup offers the continuations of several earlier occurrences as one tree."""
    engine = make_engine(
        target, None, speculative_method="ngram", ngram_n_min=1, num_speculative_tokens=3,
        speculative_policy="fixed", speculative_mode="on", spec_tree_max_nodes=8,
    )  # fmt: skip
    free0 = engine.allocator.num_free_blocks
    ps = [p + p + p[: len(p) // 2] for p in prompts(5, seed=7)]  # repeats to look up
    outs = engine.generate(ps, GREEDY)
    assert [o.output_token_ids for o in outs] == expected(target, ps)
    assert engine.spec_stats.num_tree_steps > 0
    assert engine.allocator.num_free_blocks == free0


def test_seeded_sampled_trees_commit_what_plain_decode_commits(target, noisy_draft):
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=100 + i, ignore_eos=True)
        for i in range(4)
    ]
    ps = prompts(4, seed=2)
    plain = make_engine(target).generate(ps, params)
    tree_out = tree_engine(target, noisy_draft).generate(ps, params)
    assert [o.output_token_ids for o in tree_out] == [o.output_token_ids for o in plain]


def test_unseeded_sampled_trees_run_and_return_every_block(target, noisy_draft):
    engine = tree_engine(target, noisy_draft, growth="dynamic")
    free0 = engine.allocator.num_free_blocks
    params = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    outs = engine.generate(prompts(6, seed=4), params)
    assert all(len(o.output_token_ids) == 20 for o in outs)
    assert engine.spec_stats.num_tree_steps > 0
    assert engine.allocator.num_free_blocks == free0


def test_prefix_cache_after_trees_holds_only_committed_kv(target, noisy_draft):
    """A later prompt that repeats an earlier request's prompt and output hits blocks written
    during tree steps: its continuation must still be plain decode's."""
    engine = tree_engine(target, noisy_draft, enable_prefix_caching=True)
    first = prompts(1, seed=6)[0]
    out = engine.generate([first], GREEDY)[0].output_token_ids
    again = first + out[:20]
    second = engine.generate([again], GREEDY)[0]
    assert second.num_cached_prompt_tokens >= len(first)  # blocks written during tree steps
    assert second.output_token_ids == expected(target, [again])[0]


def test_tree_usage_reports_nodes_and_ranks(target, noisy_draft):
    out = tree_engine(target, noisy_draft).generate(prompts(1), GREEDY)[0]
    stats = out.spec_stats.to_dict()
    assert stats["num_tree_steps"] > 0
    assert stats["nodes_per_tree_step"] > 1
    assert sum(stats["accepted_per_rank"]) == out.spec_stats.num_accepted_tokens


def test_adaptive_trees_equal_plain_decode_and_return_every_block(target, noisy_draft):
    """The adaptive policy with trees on: its per-step mix of trees, chains and plain decode
    commits plain decode's tokens. The draft here is the target's size, so the policy is given
    prices of a small draft and near-free verify rows, where trees pay."""

    class SmallDraftPrices(StepCostModel):
        def target_time(self, shape):
            return 1.0 + 0.001 * shape.rows

        def draft_time(self, forwards):
            return 0.01 * len(forwards)

        def observe(self, *args):
            pass

    engine = tree_engine(
        target, noisy_draft, speculative_policy="adaptive", speculative_mode="auto",
        max_num_batched_tokens=40,
    )  # fmt: skip
    engine.policy.cost = SmallDraftPrices()
    free0 = engine.allocator.num_free_blocks
    ps = prompts()
    assert run_staggered(engine, ps) == expected(target, ps)
    assert engine.spec_stats.num_tree_steps > 0
    assert engine.policy.tree_acceptance.version > 0  # the tree verifies were counted
    assert engine.allocator.num_free_blocks == free0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(spec_tree_max_nodes=-1), "spec_tree_max_nodes must be in"),
        (dict(spec_tree_max_nodes=65), "spec_tree_max_nodes must be in"),
        (dict(spec_tree_growth="bushy"), "spec_tree_growth must be one of"),
        (dict(spec_tree_branching=0), "spec_tree_branching must be >= 1"),
        (dict(speculative_method="none"), "need a proposer"),
    ],
)
def test_bad_tree_options_are_refused(target, noisy_draft, overrides, message):
    options = dict(speculative_policy="fixed", spec_tree_max_nodes=8)
    options.update(overrides)
    with pytest.raises(ConfigError, match=message):
        make_engine(target, noisy_draft, **options)


@pytest.mark.slow
def test_unseeded_sampled_trees_keep_the_target_distribution():
    """Tokens 0..2 of many unseeded requests drafting trees (siblings drawn without replacement,
    recursive rejection) follow plain sampling's distribution (two-sample chi-square), while an
    engine that accepts every tree's first path is told apart by the same test."""
    import specdec.engine.llm_engine as le
    from tiny_models import tiny_hf_model

    vocab = 12
    tgt = tiny_hf_model("qwen2", seed=1, vocab=vocab, hidden=32)
    drf = tiny_hf_model("qwen2", seed=2, vocab=vocab, hidden=32)
    n = 2000
    options = dict(max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=800)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)

    def run(trees: bool, wrong: bool = False):
        torch.manual_seed(11 if trees else 12)
        if trees:
            engine = tree_engine(tgt, drf, nodes=6, num_speculative_tokens=2, **options)
        else:
            engine = make_engine(tgt, **options)
        original = le.verify_trees
        if wrong:

            def first_path(trees_, probs, greedy, seeds, positions):
                """Accept each tree's first-child path whole: not the target's distribution."""
                res = original(trees_, probs, greedy, seeds, positions)
                for b, tree in enumerate(trees_):
                    path, kids = [], tree.children(-1)
                    while kids and len(path) < res.output_token_ids.shape[1] - 1:
                        path.append(kids[0])
                        kids = tree.children(kids[0])
                    tokens = torch.tensor([tree.tokens[j] for j in path], dtype=torch.int64)
                    res.output_token_ids[b, : len(path)] = tokens
                    res.num_accepted[b] = len(path)
                    res.accepted_nodes[b] = path
                    res.accepted_ranks[b] = [0] * len(path)
                return res

            le.verify_trees = first_path
        try:
            outs = engine.generate([[3, 5, 7]] * n, params)
        finally:
            le.verify_trees = original
        if trees:
            assert engine.spec_stats.num_tree_steps > 0
        return [tuple(o.output_token_ids) for o in outs]

    plain, trees, wrong = run(False), run(True), run(True, wrong=True)

    for pos in range(3):
        assert same_distribution_pvalue(plain, trees, pos) > 1e-4, pos
    assert min(same_distribution_pvalue(plain, wrong, pos) for pos in (1, 2)) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tree_nodes_compute_as_plain_decode_does_in_every_format(target, noisy_draft, dtype):
    """Each tree row attends over its visible keys as one contiguous run, the call plain decode
    makes: greedy trees equal plain decode bit for bit also where rounding is coarse (bf16)."""
    ps = prompts(6, seed=9)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = make_engine(target, dtype=dtype).generate(ps, params)
    trees = tree_engine(target, noisy_draft, nodes=16, dtype=dtype).generate(ps, params)
    assert [o.output_token_ids for o in trees] == [o.output_token_ids for o in plain]


def _draft_kv_rows(engine, seq, positions: list[int]) -> list[torch.Tensor]:
    """The draft pool's keys and values at ``seq``'s token positions, layer by layer."""
    slots = torch.tensor(
        slots_for_positions(seq.block_table, positions, engine.config.page_size), dtype=torch.long
    )
    out = []
    for k_cache, v_cache in engine.proposer.runner.kv.layers:
        for cache in (k_cache, v_cache):
            out.append(cache.reshape(-1, *cache.shape[2:]).index_select(0, slots).float().clone())
    return out


def test_the_draft_keeps_the_accepted_nodes_kv_it_fed(target, noisy_draft):
    """After a tree verify the draft's K/V of the accepted nodes it fed sits at their committed
    positions, equal to what reading those tokens afresh writes, and counts as computed: the
    next catch-up reads only what the draft never fed (the bonus token, an accepted leaf)."""
    engine = tree_engine(target, noisy_draft, nodes=8, num_speculative_tokens=3)
    free0 = engine.allocator.num_free_blocks
    engine.add_request("r", prompts(1, seed=11)[0], SamplingParams(temperature=0, max_tokens=40))
    seq = engine._seqs["r"]
    kept = []
    # Levels of 3 nodes: an accepted second level's node sits at scratch slot T + 3 or later and
    # had to move to T + 1.
    while engine.has_unfinished() and len(kept) < 2:
        before = seq.num_tokens
        steps_before = engine.spec_stats.num_tree_steps
        engine.step()
        if engine.spec_stats.num_tree_steps > steps_before:
            # every committed token of this step but the bonus one is a tree node
            assert before <= seq.num_draft_computed_tokens <= seq.num_tokens - 1
            kept = list(range(before, seq.num_draft_computed_tokens))
    assert len(kept) >= 2, "no tree step accepted two levels the draft had fed"
    moved = _draft_kv_rows(engine, seq, kept)
    # The same tokens read afresh by the draft into a sequence of their own.
    fresh = Sequence(-1, "fresh", seq.token_ids[: kept[-1] + 1], SamplingParams(), "off")
    engine.allocator.allocate(fresh, fresh.num_tokens)
    try:
        engine.proposer.runner.run([RunEntry(fresh, fresh.token_ids, 0, 1)])
        reread = _draft_kv_rows(engine, fresh, kept)
    finally:
        engine.allocator.free(fresh)
    for a, b in zip(moved, reread, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_free_blocks == free0
