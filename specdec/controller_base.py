"""What every speculation controller sees and decides: k per sequence per step, from measurements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.sequence import Sequence


@dataclass
class SeqOutcome:
    seq: Sequence
    num_drafted: int  # drafts verified this step (k actually used)
    num_accepted: int  # of those, accepted
    # the draft's probability of each draft it drew (its confidence); empty when it has none
    draft_confidence: list[float] = field(default_factory=list)


@dataclass
class StepObservation:
    """One engine step, measured."""

    step_time: float  # seconds, whole step (draft + target + sampling + bookkeeping)
    draft_time: float  # seconds spent in draft forwards
    target_time: float  # seconds in the target forward and sampling
    num_target_tokens: int  # rows in the target forward (prefill chunks + decodes + verifies)
    num_seqs: int  # sequences in the target forward
    draft_forwards: list[tuple[int, int]] = field(default_factory=list)  # (rows, seqs) each
    outcomes: list[SeqOutcome] = field(default_factory=list)


class SpeculationController(Protocol):
    # Whether ``keep_drafting`` may stop a sequence short of its k. When False the engine does
    # not ask it, and the proposer skips the confidences only that question reads.
    stops_drafts_early: bool

    def choose_k(self, seqs: list[Sequence]) -> list[int]:
        """k for each decode-ready sequence (0 = plain decode, no draft work for it)."""
        ...

    def expect_prefill(self, rows: int, seqs: int) -> None:
        """The prefill rows (and their sequences) the next step can carry beside the decodes,
        told by the engine just before ``choose_k`` so their cost is known, not guessed."""
        ...

    def keep_drafting(self, seqs: list[Sequence], confidences: list[list[float]]) -> list[bool]:
        """Asked after each draft forward about the sequences that could draft further this
        step (those below their k): which of them should. ``confidences[i]`` holds the draft's
        probability of each token sequence i drew so far. Must depend on nothing drawn after
        those tokens (see ``specdec.controller.draft_stop``)."""
        ...

    def while_target_runs(self) -> None:
        """Called once a step after the target forward is launched and before its results are
        read: host work done here (refitting a cost model) overlaps the device's work on a GPU
        instead of adding to the step. A controller that defers work to it must still work
        where it is never called (a simulation, a caller without a device)."""
        ...

    def observe(self, obs: StepObservation) -> None:
        """Feed back one measured step."""
        ...

    def stats(self) -> dict:
        """Current decision inputs/outputs for metrics and logs."""
        ...


class StaticController:
    """k_max for 'on' and 'auto' sequences, 0 for 'off': fixed-k speculation."""

    stops_drafts_early = False  # fixed k: every sequence drafts its k

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self._last_ks: list[int] = []

    def choose_k(self, seqs: list[Sequence]) -> list[int]:
        self._last_ks = [0 if s.spec_mode == "off" else self.k_max for s in seqs]
        return self._last_ks

    def expect_prefill(self, rows: int, seqs: int) -> None:
        pass  # fixed k: the step's shape does not change the decision

    def keep_drafting(self, seqs: list[Sequence], confidences: list[list[float]]) -> list[bool]:
        return [True] * len(seqs)  # fixed k: every sequence drafts its k

    def while_target_runs(self) -> None:
        pass

    def observe(self, obs: StepObservation) -> None:
        pass

    def stats(self) -> dict:
        n = len(self._last_ks)
        return {
            "mean_k": sum(self._last_ks) / n if n else 0.0,
            "speculating_fraction": sum(k > 0 for k in self._last_ks) / n if n else 0.0,
        }
