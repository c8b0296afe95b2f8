"""In-process tests of the engine loop thread (AsyncEngine) and of the A/B arm assignment."""

from __future__ import annotations

import asyncio
import time

import pytest
from specdec.api.ab import ArmAssigner
from specdec.engine.async_engine import AsyncEngine, EngineDeadError, LoopHooks, QueueFullError
from specdec.engine.errors import InvalidRequestError, PromptTooLongError
from specdec.engine.sampling_params import SamplingParams
from tiny_models import make_engine, tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13], [7, 7, 2, 40, 41], [100, 3]]


@pytest.fixture(scope="module")
def hf_models():
    return tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1, layers=1)


def run_loop(engine, coro_fn, **kwargs):
    """Start an AsyncEngine around ``engine``, run ``coro_fn(async_engine)``, stop it."""
    async_engine = AsyncEngine(engine, idle_poll_s=0.01, **kwargs)
    async_engine.start()
    try:
        return asyncio.run(asyncio.wait_for(coro_fn(async_engine), 60))
    finally:
        async_engine.stop()


async def collect(stream) -> list:
    return [out async for out in stream]


def test_concurrent_requests_match_the_sync_engine(hf_models):
    expected = make_engine(*hf_models).generate(PROMPTS, GREEDY)
    engine = make_engine(*hf_models)
    free0 = engine.allocator.num_free_blocks

    async def main(ae: AsyncEngine):
        streams = [
            await ae.add_request(f"r{i}", p, GREEDY, speculative=("on", "off", "auto")[i])
            for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = run_loop(engine, main)
    for outs, want in zip(results, expected, strict=True):
        assert outs[-1].finished and sum(not o.finished for o in outs) == len(outs) - 1
        assert outs[-1].output_token_ids == want.output_token_ids
        # The deltas add up to the whole output, in order.
        assert [t for o in outs for t in o.new_token_ids] == want.output_token_ids
    assert [r[-1].arm for r in results] == ["spec", "plain", "spec"]
    assert engine.allocator.num_free_blocks == free0


def test_rejected_requests_change_nothing(hf_models):
    engine = make_engine(*hf_models)
    free0 = engine.allocator.num_free_blocks

    async def main(ae: AsyncEngine):
        with pytest.raises(PromptTooLongError):
            await ae.add_request("long", [5] * 300, GREEDY)
        with pytest.raises(InvalidRequestError):
            await ae.add_request("vocab", [5, 10_000], GREEDY)
        with pytest.raises(InvalidRequestError):
            await ae.add_request("mode", [5], GREEDY, speculative="sometimes")

    run_loop(engine, main)
    assert not engine.has_unfinished() and engine.num_steps == 0
    assert engine.allocator.num_free_blocks == free0


def test_abort_mid_generation_frees_blocks(hf_models):
    engine = make_engine(*hf_models)
    free0 = engine.allocator.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main(ae: AsyncEngine):
        stream = await ae.add_request("a", PROMPTS[0], params)
        await stream.get()
        assert ae.snapshot.num_running == 1
        ae.abort("a")
        deadline = time.monotonic() + 10
        while ae.snapshot.num_running or ae.snapshot.num_free_blocks != free0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    run_loop(engine, main, hooks=LoopHooks(step_delay_s=0.01))
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == free0


def test_queue_limit(hf_models):
    engine = make_engine(*hf_models, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main(ae: AsyncEngine):
        running = await ae.add_request("a", PROMPTS[0], params)
        await running.get()
        await ae.add_request("b", PROMPTS[1], params)  # waits: the queue holds one
        with pytest.raises(QueueFullError):
            await ae.add_request("c", PROMPTS[2], params)
        ae.abort("a")
        ae.abort("b")

    run_loop(engine, main, max_queue_len=1, hooks=LoopHooks(step_delay_s=0.01))


def test_loop_death_reaches_every_request(hf_models):
    engine = make_engine(*hf_models)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main(ae: AsyncEngine):
        stream = await ae.add_request("a", PROMPTS[0], params)
        with pytest.raises(EngineDeadError, match="injected fault"):
            await collect(stream)
        assert not ae.is_alive and "injected fault" in ae.error
        with pytest.raises(EngineDeadError):
            await ae.add_request("b", PROMPTS[1], params)

    run_loop(engine, main, hooks=LoopHooks(fail_after_steps=3))


def test_stop_ends_open_streams(hf_models):
    engine = make_engine(*hf_models)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ae = AsyncEngine(engine, idle_poll_s=0.01, hooks=LoopHooks(step_delay_s=0.01))
    ae.start()

    async def main():
        stream = await ae.add_request("a", PROMPTS[0], params)
        await stream.get()
        await asyncio.to_thread(ae.stop)
        with pytest.raises(EngineDeadError):
            await collect(stream)
        assert not ae.is_alive

    asyncio.run(asyncio.wait_for(main(), 30))


# ---- A/B assignment ---------------------------------------------------------------------------


def arms(assigner: ArmAssigner, n: int = 200) -> list[str]:
    return [assigner.assign(None, None).arm for _ in range(n)]


def test_ab_split_is_seeded_and_honours_p():
    first = arms(ArmAssigner("auto", True, split=0.3, seed=11))
    assert first == arms(ArmAssigner("auto", True, split=0.3, seed=11))
    assert first != arms(ArmAssigner("auto", True, split=0.3, seed=12))
    assert 30 <= first.count("spec") <= 90  # Binomial(200, 0.3): mean 60, sd 6.5
    assert set(arms(ArmAssigner("auto", True, split=0.0, seed=1))) == {"plain"}
    assert set(arms(ArmAssigner("auto", True, split=1.0, seed=1))) == {"spec"}


def test_ab_choice_order_and_modes():
    a = ArmAssigner("off", True, split=0.5, seed=0)
    assert a.assign("on", "off").mode == "on"  # body beats header
    assert a.assign(None, " OFF ").arm == "plain"
    spec = next(x for x in (a.assign(None, None) for _ in range(50)) if x.arm == "spec")
    assert spec.mode == "auto" and spec.chosen_by == "ab_split"  # server default is off
    with pytest.raises(InvalidRequestError) as err:
        a.assign(None, "sometimes")
    assert err.value.param == "X-Specdec-Speculative"
    no_proposer = ArmAssigner("auto", False, split=0.9, seed=0)
    assert set(arms(no_proposer, 20)) == {"plain"}
    assert ArmAssigner("auto", True).assign(None, None).chosen_by == "default"
