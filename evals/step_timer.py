"""How the engine's measured step time splits into drafting and verifying, over an interval.

The engine keeps running totals of its steps (``LLMEngine.step_totals``: draft_time, the
proposer; target_time, the target forward, sampling and the step's bookkeeping; step_time,
everything); a StepTimer reads them between two points of an eval.
"""

from __future__ import annotations

from specdec.engine.outputs import StepTotals as EngineStepTotals


class StepTotals(EngineStepTotals):
    """Step totals with the shares the eval reports."""

    @property
    def draft_share(self) -> float | None:
        """Fraction of step time spent in the proposer (draft forwards or n-gram lookup)."""
        return self.draft_time / self.step_time if self.step_time > 0 else None

    @property
    def verify_share(self) -> float | None:
        """Fraction of step time spent in the target forward that verifies, plus sampling."""
        return self.target_time / self.step_time if self.step_time > 0 else None


class StepTimer:
    """Reads the engine's running step totals (``LLMEngine.step_totals``) in intervals."""

    def __init__(self, engine) -> None:  # engine: specdec.engine.llm_engine.LLMEngine
        self.engine = engine
        self._start = self._snapshot()

    @classmethod
    def install(cls, engine) -> StepTimer:
        return cls(engine)

    def _snapshot(self) -> StepTotals:
        t = self.engine.step_totals
        return StepTotals(t.num_steps, t.step_time, t.draft_time, t.target_time)

    def reset(self) -> StepTotals:
        """Return the totals since the last reset and start new ones."""
        now = self._snapshot()
        s = self._start
        self._start = now
        return StepTotals(
            now.num_steps - s.num_steps,
            now.step_time - s.step_time,
            now.draft_time - s.draft_time,
            now.target_time - s.target_time,
        )
