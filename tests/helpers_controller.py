"""A synthetic engine for controller tests: known step costs, Bernoulli acceptance, no models."""

from __future__ import annotations

import random
from collections.abc import Callable

from engine.sequence import Sequence
from evals.controller_sim import draft_forwards, verify_step
from specdec.controller.cost_model import DraftCost, TargetCost
from specdec.controller_base import SpeculationController, StepObservation

# acceptance(seq, step) -> chance that each draft token is accepted
AcceptanceFn = Callable[[Sequence, int], float]


def simulate(
    controller: SpeculationController,
    seqs: list[Sequence],
    acceptance: AcceptanceFn,
    target: TargetCost,
    draft: DraftCost,
    steps: int,
    rng: random.Random,
    noise: float = 0.0,
    first_step: int = 0,
) -> list[list[int]]:
    """Run ``steps`` synthetic engine steps; returns the k's chosen at each step."""
    history = []
    for step in range(first_step, first_step + steps):
        ks = controller.choose_k(seqs)
        history.append(list(ks))
        forwards = draft_forwards(seqs, ks)
        outcomes = []
        for seq, k in zip(seqs, ks, strict=True):
            outcomes.append(verify_step(seq, k, acceptance(seq, step), rng))
        num_tokens = sum(1 + k for k in ks)
        target_time = target(num_tokens, len(seqs)) * max(0.1, 1 + noise * rng.gauss(0, 1))
        draft_time = sum(draft(r, s) for r, s in forwards) * max(0.1, 1 + noise * rng.gauss(0, 1))
        controller.observe(
            StepObservation(
                step_time=target_time + draft_time,
                draft_time=draft_time,
                target_time=target_time,
                num_target_tokens=num_tokens,
                num_seqs=len(seqs),
                draft_forwards=forwards,
                outcomes=outcomes,
            )
        )
    return history
