"""Continuous batching scheduler: picks each step's ragged batch under a token budget.

There are no prefill/decode phases. Every step, each running sequence is given what it still
needs - ``num_tokens - num_computed_tokens`` target tokens (a prompt chunk, or 1 to decode) plus
``k`` draft tokens to verify when the speculation controller asks for them - capped by
``max_num_batched_tokens``. The draft model's first forward of a step is held to an equal budget
of its own: it reads every token its K/V lacks (one or two after a verify, a whole prompt after a
prefix-cache hit or a plain stretch) before drafting, and a sequence whose lag does not fit what
is left drafts nothing this step: it reads a chunk of its lag (``num_draft_catchup_tokens``) and
decodes plainly, until the rest fits. Waiting sequences are admitted while the budget,
``max_num_seqs`` and the KV pool allow. When the pool runs dry, the newest running sequence is
preempted (its blocks freed, to be recomputed later), so the oldest always make progress: no
deadlock, no crash.

A step is planned in three calls, so the speculation policy is asked in between and never called
from here: ``schedule_running`` gives the running sequences their rows, ``add_drafts`` adds the k drafts
the policy chose for the decode-ready ones (trimmed to what the budget, the KV pool and their
token limits allow), and ``admit`` fills what is left of the budget with waiting prompts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.sequence import Sequence, SequenceStatus

# Shortest-prompt-first ages a waiting prompt by this many tokens per second waited, so a long
# prompt's effective length reaches zero after (its length / rate) seconds and it cannot starve.
SPF_AGING_TOKENS_PER_SECOND = 256.0


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # committed tokens the target computes this step (chunk or 1)
    num_spec_tokens: int = 0  # k: draft tokens appended after them for verification
    # A token tree instead of a chain: num_spec_tokens is then its most nodes (verify rows and
    # scratch KV slots) and spec_depth its most levels; 0 for a chain (depth = num_spec_tokens).
    spec_depth: int = 0
    # Tokens the draft reads into its K/V this step without drafting (k = 0 while it catches up).
    num_draft_catchup_tokens: int = 0

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + self.num_spec_tokens

    @property
    def completes_prompt(self) -> bool:
        """After this step every committed token is computed, so a next token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    budget_left: int = 0  # target rows the step can still take

    @property
    def decode_ready(self) -> list[ScheduledSeq]:
        """Running sequences decoding one token: those that may verify drafts this step."""
        return [s for s in self.scheduled if s.num_new_tokens == 1 and s.completes_prompt]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        draft_catches_up: bool = False,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        # Whether the proposer is a draft model that must read each token into its own K/V
        # before drafting after it (an n-gram lookup reads nothing).
        self.draft_catches_up = draft_catches_up
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark seq finished (or aborted), drop it from the queues and free its blocks."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def pending_prefill(self, plan: StepPlan) -> tuple[int, int, int]:
        """(rows, sequences, attended key pairs) of the prompt chunks the step will carry at
        most: the running prompts' chunks in ``plan`` plus the waiting prompts ``admit`` could
        take within the budget left. A speculation policy prices the step it chooses for with
        them."""
        rows = seqs = attended = 0
        for s in plan.scheduled:
            if s.num_new_tokens > 1:
                rows, seqs = rows + s.num_new_tokens, seqs + 1
                attended += s.num_new_tokens * (s.seq.num_computed_tokens + s.num_new_tokens)
        room = max(0, self.max_num_seqs - len(self.running))
        budget = plan.budget_left
        for seq in list(self.waiting)[:room]:
            if budget <= 0:
                break
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            rows, seqs, budget = rows + chunk, seqs + 1, budget - chunk
            attended += chunk * chunk
        return rows, seqs, attended

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """A step without drafts: the running sequences' rows, then admissions."""
        plan = self.schedule_running()
        self.admit(plan)
        return plan

    def schedule_running(self) -> StepPlan:
        """Give every running sequence what it still needs (a prompt chunk, or one row to
        decode) within the token budget, preempting the newest when the pool runs dry."""
        plan = StepPlan(budget_left=self.max_num_batched_tokens)
        i = 0
        while i < len(self.running) and plan.budget_left > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, plan.budget_left)
            while not self.allocator.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq preempted itself; the loop index now points at the next one
            self.allocator.allocate(seq, seq.num_computed_tokens + num_new)
            plan.scheduled.append(ScheduledSeq(seq, num_new))
            plan.budget_left -= num_new
            i += 1
        return plan

    def add_drafts(
        self,
        plan: StepPlan,
        items: Seq[ScheduledSeq],
        ks: Seq[int],
        tree_nodes: Seq[int] | None = None,
    ) -> None:
        """Give each decode-ready item its k drafts to verify, trimmed to what it could still
        commit, to the target's budget left (oldest first), to the draft's own catch-up budget
        and to the KV pool (verify slots are a luxury: dropped, never a cause to preempt).

        With ``tree_nodes[i] > 0`` item i drafts a tree of at most that many nodes, k levels
        deep, instead: its nodes are its verify rows and scratch KV slots."""
        wanted = {
            it.seq.seq_id: max(0, min(k, self._max_useful_k(it.seq)))
            for it, k in zip(items, ks, strict=True)
        }
        nodes = {
            it.seq.seq_id: n for it, n in zip(items, tree_nodes or [0] * len(items), strict=True)
        }
        catchup = self._fit_draft_budget(wanted)
        for it in items:
            seq = it.seq
            k = wanted[seq.seq_id]
            rows = (nodes[seq.seq_id] or k) if k else 0
            # A tree's scratch slots stay inside the model's length, like a chain's drafts.
            rows = min(rows, plan.budget_left, self.max_model_len - seq.num_tokens)
            total = seq.num_computed_tokens + it.num_new_tokens + rows
            if rows and not self.allocator.can_allocate(seq, total):
                rows = 0
            if rows:
                self.allocator.allocate(seq, total)
            it.num_spec_tokens = rows
            it.spec_depth = min(k, rows) if nodes[seq.seq_id] else 0
            it.num_draft_catchup_tokens = catchup.get(seq.seq_id, 0)
            plan.budget_left -= rows

    def admit(self, plan: StepPlan) -> None:
        """Admit waiting prompts into what is left of the budget (not right after preempting:
        that would only thrash)."""
        if not plan.preempted:
            plan.budget_left = self._admit(plan, plan.budget_left)

    def _fit_draft_budget(self, ks: dict[int, int]) -> dict[int, int]:
        """Hold the draft's first forward to ``max_num_batched_tokens`` rows. Sequences whose whole
        lag (tokens since the draft last read) fits keep their k, oldest first; the others get
        k = 0 and a catch-up chunk from what is left. Changes ``ks``; returns seq_id -> chunk.

        Later draft forwards feed one row per drafting sequence, fewer than the target's rows."""
        if not self.draft_catches_up:
            return {}
        budget = self.max_num_batched_tokens
        behind: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if ks.get(seq.seq_id, 0) == 0:
                continue
            lag = seq.draft_lag
            if lag <= budget:
                budget -= lag
            else:
                behind.append((seq, lag))
        catchup: dict[int, int] = {}
        for seq, lag in behind:
            ks[seq.seq_id] = 0
            if budget > 0:
                catchup[seq.seq_id] = min(lag, budget)
                budget -= catchup[seq.seq_id]
        return catchup

    def _max_useful_k(self, seq: Sequence) -> int:
        """Drafts past max_tokens or max_model_len could never be committed: don't verify them."""
        return max(0, seq.tokens_left(self.max_model_len) - 1)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        plan.preempted.append(seq)

    def _admission_order(self) -> list[Sequence]:
        if self.policy == "fcfs":
            return list(self.waiting)
        now = time.monotonic()

        def effective_len(s: Sequence) -> float:
            return s.num_tokens - SPF_AGING_TOKENS_PER_SECOND * (now - s.arrival_time)

        # Preempted sequences keep their place at the front: they already waited once.
        preempted = [s for s in self.waiting if s.num_preemptions > 0]
        fresh = sorted((s for s in self.waiting if s.num_preemptions == 0), key=effective_len)
        return preempted + fresh

    def _admit(self, plan: StepPlan, budget: int) -> int:
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not seq.block_table:
                cached, draft_cached = self.allocator.match_prefix(seq)
                seq.num_computed_tokens = cached
                seq.num_draft_computed_tokens = draft_cached
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = cached
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.allocator.can_allocate(seq, seq.num_computed_tokens + num_new):
                # Give the prefix hits back: the sequence stays waiting with nothing held.
                self.allocator.free(seq)
                seq.num_computed_tokens = seq.num_draft_computed_tokens = 0
                break
            self.allocator.allocate(seq, seq.num_computed_tokens + num_new)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, num_new, 0))
            budget -= num_new
        return budget
