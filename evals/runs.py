"""What an eval run produces per request and per engine configuration (shared by the runner in
`specdec.evals.offline` and the report rows in `specdec.evals.eval_rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.sequence import SpecStats
from specdec.evals.step_timer import StepTotals


@dataclass
class PromptRun:
    """One request's result: output, wall time from submission to finish, acceptance counters.

    ``cpu_seconds`` is this process's CPU time over the same span (all threads): on a shared
    machine other jobs inflate wall time much more than this, so it backs up the wall-time speedup.
    """

    prompt_id: str
    category: str
    output_token_ids: list[int]
    seconds: float
    ttft: float | None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    cpu_seconds: float = 0.0


@dataclass
class ConfigRuns:
    """Everything one engine configuration produced at one temperature, per category."""

    runs: dict[str, list[PromptRun]] = field(default_factory=dict)
    steps: dict[str, StepTotals] = field(default_factory=dict)
