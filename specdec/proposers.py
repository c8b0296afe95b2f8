"""Draft proposers behind one protocol and a registry: a draft model, or n-gram prompt lookup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.controller.policy import DraftStop, draft_value, drafts_to_continue
from specdec.controller.step_cost import ForwardShape
from specdec.draft_tree import DraftTree
from specdec.draft_vocab import vocabulary_logits
from specdec.engine.gpu_sampling import SamplingKernels, probs_for_rows, sample_from_probs
from specdec.engine.model_runner import ModelRunner, RunEntry
from specdec.engine.sampling import RowContext, greedy_picks
from specdec.engine.scheduler import ScheduledSeq
from specdec.ngram import propose_ngram, propose_ngram_tree
from specdec.tree_proposal import GrowingTree, TreeShape


@dataclass
class Proposal:
    token_ids: list[int]  # up to k draft tokens (fewer, or none, when the proposer has nothing)
    # [len(token_ids), vocab] distribution each was drawn from; None when verification does not
    # read it (q one-hot, or a greedy or seeded request, verified by the coupling)
    probs: torch.Tensor | None
    # a token tree instead of a chain (``token_ids`` are then its nodes, breadth-first)
    tree: DraftTree | None = None
    # a tree's first nodes (breadth-first) whose draft K/V sits at their scratch slots
    tree_fed: int = 0


@dataclass
class Drafts:
    """What one ``propose`` produced: a proposal per item and the shapes of the draft forwards
    it ran (for the policy's draft-cost fit; a lookup proposer runs none)."""

    proposals: list[Proposal]
    forwards: list[ForwardShape] = field(default_factory=list)


class Proposer(Protocol):
    name: str

    def propose(self, items: list[ScheduledSeq], stop: DraftStop | None = None) -> Drafts:
        """Draft up to item.num_spec_tokens tokens after each item's sequence (one per item).
        With ``stop``, 'auto' sequences draft a further token only as many as
        ``drafts_to_continue`` says pay for it together, by their drafts so far. An item with k = 0 and ``num_draft_catchup_tokens``
        only reads that many tokens into the draft's K/V."""
        ...


class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the sequence's suffix. No model.
    An item with a depth gets a token tree of the continuations of several occurrences."""

    name = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, items: list[ScheduledSeq], stop: DraftStop | None = None) -> Drafts:
        # Every position is drafted at once, for free: there is nothing to stop early.
        out = []
        for it in items:
            if it.spec_depth and it.num_spec_tokens:
                tokens, parents = propose_ngram_tree(
                    it.seq.token_ids, it.spec_depth, self.n_min, self.n_max, it.num_spec_tokens
                )
                tree = DraftTree(tokens, parents) if tokens else None
                out.append(Proposal(tokens, None, tree=tree))
            elif it.num_spec_tokens:
                tokens = propose_ngram(it.seq.token_ids, it.num_spec_tokens, self.n_min, self.n_max)
                out.append(Proposal(tokens, None))
            else:
                out.append(Proposal([], None))
        return Drafts(out)


class DraftModelProposer:
    """A smaller model sharing the target's block tables; drafts are batched across sequences.

    Step 0 catches the draft up on every token it has not seen (the last step's bonus/corrected
    token, or a whole prompt after prefill) and drafts token 1; each later step feeds one draft
    token per sequence still drafting. Every draft is drawn from the draft's distribution warped
    exactly like the target's, by the rule the target will pick with (`sample_from_probs`):
    greedy requests take the argmax, seeded requests run the exponential race on the noise of the
    draft's (seed, position), so a draft is accepted whenever the target's pick agrees; unseeded
    sampled requests draw freely and keep the probabilities as q for the rejection rule.
    The scheduler holds step 0 to the token budget: a sequence whose lag does not fit comes with
    k = 0 and a chunk of it, which step 0 reads without logits. A draft with a vocabulary-pruned
    head (`specdec.draft_vocab`) has its logits put back at their token ids, -inf elsewhere,
    before any of this: its q is a full-vocabulary distribution, 0 off the kept tokens.
    """

    name = "draft_model"

    def __init__(
        self,
        runner: ModelRunner,
        kernels: SamplingKernels | None = None,
        tree_shape: TreeShape | None = None,
    ) -> None:
        self.runner = runner
        self.kernels = kernels  # batched sampling kernels (FlashInfer on CUDA) or the reference
        self.tree_shape = tree_shape or TreeShape()
        self.num_forwards = 0  # observable: tests assert the draft did not run when k = 0

    def propose(self, items: list[ScheduledSeq], stop: DraftStop | None = None) -> Drafts:
        tokens: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        confidence: list[list[float]] = [[] for _ in items]
        # Items with a depth grow token trees (`specdec.tree_proposal`) in the same forwards.
        growing = {
            i: GrowingTree(
                it.seq, it.spec_depth, it.num_spec_tokens, self.runner.vocab_size, self.tree_shape
            )
            for i, it in enumerate(items)
            if it.num_spec_tokens > 0 and it.spec_depth > 0
        }
        trees: dict[int, GrowingTree] = {}
        active = [i for i, it in enumerate(items) if it.num_spec_tokens > 0 and i not in growing]
        catchup = _catchup_entries(items)
        forwards: list[ForwardShape] = []
        step = 0
        while active or catchup or growing:
            entries = list(catchup)  # chunks read without logits ride in the first forward
            for i in active:
                seq = items[i].seq
                if step == 0:
                    start = seq.num_draft_computed_tokens
                    entries.append(RunEntry(seq, seq.token_ids[start:], start, 1))
                else:
                    entries.append(RunEntry(seq, [tokens[i][-1]], seq.num_tokens + step - 1, 1))
            tree_entries = {
                i: g.first_entry() if step == 0 else g.next_entry() for i, g in growing.items()
            }
            entries += tree_entries.values()
            logits = self.runner.run(entries)  # [len(active) + tree rows, lm_head rows]
            self.num_forwards += 1
            forwards.append(_shape(entries))
            for e in catchup:
                e.seq.num_draft_computed_tokens = e.start_pos + len(e.token_ids)
            catchup = []
            if not active and not growing:
                break
            # A pruned head's logits go back to their ids, -inf elsewhere: q is 0 off its rows.
            logits = vocabulary_logits(self.runner.output_token_ids, logits, self.runner.vocab_size)
            row = len(active)
            for i, entry in tree_entries.items():
                g = growing[i]
                if step == 0:  # the root's row: the draft has read every committed token
                    g.seq.num_draft_computed_tokens = g.context
                g.grow(logits[row : row + entry.num_logits], self.kernels)
                row += entry.num_logits
                if g.done:
                    trees[i] = growing.pop(i)
            if active:
                self._draw_chain_tokens(
                    items, active, logits[: len(active)], step, stop, tokens, probs, confidence
                )
            step += 1
            active = [i for i in active if items[i].num_spec_tokens > step]
            if stop is not None:
                active = _continuing(items, active, confidence, step, stop)
        out = []
        for i, it in enumerate(items):
            if i in trees:
                tree = trees[i].tree
                out.append(Proposal(list(tree.tokens), None, tree=tree, tree_fed=trees[i].fed))
            elif not tokens[i]:
                out.append(Proposal([], None))
            elif it.seq.params.greedy or it.seq.params.seed is not None:
                # q is unused: greedy and seeded drafts are verified by the coupling, which
                # compares each draft with the target's own pick.
                out.append(Proposal(tokens[i], None))
            else:
                out.append(Proposal(tokens[i], torch.stack(probs[i])))
        return Drafts(out, forwards)

    def _draw_chain_tokens(
        self,
        items: list[ScheduledSeq],
        active: list[int],
        logits: torch.Tensor,  # one row per active item
        step: int,
        stop: DraftStop | None,
        tokens: list[list[int]],
        probs: list[list[torch.Tensor]],
        confidence: list[list[float]],
    ) -> None:
        """Draw each active chain's next draft from its row, by the rule the target will pick
        with, and record it (with its distribution and, for the stop rule, its confidence)."""
        rows = [
            RowContext(
                items[i].seq.params,
                items[i].seq.prompt_token_ids,
                items[i].seq.output_token_ids + tokens[i],
            )
            for i in active
        ]
        greedy = [items[i].seq.params.greedy for i in active]
        # All greedy: the picks alone (their q is one-hot and never read).
        drawn_t = greedy_picks(logits, rows)
        p = None
        if drawn_t is None:
            p = probs_for_rows(logits, rows, self.kernels)
            drawn_t = sample_from_probs(
                p,
                greedy,
                [items[i].seq.params.seed for i in active],
                [items[i].seq.num_tokens + step for i in active],  # where each draft would go
                self.kernels,
            )
        # Only the stop rule reads confidences: without one, skip their kernels and copy.
        conf = _confidence(logits, p, drawn_t, greedy) if stop is not None else None
        drawn = drawn_t.tolist()
        for row, i in enumerate(active):
            seq = items[i].seq
            tokens[i].append(drawn[row])
            if p is not None:
                probs[i].append(p[row])
            if conf is not None:
                confidence[i].append(conf[row])
            seq.num_draft_computed_tokens = seq.num_tokens + step


def _continuing(
    items: list[ScheduledSeq],
    active: list[int],
    confidence: list[list[float]],
    step: int,
    stop: DraftStop,
) -> list[int]:
    """The active sequences that draft position ``step``: every pinned ('on') one, and the
    'auto' ones of highest value that ``drafts_to_continue`` keeps."""
    auto = [i for i in active if items[i].seq.spec_mode == "auto"]
    values = {i: draft_value(confidence[i], step, stop) for i in auto}
    ranked = sorted(auto, key=lambda i: -values[i])
    m = drafts_to_continue([values[i] for i in ranked], len(active) - len(auto), stop)
    kept = set(ranked[:m])
    return [i for i in active if i in kept or items[i].seq.spec_mode != "auto"]


def _shape(entries: list[RunEntry]) -> ForwardShape:
    """Rows, sequences, attended (query, key) pairs and sampled rows of one forward."""
    rows = sum(len(e.token_ids) for e in entries)
    attended = sum(len(e.token_ids) * (e.start_pos + len(e.token_ids)) for e in entries)
    sampled = sum(e.num_logits for e in entries if e.seq.params.warped)
    return ForwardShape(rows, len(entries), attended, sampled)


def _catchup_entries(items: list[ScheduledSeq]) -> list[RunEntry]:
    """The chunks that sequences catching up (k = 0) read into the draft's K/V, without logits."""
    out = []
    for it in items:
        n = it.num_draft_catchup_tokens
        if it.num_spec_tokens == 0 and n > 0:
            start = it.seq.num_draft_computed_tokens
            out.append(RunEntry(it.seq, it.seq.token_ids[start : start + n], start, 0))
    return out


def _confidence(
    logits: torch.Tensor, probs: torch.Tensor | None, drawn: torch.Tensor, greedy: list[bool]
) -> list[float]:
    """The draft's probability of each drawn token: from the distribution it was drawn from, or
    for a greedy row (whose q is one-hot) from the softmax of its logits at temperature 1
    (``probs`` is None when every row is greedy)."""
    conf = torch.zeros(len(greedy)) if probs is None else probs.gather(1, drawn.view(-1, 1))
    conf = conf.view(-1).to(logits.device)
    rows = [r for r, g in enumerate(greedy) if g]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        raw = logits[idx].float()
        picked = raw.gather(1, drawn[idx].view(-1, 1)).view(-1)
        conf = conf.index_copy(0, idx, torch.exp(picked - torch.logsumexp(raw, dim=-1)))
    return conf.tolist()


ProposerFactory = Callable[..., Proposer]
PROPOSERS: dict[str, ProposerFactory] = {
    "draft_model": DraftModelProposer,
    "ngram": NgramProposer,
}
