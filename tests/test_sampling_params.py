"""Ranges of the sampling parameters: one table (BOUNDS) checked by SamplingParams, stated by the
API schema; accepted extremes give finite distributions; error messages read cleanly."""

from __future__ import annotations

import re

import pytest
import torch
from specdec.engine.errors import InvalidRequestError
from specdec.engine.sampling import RowContext, compute_probs
from specdec.engine.sampling_params import BOUNDS, MAX_STOP_SEQUENCES, SamplingParams
from tiny_models import make_engine, tiny_hf_model

# (parameter, accepted values, refused values): the documented edges and just past them.
RANGES = [
    ("temperature", [0.0, 1e-6, 2.0], [-0.1, 2.01, 1e9]),
    ("top_p", [1e-9, 1.0], [0.0, -1.0, 1.01]),
    ("top_k", [-1, 0, 1, 2**31 - 1], [-2, 2**31, 2**70]),
    ("min_p", [0.0, 1.0], [-0.01, 1.01]),
    ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01]),
    ("frequency_penalty", [-2.0, 2.0], [-2.01, 2.01]),
    ("repetition_penalty", [0.01, 1.0, 2.0], [1e-38, 0.0, -1.0, 0.0099, 2.01, 1e30]),
    ("seed", [-(2**63), 0, 2**64 - 1], [-(2**63) - 1, 2**64]),
    ("max_tokens", [1, 10**9], [0, -1]),
]


@pytest.mark.parametrize(("name", "good", "bad"), RANGES)
def test_each_range_accepts_its_edges_and_refuses_beyond(name, good, bad):
    for value in good:
        assert getattr(SamplingParams(**{name: value}), name) == value
    for value in bad:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{name: value})
        assert info.value.param == name
        assert info.value.message.startswith(f"{name} must be")


def test_every_bounded_parameter_is_covered():
    assert {name for name, _, _ in RANGES} == set(BOUNDS)


def test_non_finite_and_wrong_types():
    for name in ("temperature", "top_p", "repetition_penalty"):
        for value in (float("nan"), float("inf"), "1", True):
            with pytest.raises(InvalidRequestError) as info:
                SamplingParams(**{name: value})
            assert info.value.param == name
    with pytest.raises(InvalidRequestError, match="token ids"):
        SamplingParams(stop_token_ids=[2**40])


BAD_KWARGS = [
    {"temperature": -1},
    {"temperature": float("nan")},
    {"temperature": "x"},
    {"top_p": 0},
    {"top_k": -3},
    {"top_k": 1.5},
    {"min_p": 2},
    {"presence_penalty": 9},
    {"repetition_penalty": 0},
    {"seed": "s"},
    {"seed": 2**65},
    {"max_tokens": 0},
    {"max_tokens": 1.5},
    {"stop": [""]},
    {"stop": [str(i) for i in range(MAX_STOP_SEQUENCES + 1)]},
    {"stop_token_ids": [-1]},
    {"stop_token_ids": list(range(4 * MAX_STOP_SEQUENCES + 1))},
]


@pytest.mark.parametrize("kwargs", BAD_KWARGS)
def test_messages_do_not_repeat_words(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    message = info.value.message
    (name,) = kwargs
    assert message.startswith(f"{name} ")
    # "stop stop strings must be ..." and its kind: no word twice in a row, and the parameter's
    # name is said once.
    assert not re.search(r"\b([a-z_]+)\s+\1\b", message), message
    assert message.count(name) == 1, message


@pytest.fixture(scope="module")
def engine():
    return make_engine(tiny_hf_model("qwen2"), max_model_len=96)


EXTREMES = [
    {"repetition_penalty": 0.01},
    {"repetition_penalty": 2.0, "frequency_penalty": 2.0, "presence_penalty": 2.0},
    {"repetition_penalty": 0.01, "frequency_penalty": -2.0, "presence_penalty": -2.0},
    {"temperature": 2.0, "repetition_penalty": 0.01},
    {"temperature": 1e-6, "repetition_penalty": 2.0},
]


@pytest.mark.parametrize("kwargs", EXTREMES)
def test_accepted_extremes_give_finite_distributions(engine, kwargs):
    params = SamplingParams(**kwargs)
    # Logits as large as a real model's (the tiny model's are small): the penalty scales them.
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 30
    rows = [RowContext(params, list(range(0, 200, 3)), list(range(1, 40)))] * 4
    probs = compute_probs(logits, rows)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4), atol=1e-4)

    free = engine.allocator.num_free_blocks
    params = SamplingParams(**kwargs, max_tokens=24, ignore_eos=True, seed=1)
    (out,) = engine.generate([list(range(5, 45))], params)
    assert len(out.output_token_ids) == 24
    # An overflowed distribution samples token 0 at every step.
    assert set(out.output_token_ids) != {0}
    assert engine.allocator.num_free_blocks == free


@pytest.mark.parametrize(
    "kwargs, greedy",
    [({"temperature": 0.0}, True), ({"temperature": 1.0, "top_k": 1}, True),
     ({"temperature": 0.7}, False), ({"temperature": 1.0, "top_p": 0.9}, False)],
)  # fmt: skip
def test_warped_rows_are_exactly_the_non_greedy_ones(kwargs, greedy):
    params = SamplingParams(**kwargs)
    assert params.greedy is greedy
    assert params.warped is not greedy
