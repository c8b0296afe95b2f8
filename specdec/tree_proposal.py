"""A draft model growing one sequence's token tree, one level per draft forward.

The root is the sequence's last committed token, at position ``T - 1`` (``T`` committed tokens);
node j (breadth-first) holds its scratch K/V at slot position ``T + j`` and its rotary position is
``T - 1 + depth``. The draft's first forward reads the sequence's catch-up up to the root and
gives the root's row; every later forward feeds the deepest level's nodes, each attending to the
committed keys and to its own ancestors only (a ``[level, nodes so far]`` tree mask), and gives
their rows, from which the next level is grown (`specdec.tree_drafting`). Leaves of the last level
are never fed. The nodes that were fed (``fed``: every level but the last grown) hold their draft
K/V at their scratch slots, computed as a chain's would be at the same positions (each attends to
the context and its ancestors, exactly the tokens before it on its path); after the verify the
engine moves the accepted ones into place (`specdec.engine.tree_commit.commit_tree_kv`), so the
draft's next catch-up reads only the bonus token and an accepted leaf.

Children are drawn as the verifier needs (`specdec.tree_verify`): greedy requests take the draft's
most probable tokens at temperature 1 (one-hot rows would offer one child); sampled requests,
seeded or not, draw siblings without replacement from the request's warped distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.engine.gpu_sampling import SamplingKernels, probs_for_rows
from specdec.engine.model_runner import RunEntry
from specdec.engine.sampling import RowContext
from specdec.engine.sequence import Sequence
from specdec.tree_drafting import empty_tree, grow_dynamic_level, grow_static_level


@dataclass(frozen=True)
class TreeShape:
    """How trees grow: ``dynamic`` (the level's nodes of highest path probability, about
    ``max_nodes / depth`` a level) or ``static`` (``branching`` children per node)."""

    growth: str = "dynamic"
    branching: int = 2


def level_widths(max_nodes: int, depth: int, shape: TreeShape) -> list[int]:
    """Nodes per level of a tree at most ``depth`` levels deep and ``max_nodes`` nodes, as
    ``GrowingTree`` grows it where the draft offers enough distinct tokens."""
    widths: list[int] = []
    if shape.growth == "static":
        while (
            len(widths) < depth and sum(widths) + shape.branching ** (len(widths) + 1) <= max_nodes
        ):
            widths.append(shape.branching ** (len(widths) + 1))
        return widths
    width = math.ceil(max_nodes / depth) if depth > 0 else 0
    while len(widths) < depth and sum(widths) < max_nodes:
        widths.append(min(width, max_nodes - sum(widths)))
    return widths


class GrowingTree:
    """One sequence's tree while the draft grows it."""

    def __init__(
        self, seq: Sequence, depth: int, max_nodes: int, vocab_size: int, shape: TreeShape
    ) -> None:
        self.seq = seq
        self.depth = depth
        self.max_nodes = max_nodes
        self.shape = shape
        self.context = seq.num_tokens  # T: committed tokens when the tree began
        self.sampled = not seq.params.greedy
        self.tree = empty_tree(vocab_size, "cpu", self.sampled)
        self.done = depth < 1 or max_nodes < 1
        self._level: list[int] = []  # nodes of the deepest level, fed by the next forward
        self.fed = 0  # the first this many nodes (breadth-first) were fed: their K/V is written

    def first_entry(self) -> RunEntry:
        """The catch-up up to the root; its last row is the root's."""
        start = self.seq.num_draft_computed_tokens
        return RunEntry(self.seq, self.seq.token_ids[start:], start, 1)

    def next_entry(self) -> RunEntry | None:
        """The deepest level's nodes, attending to the context and their ancestors; None when
        the tree is complete."""
        if self.done or not self._level:
            return None
        first, last = self._level[0], self._level[-1]
        mask = self.tree.attention_mask()[first : last + 1, : last + 1]
        depth = self.tree.depths[first]
        return RunEntry(
            self.seq,
            [self.tree.tokens[j] for j in self._level],
            self.context + first,
            len(self._level),
            positions=[self.context - 1 + depth] * len(self._level),
            tree_mask=mask.cpu(),
        )

    def grow(self, logits: torch.Tensor, kernels: SamplingKernels | None) -> None:
        """Add the next level from the draft's rows for the frontier (the root's, or the
        deepest level's nodes', in order)."""
        frontier = self._level or [-1]
        self.fed = frontier[-1] + 1  # these rows came from feeding the frontier's nodes
        probs = self._rows(logits, frontier, kernels)
        before = self.tree.num_nodes
        level = self.tree.max_depth  # the frontier's depth; 0 for the root
        if self.shape.growth == "static":
            grown = grow_static_level(
                self.tree,
                probs,
                self.shape.branching,
                sampled=self.sampled,
                seed=self.seq.params.seed,
                first_position=self.context,
            )
            if grown.num_nodes > self.max_nodes:  # the next level does not fit: stop here
                self.done = True
                return
        else:
            width = math.ceil(self.max_nodes / self.depth)
            grown = grow_dynamic_level(
                self.tree,
                probs,
                width,
                self.max_nodes,
                sampled=self.sampled,
                seed=self.seq.params.seed,
                first_position=self.context,
            )
        self.tree = grown
        self._level = list(range(before, grown.num_nodes))
        if not self._level or level + 1 >= self.depth or grown.num_nodes >= self.max_nodes:
            self.done = True

    def _rows(
        self, logits: torch.Tensor, frontier: list[int], kernels: SamplingKernels | None
    ) -> torch.Tensor:
        """``[F, V]``: the distribution each frontier node's children are drawn from."""
        if not self.sampled:
            return torch.softmax(logits.float(), dim=-1).cpu()
        out = self.seq.output_token_ids
        rows = [
            RowContext(
                self.seq.params,
                self.seq.prompt_token_ids,
                out + (self.tree.path_tokens(n) if n >= 0 else []),
            )
            for n in frontier
        ]
        return probs_for_rows(logits, rows, kernels).cpu()
