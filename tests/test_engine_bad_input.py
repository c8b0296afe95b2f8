"""Bad input is refused with a clear error before any engine state changes."""

from __future__ import annotations

import pytest
from specdec.engine.config import EngineConfig
from specdec.engine.errors import (
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from specdec.engine.sampling_params import SamplingParams
from tiny_models import make_engine, tiny_hf_model


@pytest.fixture(scope="module")
def engine():
    return make_engine(tiny_hf_model("qwen2"), max_model_len=64)


def snapshot(engine):
    return (
        engine.allocator.num_free_blocks,
        len(engine.scheduler.waiting),
        len(engine.scheduler.running),
        engine.num_steps,
    )


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "abc"}, "seed"),
    ],
)
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in info.value.message


def test_prompt_longer_than_max_model_len_changes_nothing(engine):
    before = snapshot(engine)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        engine.add_request("long", list(range(2, 100)), SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        engine.add_request("long2", list(range(2, 40)), SamplingParams(max_tokens=40))
    assert snapshot(engine) == before
    # The request ids were not taken either.
    engine.add_request("long", [2, 3], SamplingParams(max_tokens=2, temperature=0))
    outs = engine.generate([[4, 5]], SamplingParams(max_tokens=2, temperature=0))
    assert outs[0].finished


def test_bad_prompts(engine):
    before = snapshot(engine)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("v", [1, 10_000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("s", "text but no tokenizer", SamplingParams())
    with pytest.raises(InvalidRequestError, match="speculative"):
        engine.add_request("m", [1, 2], SamplingParams(), speculative="sometimes")
    assert snapshot(engine) == before


def test_running_requests_are_unaffected_by_rejected_ones():
    eng = make_engine(tiny_hf_model("qwen2"), max_model_len=64)
    ref = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    eng.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    eng.step()
    with pytest.raises(PromptTooLongError):
        eng.add_request("bad", list(range(2, 80)), SamplingParams())
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            done[o.request_id] = o
    assert done["ok"].output_token_ids == ref[0].output_token_ids


def test_duplicate_request_id_is_refused():
    eng = make_engine(tiny_hf_model("qwen2"))
    eng.add_request("same", [1, 2], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("same", [1, 2], SamplingParams())


def test_abort_frees_blocks():
    eng = make_engine(tiny_hf_model("qwen2"))
    free0 = eng.allocator.num_free_blocks
    eng.add_request("a", list(range(2, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.allocator.num_free_blocks < free0
    assert eng.abort("a") and not eng.abort("a")
    assert eng.allocator.num_free_blocks == free0 and not eng.has_unfinished()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"speculative_method": "magic"}, "speculative_method"),
        ({"speculative_mode": "maybe"}, "speculative_mode"),
        ({"page_size": 3}, "page_size"),
        ({"max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"speculative_method": "draft_model", "draft_model": None}, "draft-model"),
        ({"dtype": "int3"}, "dtype"),
    ],
)
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_kv_pool_too_small_for_max_model_len():
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        make_engine(tiny_hf_model("qwen2"), num_kv_blocks=4, max_model_len=200)


def test_unknown_model_name_or_path(tmp_path):
    from specdec.engine.llm_engine import LLMEngine

    with pytest.raises(ModelNotFoundError):
        LLMEngine(
            EngineConfig(model="no-such-model-anywhere", speculative_method="none", device="cpu")
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLMEngine(
            EngineConfig(model=str(tmp_path / "empty"), speculative_method="none", device="cpu")
        )
