"""A request as the engine sees it: the one owner of its tokens, counts, blocks and statistics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specdec.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


@dataclass
class SpecStats:
    """Speculation counters for one request (or, summed, for the engine)."""

    num_spec_steps: int = 0  # target forwards that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k_max] times position j accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # [k_max] times position j drafted
    # [k_max] times position j was judged: drafted with every draft before it accepted
    judged_per_pos: list[int] = field(default_factory=list)
    num_target_steps: int = 0  # target forwards that produced tokens for this request
    num_emitted_tokens: int = 0  # tokens those forwards committed
    num_tree_steps: int = 0  # verifies of a token tree (their nodes count as draft tokens)
    num_tree_nodes: int = 0  # nodes those verified
    accepted_per_rank: list[int] = field(default_factory=list)  # [r] accepted r-th siblings
    # [j] times depth j of a tree was accepted through a runner-up (the first choice rejected):
    # accepted_per_pos less these counts the draft's first choices alone, as a chain would
    rescued_per_pos: list[int] = field(default_factory=list)

    def record(
        self,
        num_drafted: int,
        num_accepted: int,
        num_emitted: int,
        tree_nodes: int = 0,
        accepted_ranks: list[int] | tuple[int, ...] = (),
    ) -> None:
        """One target forward: ``num_drafted`` draft positions (a tree's depth), the first
        ``num_accepted`` accepted; a tree also gives its node count and the sibling rank of each
        accepted node (0: the draft's first choice)."""
        self.num_target_steps += 1
        self.num_emitted_tokens += num_emitted
        if num_drafted == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += tree_nodes or num_drafted
        self.num_accepted_tokens += num_accepted
        if tree_nodes:
            self.num_tree_steps += 1
            self.num_tree_nodes += tree_nodes
            for j, r in enumerate(accepted_ranks):
                _grow(self.accepted_per_rank, r + 1)
                self.accepted_per_rank[r] += 1
                if r:
                    _grow(self.rescued_per_pos, j + 1)
                    self.rescued_per_pos[j] += 1
        need = num_drafted - len(self.drafted_per_pos)
        if need > 0:
            self.drafted_per_pos.extend([0] * need)
            self.accepted_per_pos.extend([0] * need)
            self.judged_per_pos.extend([0] * need)
        for j in range(num_drafted):
            self.drafted_per_pos[j] += 1
            if j <= num_accepted:
                self.judged_per_pos[j] += 1
            if j < num_accepted:
                self.accepted_per_pos[j] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_spec_steps += other.num_spec_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_target_steps += other.num_target_steps
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_tree_steps += other.num_tree_steps
        self.num_tree_nodes += other.num_tree_nodes
        for mine, theirs in (
            (self.drafted_per_pos, other.drafted_per_pos),
            (self.accepted_per_pos, other.accepted_per_pos),
            (self.judged_per_pos, other.judged_per_pos),
            (self.accepted_per_rank, other.accepted_per_rank),
            (self.rescued_per_pos, other.rescued_per_pos),
        ):
            _grow(mine, len(theirs))
            for j, v in enumerate(theirs):
                mine[j] += v

    def first_choices_per_pos(self) -> list[int]:
        """[j] times position j held with the draft's first choice (a tree's rescues left out)."""
        rescued = self.rescued_per_pos + [0] * len(self.accepted_per_pos)
        return [a - r for a, r in zip(self.accepted_per_pos, rescued, strict=False)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward, counting the bonus/corrected token."""
        return self.num_emitted_tokens / self.num_target_steps if self.num_target_steps else 0.0

    def acceptance_per_pos(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=False)
        ]

    @property
    def nodes_per_tree_step(self) -> float:
        return self.num_tree_nodes / self.num_tree_steps if self.num_tree_steps else 0.0

    def to_dict(self) -> dict:
        out = {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_pos": self.acceptance_per_pos(),
        }
        if self.num_tree_steps:
            out["num_tree_steps"] = self.num_tree_steps
            out["nodes_per_tree_step"] = self.nodes_per_tree_step
            out["accepted_per_rank"] = list(self.accepted_per_rank)
        return out


def _grow(counts: list[int], length: int) -> None:
    """Pad ``counts`` with zeros to at least ``length`` entries."""
    if length > len(counts):
        counts.extend([0] * (length - len(counts)))


class Sequence:
    """Prompt and output ids, sampling params, speculation mode, both models' computed counts,
    the block table and acceptance statistics. Derived values are properties."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        spec_mode: str,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.spec_mode = spec_mode  # "auto" | "on" | "off"
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V the target (resp. draft) has written into this sequence's pages.
        self.num_computed_tokens = 0
        self.num_draft_computed_tokens = 0
        self.block_table: list[int] = []
        # Chained keys (SHA-256 digests) of this sequence's full, computed blocks (prefix cache).
        self.block_hashes: list[bytes] = []
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self.spec_stats = SpecStats()
        self.stop_reason: int | str | None = None
        # Text produced so far (filled by the output processor), and its emitted length.
        self.output_text = ""
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.first_scheduled_time: float | None = None

    # ---- derived values -------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def draft_lag(self) -> int:
        """Tokens the draft has not read yet (a prompt it never read, steps it sat out)."""
        return self.num_tokens - self.num_draft_computed_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens the sequence may still commit before max_tokens or max_model_len ends it."""
        left = max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            left = min(left, self.params.max_tokens - self.num_output_tokens)
        return left

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token still needs the target."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, draft={self.num_draft_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.value})"
        )
