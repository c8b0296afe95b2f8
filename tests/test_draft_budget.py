"""The draft's catch-up is chunked under the token budget, and its K/V in cached blocks is right."""

from __future__ import annotations

import torch
from specdec.engine.model_runner import ModelRunner
from specdec.engine.sampling_params import SamplingParams
from test_engine_greedy import expected
from tiny_models import make_engine

BUDGET = 64
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def record_rows(runner: ModelRunner) -> list[int]:
    """Wrap runner.run so every forward's row count is appended to the returned list."""
    rows: list[int] = []
    run = runner.run

    def counting(entries):
        rows.append(sum(len(e.token_ids) for e in entries))
        return run(entries)

    runner.run = counting
    return rows


def record_plans(engine) -> list:
    """Wrap the scheduler so every step's plan is appended to the returned list."""
    plans: list = []
    schedule = engine.scheduler.schedule_running

    def recording(*args):
        plan = schedule(*args)
        plans.append(plan)
        return plan

    engine.scheduler.schedule_running = recording
    return plans


def shared_prompt(n: int = 200, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (n,), generator=g).tolist()


def test_draft_catch_up_on_a_cached_prompt_is_chunked_under_the_budget(target, same_as_target):
    """Eight requests hit a cached 200-token prompt the draft never read: the target skips it,
    the draft must read it, in forwards of at most max_num_batched_tokens rows."""
    engine = make_engine(
        target,
        same_as_target,
        max_num_batched_tokens=BUDGET,
        num_kv_blocks=256,
        num_speculative_tokens=4,
        speculative_mode="on",
    )
    free0 = engine.allocator.num_free_blocks
    prompt = shared_prompt()
    # A plain request puts the prompt in the prefix cache without the draft reading it.
    engine.generate([prompt], GREEDY, speculative="off")
    draft_rows = record_rows(engine.proposer.runner)
    target_rows = record_rows(engine.target_runner)
    ps = [prompt + [10 + i] for i in range(8)]
    # Long enough replies that the last of the eight is caught up (oldest first) and drafts.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = engine.generate(ps, params)
    assert [o.output_token_ids for o in outs] == expected(target, ps, 40)
    assert all(o.num_cached_prompt_tokens >= 196 for o in outs)
    assert sum(draft_rows) >= 8 * 196  # the draft did read every prompt
    assert max(draft_rows) <= BUDGET
    assert max(target_rows) <= BUDGET
    # The identical draft, once caught up, agrees with the target on every draft: its K/V
    # written chunk by chunk into shared blocks is exactly the target's prefix.
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)
    assert all(o.spec_stats.acceptance_rate == 1.0 for o in outs)
    assert engine.allocator.num_free_blocks == free0


def test_catching_up_sequence_drafts_nothing_and_decodes_plainly(target, same_as_target):
    engine = make_engine(
        target,
        same_as_target,
        max_num_batched_tokens=32,
        num_kv_blocks=256,
        num_speculative_tokens=4,
        speculative_mode="on",
    )
    prompt = shared_prompt(100)
    engine.generate([prompt], GREEDY, speculative="off")
    engine.add_request("a", prompt + [7], GREEDY)
    plans = record_plans(engine)
    engine.step()  # admission: the target computes the uncached tail, the draft nothing
    seq = engine.scheduler.running[0]
    assert seq.num_draft_computed_tokens == 0
    lag = seq.num_tokens - seq.num_draft_computed_tokens
    while engine.has_unfinished():
        drafted, outputs = seq.num_draft_computed_tokens, seq.num_output_tokens
        engine.step()
        (item,) = plans[-1].scheduled
        if lag > 32:  # still catching up: a 32-row chunk, no drafts, one plain decode
            assert item.num_spec_tokens == 0 and item.num_draft_catchup_tokens == 32
            assert seq.num_draft_computed_tokens == drafted + 32
            assert seq.num_output_tokens == outputs + 1
        else:
            assert item.num_draft_catchup_tokens == 0
        lag = seq.num_tokens - seq.num_draft_computed_tokens
    assert sum(p.scheduled[0].num_draft_catchup_tokens > 0 for p in plans) == 3  # 101 rows
    assert seq.spec_stats.num_draft_tokens > 0


def test_draft_kv_of_cached_blocks_is_valid_only_where_the_draft_computed_it(
    target, same_as_target
):
    engine = make_engine(
        target,
        same_as_target,
        num_kv_blocks=256,
        num_speculative_tokens=4,
        speculative_mode="on",
    )
    free0 = engine.allocator.num_free_blocks
    prompt = shared_prompt(40)
    alloc = engine.allocator
    # Cached by a plain request: the draft's K/V in those blocks was never written.
    engine.generate([prompt + [5]], GREEDY, speculative="off")
    probe = [b for b in alloc.blocks if b.block_hash is not None]
    assert probe and not any(b.draft_valid for b in probe)
    first = engine.generate([prompt + [6]], GREEDY)[0]
    assert first.num_cached_prompt_tokens == 40
    assert first.spec_stats.acceptance_rate == 1.0
    # The speculating request read the prompt into the draft: its blocks are now draft-valid,
    # so a third request's draft starts from the cache and still agrees with the target.
    prefix_blocks = [alloc._cached[h] for h in _prefix_hashes(engine, prompt)]
    assert all(alloc.blocks[b].draft_valid for b in prefix_blocks)
    rows = record_rows(engine.proposer.runner)
    second = engine.generate([prompt + [7]], GREEDY)[0]
    assert second.num_cached_prompt_tokens == 40
    assert rows[0] <= 2  # only the uncached tail and the first sampled token
    assert second.spec_stats.acceptance_rate == 1.0
    assert [o.output_token_ids for o in (first, second)] == expected(
        target, [prompt + [6], prompt + [7]], 20
    )
    assert alloc.num_free_blocks == free0


def _prefix_hashes(engine, prompt: list[int]) -> list:
    """The block hashes a sequence with this prompt would look up, via the allocator itself."""
    from specdec.engine.sequence import Sequence

    probe = Sequence(-1, "probe", prompt + [0], GREEDY, "off")
    engine.allocator.match_prefix(probe)
    hashes = list(probe.block_hashes)
    engine.allocator.free(probe)
    return hashes
