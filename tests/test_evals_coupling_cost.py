"""The acceptance formulas of evals/coupling_cost.py: exact values, bounds and truncation."""

from __future__ import annotations

import torch
from specdec.engine import noise
from specdec.evals.coupling_cost import coupled_acceptance, rejection_acceptance, synthetic


def random_pairs(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(rows, vocab, generator=g), -1)
    return p, q


def test_identical_and_disjoint_pairs() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(coupled_acceptance(p, p)[0], torch.ones(1, dtype=torch.float64))
    assert float(coupled_acceptance(p, q)[0]) == 0.0 == float(rejection_acceptance(p, q)[0])


def test_coupling_lies_between_its_bounds() -> None:
    """beta / (2 - beta) <= P(agree) <= beta, with beta = sum(min(p, q)) the maximal coupling."""
    p, q = random_pairs(50, 40, seed=0)
    beta = rejection_acceptance(p, q)
    got, left_out = coupled_acceptance(p, q)
    assert bool((left_out == 0).all())  # 40 tokens: nothing left out
    assert bool((got <= beta + 1e-12).all()) and bool((got >= beta / (2 - beta) - 1e-12).all())
    assert float(got.mean()) < float(beta.mean()) - 0.01  # below it for pairs that differ


def test_exact_formula_matches_the_race_on_the_noise() -> None:
    p, q = random_pairs(1, 30, seed=1)
    trials = 40_000
    keys = noise.stream_keys(list(range(trials)), [0] * trials, noise.TOKEN, "cpu")
    e = noise.exponentials(keys, 30)
    agree = ((p / e).argmax(-1) == (q / e).argmax(-1)).double().mean().item()
    exact = float(coupled_acceptance(p, q)[0])
    assert abs(agree - exact) < 5 * (exact * (1 - exact) / trials) ** 0.5


def test_truncation_is_a_lower_bound_within_the_reported_slack() -> None:
    p, q = random_pairs(20, 60, seed=2)
    full, _ = coupled_acceptance(p, q)
    part, left_out = coupled_acceptance(p, q, top=3)
    assert bool((part <= full + 1e-12).all()) and bool((full <= part + left_out + 1e-12).all())
    assert bool((left_out > 0).all())


def test_synthetic_cost_grows_with_disagreement() -> None:
    rows = synthetic(noise_scales=(0.25, 1.0, 2.0), rows=20, vocab=100)
    rejection = [r["rejection_rule"] for r in rows]
    coupling = [r["coupling"] for r in rows]
    assert rejection == sorted(rejection, reverse=True)
    assert coupling == sorted(coupling, reverse=True)
    ratios = [r["ratio"] for r in rows]
    assert all(r < 1 for r in ratios) and ratios == sorted(ratios, reverse=True)
