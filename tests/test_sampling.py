"""Logits -> probabilities -> tokens: each filter against hand-computed references."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from scipy import stats
from specdec.engine.models import native
from specdec.engine.sampling import RowContext, compute_probs, greedy_picks, sample
from specdec.engine.sampling_params import SamplingParams


def probs_of(logits: list[float], params: SamplingParams, prompt=(), output=()) -> torch.Tensor:
    x = torch.tensor([logits], dtype=torch.float32)
    return compute_probs(x, [RowContext(params, list(prompt), list(output))])[0]


def softmax(values: list[float]) -> torch.Tensor:
    return torch.softmax(torch.tensor(values, dtype=torch.float64), dim=0).float()


def masked_softmax(values: list[float], keep: list[int]) -> torch.Tensor:
    masked = [v if i in keep else -math.inf for i, v in enumerate(values)]
    return softmax(masked)


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = [2.0, -1.0, 0.5, 3.0, -0.5]
    # Token 0 only in the prompt, token 1 only in the output, token 3 in both; 2 and 4 unseen.
    got = probs_of(logits, SamplingParams(repetition_penalty=2.0), prompt=[0, 3], output=[1, 3, 3])
    expected = softmax([1.0, -2.0, 0.5, 1.5, -0.5])
    torch.testing.assert_close(got, expected)


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    got = probs_of([1.0, -1.0, 0.0], SamplingParams(repetition_penalty=0.5), prompt=[0, 1])
    torch.testing.assert_close(got, softmax([2.0, -0.5, 0.0]))


def test_presence_and_frequency_count_output_tokens_only() -> None:
    logits = [1.0, 1.0, 1.0, 1.0]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # Token 0 is in the prompt only: no frequency/presence penalty. Token 1 twice, token 2 once.
    got = probs_of(logits, params, prompt=[0, 0, 0], output=[1, 2, 1])
    expected = softmax([1.0, 1.0 - (2 * 0.5 + 0.25), 1.0 - (0.5 + 0.25), 1.0])
    torch.testing.assert_close(got, expected)


def test_negative_presence_penalty_encourages_repeats() -> None:
    got = probs_of([0.0, 0.0], SamplingParams(presence_penalty=-1.0), output=[1])
    torch.testing.assert_close(got, softmax([0.0, 1.0]))


def test_repetition_applies_before_presence_and_frequency() -> None:
    # rep then freq: (3 / 2) - 1 = 0.5. The other order would give (3 - 1) / 2 = 1.0.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    got = probs_of([3.0, 0.0], params, output=[0])
    torch.testing.assert_close(got, softmax([0.5, 0.0]))


def test_penalty_token_out_of_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="out of range"):
        probs_of([0.0, 0.0], SamplingParams(repetition_penalty=1.5), prompt=[2])


def test_penalties_do_not_leak_between_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        RowContext(SamplingParams(frequency_penalty=2.0), [], [2, 2]),
        RowContext(SamplingParams(), [], [2, 2]),
    ]
    got = compute_probs(logits, rows)
    torch.testing.assert_close(got[0], softmax([1.0, 2.0, -1.0]))
    torch.testing.assert_close(got[1], softmax([1.0, 2.0, 3.0]))


# ---------------------------------------------------------------- temperature and filters


def test_temperature_scales_logits() -> None:
    logits = [1.0, 2.0, 0.5]
    got = probs_of(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(got, softmax([2.0, 4.0, 1.0]))
    got = probs_of(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(got, softmax([0.5, 1.0, 0.25]))


def test_top_k_keeps_k_largest() -> None:
    logits = [1.0, 4.0, 2.0, 3.0, 0.0]
    got = probs_of(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(got, masked_softmax(logits, [1, 3]))


def test_top_k_keeps_all_ties_at_the_boundary() -> None:
    logits = [1.0, 3.0, 2.0, 2.0, 0.0]
    got = probs_of(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(got, masked_softmax(logits, [1, 2, 3]))


def test_top_k_disabled_values() -> None:
    logits = [1.0, 3.0, 2.0]
    for top_k in (0, -1, 3, 100):
        torch.testing.assert_close(probs_of(logits, SamplingParams(top_k=top_k)), softmax(logits))


@pytest.mark.parametrize(
    ("top_p", "keep"),
    [
        (0.3, [0]),  # below the top token's mass: still one token
        (0.5, [0]),  # exactly the top token's mass
        (0.75, [0, 1]),  # exactly the mass of two tokens
        (0.76, [0, 1, 2, 3]),  # just above: the third token is needed, and the fourth ties it
        (0.9, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_boundary(top_p: float, keep: list[int]) -> None:
    logits = log_probs([0.5, 0.25, 0.125, 0.125])
    got = probs_of(logits, SamplingParams(top_p=top_p))
    torch.testing.assert_close(got, masked_softmax(logits, keep))


def test_top_p_without_ties() -> None:
    logits = log_probs([0.1, 0.4, 0.2, 0.3])
    # Sorted: 0.4 (id 1), 0.3 (id 3), 0.2 (id 2): 0.7 < 0.8 so id 2 is needed too.
    got = probs_of(logits, SamplingParams(top_p=0.8))
    torch.testing.assert_close(got, masked_softmax(logits, [1, 2, 3]))


def test_top_p_uses_mass_renormalised_after_top_k() -> None:
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    # After top-k=2 the masses are 4/7 and 3/7; 4/7 >= 0.5 so top-p keeps only token 0.
    # Judged on the raw masses (0.4 < 0.5) it would wrongly keep token 1 too.
    got = probs_of(logits, SamplingParams(top_k=2, top_p=0.5))
    torch.testing.assert_close(got, masked_softmax(logits, [0]))


def test_top_p_after_temperature() -> None:
    logits = log_probs([0.6, 0.3, 0.1])
    # Temperature 0.5 squares the probabilities: 0.36/0.46 = 0.78 >= 0.7 so one token is enough,
    # whereas the raw 0.6 < 0.7 would keep two.
    got = probs_of(logits, SamplingParams(temperature=0.5, top_p=0.7))
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0]))


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    # Threshold 0.2 * 0.5 = 0.1: tokens 0, 1, 2 survive.
    got = probs_of(logits, SamplingParams(min_p=0.2))
    torch.testing.assert_close(got, masked_softmax(logits, [0, 1, 2]))
    got = probs_of(logits, SamplingParams(min_p=0.7))
    torch.testing.assert_close(got, masked_softmax(logits, [0]))


def test_min_p_is_judged_after_temperature() -> None:
    logits = log_probs([0.5, 0.3, 0.2])
    # At temperature 0.5: masses proportional to 0.25, 0.09, 0.04; 0.04/0.25 = 0.16 < 0.3.
    got = probs_of(logits, SamplingParams(temperature=0.5, min_p=0.3))
    torch.testing.assert_close(got, masked_softmax([2 * v for v in logits], [0, 1]))


def test_all_filters_together() -> None:
    logits = [3.0, 2.5, 2.0, 1.0, 0.5, -1.0]
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.1)
    got = probs_of(logits, params)
    # Reference computed step by step in float64.
    scaled = torch.tensor(logits, dtype=torch.float64) / 0.8
    keep = [0, 1, 2, 3]  # top-k
    p = masked_softmax(scaled.tolist(), keep).double()
    order = torch.argsort(p, descending=True)
    cum, kept = 0.0, []
    for idx in order.tolist():
        if cum >= 0.9:
            break
        kept.append(idx)
        cum += p[idx].item()
    p2 = masked_softmax(scaled.tolist(), kept).double()
    kept = [i for i in kept if p2[i] >= 0.1 * p2.max()]
    torch.testing.assert_close(got, masked_softmax(scaled.tolist(), kept))
    assert (got > 0).sum().item() == len(kept) < 4


# ---------------------------------------------------------------- greedy


def test_greedy_is_exact_one_hot_at_argmax() -> None:
    got = probs_of([0.1, 2.0, 1.9, -3.0], SamplingParams(temperature=0.0))
    assert got.dtype == torch.float32
    assert got.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_ties_go_to_lowest_id() -> None:
    got = probs_of([0.0, 5.0, 1.0, 5.0, 5.0], SamplingParams(temperature=0.0))
    assert got.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_k_one_is_greedy() -> None:
    got = probs_of([0.0, 1.0, 3.0], SamplingParams(temperature=0.7, top_k=1))
    assert got.tolist() == [0.0, 0.0, 1.0]


def test_greedy_argmax_is_taken_after_penalties() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    got = probs_of([3.0, 2.0, 0.0], params, prompt=[0])  # 3.0 -> 1.5 < 2.0
    assert got.tolist() == [0.0, 1.0, 0.0]


# ---------------------------------------------------------------- batching


def _mixed_rows(vocab: int) -> list[RowContext]:
    return [
        RowContext(SamplingParams(temperature=0.0), [1, 2], [3]),
        RowContext(SamplingParams(temperature=0.7, top_k=5), [4], []),
        RowContext(SamplingParams(top_p=0.8, repetition_penalty=1.3), [5, 6, 7], [8, 8]),
        RowContext(SamplingParams(min_p=0.05, frequency_penalty=0.4), [], [9, 9, 10]),
        RowContext(SamplingParams(), [0], [vocab - 1]),
        RowContext(SamplingParams(temperature=1.3, top_k=20, top_p=0.95, min_p=0.02), [1], [2, 3]),
        RowContext(SamplingParams(temperature=0.0, presence_penalty=1.5), [], [11]),
    ]


def test_mixed_batch_equals_each_row_alone() -> None:
    vocab = 64
    torch.manual_seed(0)
    logits = torch.randn(7, vocab) * 3
    rows = _mixed_rows(vocab)
    batched = compute_probs(logits, rows)
    for i, row in enumerate(rows):
        alone = compute_probs(logits[i : i + 1], [row])[0]
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=1e-7)
    torch.testing.assert_close(batched.sum(dim=1), torch.ones(7))
    # The batch really exercises the filters: every filtered row has dropped tokens.
    truncated = ((batched > 0).sum(dim=1) < vocab).tolist()
    assert truncated == [True, True, True, True, False, True, True]


def test_compute_probs_does_not_modify_logits_and_accepts_half() -> None:
    logits = torch.randn(3, 16).to(torch.bfloat16)
    before = logits.clone()
    rows = [RowContext(SamplingParams(repetition_penalty=2.0, top_p=0.5), [1, 2], [3])] * 3
    probs = compute_probs(logits, rows)
    assert probs.dtype == torch.float32
    assert torch.equal(logits, before)


def test_compute_probs_row_count_mismatch() -> None:
    with pytest.raises(ValueError):
        compute_probs(torch.zeros(2, 4), [RowContext(SamplingParams(), [], [])])


# ---------------------------------------------------------------- sample


def test_same_seed_same_tokens_regardless_of_batch_position_and_company() -> None:
    vocab = 50
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(6, vocab), dim=1)
    target_row = probs[2]

    def draw_seq(batch_probs: torch.Tensor, row: int, others: list[int | None]) -> list[int]:
        tokens = []
        for pos in range(20):
            seeds = list(others)
            seeds.insert(row, 1234)
            positions = [pos + 3 * i for i in range(len(seeds))]
            positions[row] = pos
            tokens.append(sample(batch_probs, seeds, positions)[row].item())
        return tokens

    alone = draw_seq(target_row[None], 0, [])
    # Same row at another position, next to unseeded rows and to rows with other seeds.
    batch = torch.stack([probs[0], probs[5], target_row, probs[1]])
    assert draw_seq(batch, 2, [None, 7, None]) == alone
    batch = torch.stack([target_row, probs[4]])
    assert draw_seq(batch, 0, [99]) == alone
    # Unseeded draws in between change nothing: the stream keeps no state.
    sample(probs, [None] * 6)
    assert draw_seq(target_row[None], 0, []) == alone
    # A different seed gives a different stream (the check above is not vacuous).
    other = [sample(target_row[None], [4321], [pos]).item() for pos in range(20)]
    assert other != alone


def test_one_hot_rows_return_their_token_whatever_the_noise() -> None:
    probs = torch.zeros(4, 6)
    probs[0, 2] = probs[1, 5] = probs[2, 0] = probs[3, 3] = 1.0
    for pos in range(20):
        assert sample(probs, [pos, None, 3, None], [pos] * 4).tolist() == [2, 5, 0, 3]


def test_sample_never_picks_zero_probability_tokens() -> None:
    probs = torch.zeros(4, 1000)
    probs[:, 7] = 0.5
    probs[:, 990] = 0.5
    for pos in range(50):
        assert set(sample(probs, [0, 1, None, None], [pos] * 4).tolist()) <= {7, 990}


def test_sample_checks_seeds_and_positions() -> None:
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="seeds"):
        sample(probs, [1])
    with pytest.raises(ValueError, match="position"):
        sample(probs, [1, None])
    with pytest.raises(ValueError, match="position"):
        sample(probs, [1, None], [0])


def test_a_fully_seeded_batch_leaves_the_default_generator_alone() -> None:
    probs = torch.full((3, 50), 0.02)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    sample(probs, [1, 2, 3], [0, 0, 0])
    assert torch.equal(torch.get_rng_state(), state)
    sample(probs, [1, None, 3], [0, 0, 0])  # an unseeded row draws its stream's key
    assert not torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("stream", ["unseeded", "across_seeds", "across_positions"])
def test_sample_frequencies_match_probs(stream: str, kernels: str) -> None:
    if kernels == "native" and native.library() is None:
        pytest.skip("no native kernels (AVX-512 VNNI, a C compiler)")
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    draws = 24_000
    batch = probs.expand(draws, -1).contiguous()
    torch.manual_seed(2024)
    with native.switched_off() if kernels == "torch" else contextlib.nullcontext():
        if stream == "unseeded":
            tokens = sample(batch)
        elif stream == "across_seeds":
            tokens = sample(batch, list(range(draws)), [5] * draws)
        else:
            tokens = sample(batch, [77] * draws, list(range(draws)))
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[2].item() == 0
    support = probs > 0
    expected = probs[support].double() / probs.double().sum() * draws
    _, p_value = stats.chisquare(counts[support].numpy(), expected.numpy())
    assert p_value > 1e-4
    # The test can fail: the same counts against a slightly different distribution are rejected.
    wrong = torch.tensor([0.07, 0.28, 0.15, 0.4, 0.1], dtype=torch.float64)
    _, p_wrong = stats.chisquare(counts[support].numpy(), (wrong / wrong.sum() * draws).numpy())
    assert p_wrong < 1e-4


def test_vanishing_temperature_is_finite_and_near_greedy() -> None:
    got = probs_of([30.0, 29.0, -5.0], SamplingParams(temperature=1e-30))
    assert torch.isfinite(got).all()
    assert got.tolist() == [1.0, 0.0, 0.0]


def test_non_contiguous_logits() -> None:
    base = torch.randn(8, 3)
    logits = base.T  # [3, 8], transposed strides
    rows = [RowContext(SamplingParams(repetition_penalty=1.7, top_k=4), [0, 5], [2])] * 3
    torch.testing.assert_close(
        compute_probs(logits, rows), compute_probs(logits.contiguous(), rows)
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=0.7),
    ],
)
def test_greedy_picks_are_the_one_hot_rows_of_compute_probs(params) -> None:
    """The fast path for all-greedy rows picks what `compute_probs` makes one-hot (penalties
    included, lowest id on ties), in the logits' own dtype."""
    torch.manual_seed(0)
    logits = torch.randn(6, 500).bfloat16()
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the lower id wins
    rows = [RowContext(params, [7, 3, 3], [9, 11][: i % 3]) for i in range(6)]
    want = compute_probs(logits, rows).argmax(dim=-1)
    assert torch.equal(greedy_picks(logits, rows), want)
    if not params.needs_penalties:
        assert int(want[2]) == 7


def test_greedy_picks_decline_a_batch_with_a_sampled_row() -> None:
    rows = [RowContext(SamplingParams(temperature=0), [], [])] * 2
    rows.append(RowContext(SamplingParams(temperature=1.0), [], []))
    assert greedy_picks(torch.randn(3, 50), rows) is None
