"""Table-driven tests of the scheduler's budget, chunking, k capping and rollback arithmetic."""

from __future__ import annotations

import pytest
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, page=4, max_seqs=8, budget=32, max_len=200, policy="fcfs"):
    alloc = BlockAllocator(num_blocks, page, enable_prefix_caching=False)
    return alloc, Scheduler(alloc, max_seqs, budget, max_len, policy)


def schedule_with_k(sched, k):
    """A step whose decode-ready sequences were given k drafts each by a policy."""
    plan = sched.schedule_running()
    ready = plan.decode_ready
    sched.add_drafts(plan, ready, [k] * len(ready))
    sched.admit(plan)
    return plan


def seq(i, n_prompt, max_tokens=50, arrival=0.0):
    return Sequence(
        i,
        f"s{i}",
        list(range(1, n_prompt + 1)),
        SamplingParams(max_tokens=max_tokens),
        "on",
        arrival_time=arrival,
    )


@pytest.mark.parametrize(
    "prompts,budget,expected_new",
    [
        ([10], 32, [10]),  # fits whole
        ([40], 32, [32]),  # chunked to the budget
        ([20, 20], 32, [20, 12]),  # second chunked by what is left
        ([5, 5, 5], 8, [5, 3]),  # third waits
    ],
)
def test_prefill_chunks_respect_budget(prompts, budget, expected_new):
    _, sched = make(budget=budget)
    for i, n in enumerate(prompts):
        sched.add(seq(i, n))
    plan = sched.schedule()
    assert [s.num_new_tokens for s in plan.scheduled] == expected_new
    assert plan.num_batched_tokens <= budget


@pytest.mark.parametrize(
    "k_asked,output_so_far,max_tokens,budget,k_expected",
    [
        (4, 0, 50, 32, 4),
        (4, 1, 4, 32, 2),  # 3 more tokens may be emitted: 1 + 2 drafts
        (4, 1, 2, 32, 0),  # last token: nothing to verify
        (8, 0, 50, 5, 4),  # budget 5 = 1 decode row + 4 drafts
        (0, 0, 50, 32, 0),
    ],
)
def test_k_is_capped_by_max_tokens_and_budget(
    k_asked, output_so_far, max_tokens, budget, k_expected
):
    alloc, sched = make(budget=budget)
    s = seq(0, 6, max_tokens=max_tokens)
    sched.add(s)
    sched.schedule()
    s.num_computed_tokens = 6
    s.append_token(99)  # first output token: now decode-ready
    plan = schedule_with_k(sched, k_asked)
    assert plan.scheduled[0].num_new_tokens == 1
    assert plan.scheduled[0].num_spec_tokens == k_expected
    assert len(s.block_table) * alloc.page_size >= s.num_tokens + k_expected


def test_preemption_takes_the_newest_and_requeues_it_first():
    alloc, sched = make(num_blocks=6, page=4, budget=64)
    a, b = seq(0, 10), seq(1, 10)
    sched.add(a)
    sched.add(b)
    sched.schedule()  # a: 3 blocks, b: 3 blocks -> pool full
    for s in (a, b):
        s.num_computed_tokens = 10
        s.append_token(5)
        s.append_token(6)
        s.append_token(7)  # 13 tokens: a needs a 4th block
        s.num_computed_tokens = 12
    plan = sched.schedule()
    assert plan.preempted == [b]
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert [s.seq for s in plan.scheduled] == [a]


def test_spf_prefers_short_prompts_but_ages_long_ones():
    _, sched = make(max_seqs=1, policy="spf")
    long_old = seq(0, 60, arrival=0.0)
    short_new = seq(1, 5, arrival=1e12)  # arrived "now"
    sched.add(long_old)
    sched.add(short_new)
    # long_old has waited ~forever: its aged length is far below the short one's.
    assert sched.schedule().scheduled[0].seq is long_old


def test_spf_without_aging_difference_picks_shortest():
    import time

    _, sched = make(max_seqs=1, policy="spf")
    now = time.monotonic()
    sched.add(seq(0, 60, arrival=now))
    sched.add(seq(1, 5, arrival=now))
    assert sched.schedule().scheduled[0].seq.seq_id == 1


def test_rollback_after_every_speculative_step():
    """After each step: computed == num_tokens - 1 and the table holds exactly the needed blocks."""
    from tiny_models import make_engine, noisy_copy, tiny_hf_model

    target = tiny_hf_model("qwen2", seed=0)
    engine = make_engine(
        target, noisy_copy(target, 0.05), speculative_mode="on", num_speculative_tokens=4
    )
    engine.add_request(
        "a", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    seen_partial = False
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            assert s.num_computed_tokens == s.num_tokens - 1
            assert s.num_draft_computed_tokens <= s.num_tokens - 1
            # Blocks wholly past the committed tokens went back; the newest token's slot may
            # still be unallocated (it is allocated when the next step schedules it).
            need = engine.allocator.blocks_needed
            assert need(s.num_computed_tokens) <= len(s.block_table) <= need(s.num_tokens)
            seen_partial |= 0 < s.spec_stats.num_accepted_tokens < s.spec_stats.num_draft_tokens
    assert seen_partial


@pytest.mark.parametrize(
    "lags,budget,k_expected,catchup_expected",
    [
        ([1, 2, 1], 32, [4, 4, 4], [0, 0, 0]),  # steady decoding: every lag fits
        ([30, 40], 32, [4, 0], [0, 2]),  # the oldest fits; the other reads what is left
        ([100, 1, 2], 32, [0, 4, 4], [29, 0, 0]),  # one far behind does not stop the others
        ([100, 50], 32, [0, 0], [32, 0]),  # oldest first: the second waits its turn
        ([32, 1], 32, [4, 0], [0, 0]),  # a lag of exactly the budget fits; nothing is left
    ],
)
def test_draft_catch_up_is_held_to_the_token_budget(lags, budget, k_expected, catchup_expected):
    alloc = BlockAllocator(256, 4, enable_prefix_caching=False)
    sched = Scheduler(alloc, 8, budget, 400, draft_catches_up=True)
    seqs = [seq(i, 100) for i in range(len(lags))]
    for s in seqs:
        sched.add(s)
    while any(s.num_computed_tokens < 100 for s in seqs):
        for item in sched.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
    for s, lag in zip(seqs, lags, strict=True):
        s.append_token(99)  # decode-ready: the draft lags `lag` tokens behind
        s.num_draft_computed_tokens = s.num_tokens - lag
    plan = schedule_with_k(sched, 4)
    assert [i.num_spec_tokens for i in plan.scheduled] == k_expected
    assert [i.num_draft_catchup_tokens for i in plan.scheduled] == catchup_expected
    drafting = sum(lag for lag, k in zip(lags, k_expected, strict=True) if k)
    assert drafting + sum(catchup_expected) <= budget


def test_without_a_draft_model_lag_is_not_counted():
    """An n-gram proposer keeps no K/V: the draft's counts never move and nothing is chunked."""
    alloc, sched = make(budget=32)
    s = seq(0, 60)
    sched.add(s)
    while s.num_computed_tokens < 60:
        for item in sched.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
    s.append_token(99)
    (item,) = schedule_with_k(sched, 4).scheduled
    assert (item.num_spec_tokens, item.num_draft_catchup_tokens) == (4, 0)
