"""What the engine hands back per request per step, and the per-token stop/detokenize logic."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec.engine.sequence import Sequence, SequenceStatus, SpecStats


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # everything generated so far
    new_token_ids: list[int]  # generated this step
    text: str  # all text emitted so far (stop strings cut away, never half a character)
    new_text: str  # text emitted this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    arm: str = "spec"  # "spec" when the request may speculate, "plain" when it never does
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0


class OutputState:
    """Per-sequence detokenizer + stop-string matcher (absent when the engine has no tokenizer)."""

    def __init__(
        self, seq: Sequence, tokenizer
    ) -> None:  # tokenizer: specdec.engine.tokenizer.Tokenizer
        self.detok = None
        self.matcher = None
        if tokenizer is not None:
            from specdec.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

            self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
            self.matcher = StopStringMatcher(seq.params.stop)
        self.text = ""
        self.sent_text_len = 0
        self.sent_token_len = 0


def append_and_check(
    seq: Sequence,
    state: OutputState,
    token_ids: list[int],
    eos_ids: tuple[int, ...],
    max_model_len: int,
) -> int:
    """Append tokens one at a time, stopping exactly where plain decode would. Returns how many
    were kept (the rest of an accepted speculative run after a stop are dropped)."""
    params = seq.params
    kept = 0
    for tok in token_ids:
        seq.append_token(tok)
        kept += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        status = None
        if (not params.ignore_eos and tok in eos_ids) or tok in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, tok
        elif state.detok is not None:
            emit, stopped = state.matcher.feed(state.detok.add(tok))
            state.text += emit
            if stopped:
                # Text is already cut before the stop string; nothing held back may follow it.
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = state.matcher.matched_stop
                return kept
        if status is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.status = status
            flush_text(state)
            return kept
    return kept


def flush_text(state: OutputState) -> None:
    """End of sequence without a stop string: release whatever the detokenizer/matcher held."""
    if state.detok is None:
        return
    emit, _ = state.matcher.feed(state.detok.flush())
    state.text += emit + state.matcher.flush()


def make_output(seq: Sequence, state: OutputState, arm: str) -> RequestOutput:
    new_tokens = seq.output_token_ids[state.sent_token_len :]
    new_text = state.text[state.sent_text_len :]
    state.sent_token_len = seq.num_output_tokens
    state.sent_text_len = len(state.text)
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=seq.output_token_ids,
        new_token_ids=new_tokens,
        text=state.text,
        new_text=new_text,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        spec_stats=seq.spec_stats,
        arm=arm,
        arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time,
        finish_time=seq.finish_time,
        num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
    )


@dataclass
class StepTotals:
    """Running totals of measured steps: all of each step, its drafting, and the rest (the
    target forward, sampling and bookkeeping)."""

    num_steps: int = 0
    step_time: float = 0.0
    draft_time: float = 0.0
    target_time: float = 0.0

    def add(self, other: StepTotals) -> None:
        self.num_steps += other.num_steps
        self.step_time += other.step_time
        self.draft_time += other.draft_time
        self.target_time += other.target_time
