"""Adds up how the engine's measured step time splits into drafting and verifying.

The engine reports every step to its controller as a StepObservation (draft_time: proposer;
target_time: the one target forward plus sampling; step_time: everything). StepTimer sits in
front of the engine's controller, forwards every call unchanged and keeps running totals, so the
eval reads the split without touching the engine's step loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTotals:
    num_steps: int = 0
    step_time: float = 0.0
    draft_time: float = 0.0
    target_time: float = 0.0

    def add(self, other: StepTotals) -> None:
        self.num_steps += other.num_steps
        self.step_time += other.step_time
        self.draft_time += other.draft_time
        self.target_time += other.target_time

    @property
    def draft_share(self) -> float | None:
        """Fraction of step time spent in the proposer (draft forwards or n-gram lookup)."""
        return self.draft_time / self.step_time if self.step_time > 0 else None

    @property
    def verify_share(self) -> float | None:
        """Fraction of step time spent in the target forward that verifies, plus sampling."""
        return self.target_time / self.step_time if self.step_time > 0 else None


class StepTimer:
    """A pass-through controller wrapper; install with :meth:`install`."""

    def __init__(self, inner) -> None:  # inner: specdec.controller_base.SpeculationController
        self.inner = inner
        self.totals = StepTotals()

    @classmethod
    def install(cls, engine) -> StepTimer:
        """Wrap ``engine.controller`` (an LLMEngine) and return the wrapper."""
        timer = cls(engine.controller)
        engine.controller = timer
        return timer

    def reset(self) -> StepTotals:
        """Return the totals so far and start new ones."""
        done, self.totals = self.totals, StepTotals()
        return done

    def choose_k(self, seqs):
        return self.inner.choose_k(seqs)

    def expect_prefill(self, rows: int, seqs: int) -> None:
        self.inner.expect_prefill(rows, seqs)

    def while_target_runs(self) -> None:
        self.inner.while_target_runs()

    @property
    def stops_drafts_early(self) -> bool:
        return self.inner.stops_drafts_early

    def keep_drafting(self, seqs, confidences) -> list[bool]:
        return self.inner.keep_drafting(seqs, confidences)

    def observe(self, obs) -> None:
        self.totals.num_steps += 1
        self.totals.step_time += obs.step_time
        self.totals.draft_time += obs.draft_time
        self.totals.target_time += obs.target_time
        self.inner.observe(obs)

    def stats(self) -> dict:
        return self.inner.stats()

    def __getattr__(self, name: str):
        # Anything else a controller offers (k_max, ...) stays reachable through the wrapper.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
