"""A token tree of draft continuations for one sequence, stored flat in BFS order.

The root is the sequence's last committed token and is not a node. Node ``i`` holds a drafted
token ``token_ids[i]`` and the index of its parent ``parents[i]`` (-1 for a child of the root).
BFS order means parents are non-decreasing along the array and every parent precedes its
children, so the nodes of one depth are contiguous, the children of one node are contiguous, and
siblings keep the order in which they were proposed (the verifier tries them in that order, which
matters for siblings drawn without replacement: `specdec.tree_verify`).

Depth counts tokens from the root: children of the root have depth 1, so a node at depth ``d``
sits at absolute position ``root_position + d``, where ``root_position`` is the position of the
root token, and the accepted path length equals the depth of its last node.

Draft distributions: row 0 of ``draft_probs`` is the draft's distribution after the root, row
``i + 1`` the one after node ``i``: the distribution the node's children were proposed from. Only
rows of nodes that have children are read. ``confidence[i]`` is the draft's probability of node
``i``'s token under its parent's row, and the product of confidences along a path is the path's
score (the draft's probability of the whole continuation).

``sampled`` says how siblings were chosen: True when they are draws without replacement from
their parent's row (so the verifier may use that row as the proposal distribution), False when
they are deterministic candidates (top-b by probability, n-gram lookups), which the verifier
treats as one-hot proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DraftTree:
    """One sequence's draft tree; immutable after construction, validated on construction."""

    def __init__(
        self,
        token_ids: Sequence[int] | torch.Tensor,  # [N]
        parents: Sequence[int] | torch.Tensor,  # [N], -1 for children of the root
        confidence: torch.Tensor | None = None,  # [N] float
        draft_probs: torch.Tensor | None = None,  # [N + 1, V] float; rows of leaves unread
        *,
        sampled: bool = False,
        max_nodes: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Build and validate a tree; every malformed input raises ValueError.

        Args:
            token_ids: drafted token per node, BFS order.
            parents: parent index per node (-1 for the root's children), non-decreasing.
            confidence: draft probability of each node's token; defaults to ones (unknown).
            draft_probs: the draft's distribution after the root and after each node; required
                when ``sampled`` is True.
            sampled: siblings are draws without replacement from their parent's row.
            max_nodes: the most nodes allowed (None: no limit).
            vocab_size: token ids must lie in ``[0, vocab_size)``; defaults to the width of
                ``draft_probs`` when given.
        """
        tokens = [int(t) for t in _as_list(token_ids, "token_ids")]
        parent_list = [int(p) for p in _as_list(parents, "parents")]
        n = len(tokens)
        if len(parent_list) != n:
            raise ValueError(f"got {n} token_ids but {len(parent_list)} parents")
        if max_nodes is not None and n > max_nodes:
            raise ValueError(f"tree has {n} nodes, more than max_nodes={max_nodes}")
        device = token_ids.device if isinstance(token_ids, torch.Tensor) else torch.device("cpu")
        if draft_probs is not None:
            if draft_probs.dim() != 2 or draft_probs.shape[0] != n + 1:
                raise ValueError(
                    f"draft_probs must be [{n + 1}, vocab] (root row then one per node), "
                    f"got {tuple(draft_probs.shape)}"
                )
            device = draft_probs.device
            if vocab_size is None:
                vocab_size = int(draft_probs.shape[1])
            elif draft_probs.shape[1] != vocab_size:
                raise ValueError(
                    f"draft_probs has width {draft_probs.shape[1]}, vocab_size is {vocab_size}"
                )
        elif sampled:
            raise ValueError("a sampled tree needs draft_probs (the rows its siblings came from)")

        depth: list[int] = []
        children: list[list[int]] = [[] for _ in range(n + 1)]  # slot 0 is the root
        previous_parent = -1
        for i, (tok, par) in enumerate(zip(tokens, parent_list, strict=True)):
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise ValueError(f"node {i} has token id {tok} outside [0, {vocab_size})")
            if not -1 <= par < i:
                raise ValueError(
                    f"node {i} has parent {par}; a parent must be -1 or an earlier node"
                )
            if par < previous_parent:
                raise ValueError(
                    f"node {i} has parent {par} after a node with parent {previous_parent}; "
                    "nodes must be in BFS order (parents non-decreasing)"
                )
            previous_parent = par
            siblings = children[par + 1]
            if any(tokens[s] == tok for s in siblings):
                raise ValueError(f"node {i} repeats token {tok} among the children of {par}")
            siblings.append(i)
            depth.append(1 if par < 0 else depth[par] + 1)

        if confidence is None:
            confidence = torch.ones(n, dtype=torch.float32, device=device)
        elif confidence.shape != (n,):
            raise ValueError(f"confidence must be [{n}], got {tuple(confidence.shape)}")
        elif n and bool(((confidence < 0) | (confidence > 1) | confidence.isnan()).any()):
            raise ValueError("confidence values must be probabilities in [0, 1]")

        self._tokens = tuple(tokens)
        self._parents = tuple(parent_list)
        self._depth = tuple(depth)
        self._children = tuple(tuple(c) for c in children)
        self.token_ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [N]
        self.confidence = confidence.to(device=device, dtype=torch.float32)  # [N]
        self.draft_probs = draft_probs  # [N + 1, V] or None
        self.sampled = sampled
        self.vocab_size = vocab_size

    # ------------------------------------------------------------------ structure

    @property
    def num_nodes(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token id per node, as host ints."""
        return self._tokens

    @property
    def parents(self) -> tuple[int, ...]:
        return self._parents

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth per node: 1 for the root's children."""
        return self._depth

    @property
    def max_depth(self) -> int:
        return self._depth[-1] if self._depth else 0

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def children(self, node: int) -> tuple[int, ...]:
        """Children of ``node`` (-1 for the root) in the order they were proposed."""
        if not -1 <= node < self.num_nodes:
            raise ValueError(f"node {node} outside [-1, {self.num_nodes})")
        return self._children[node + 1]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` inclusive."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} outside [0, {self.num_nodes})")
        out = []
        while node >= 0:
            out.append(node)
            node = self._parents[node]
        return out[::-1]

    def ancestors(self, node: int) -> list[int]:
        """Strict ancestors of ``node`` among the nodes, nearest first."""
        return self.path(node)[-2::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens along the path to ``node`` (the continuation that node stands for)."""
        return [self._tokens[i] for i in self.path(node)]

    def is_chain(self) -> bool:
        """Every node has at most one child."""
        return all(len(c) <= 1 for c in self._children)

    def path_scores(self) -> torch.Tensor:
        """``[N]`` float32: product of confidences from the root down to each node."""
        scores = self.confidence.clone()
        for i, par in enumerate(self._parents):
            if par >= 0:
                scores[i] = scores[i] * scores[par]
        return scores

    def attention_mask(self) -> torch.Tensor:
        """``[N, N]`` bool on the tree's device: ``mask[i, j]`` iff node ``j`` is ``i`` or one of
        its ancestors (what node ``i`` may attend to among the nodes; the committed context is
        visible to every node and not part of this mask)."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)
        for i, par in enumerate(self._parents):
            if par >= 0:
                mask[i] |= mask[par]  # parent's row is final: parents precede children
        return mask.to(self.device)

    def positions(self, root_position: int) -> torch.Tensor:
        """``[N]`` int64 absolute positions: ``root_position + depth`` per node, where
        ``root_position`` is the position of the root (the last committed token)."""
        if root_position < 0:
            raise ValueError(f"root_position must be >= 0, got {root_position}")
        depth = torch.tensor(self._depth, dtype=torch.int64)
        return (depth + root_position).to(self.device)

    def __repr__(self) -> str:
        return (
            f"DraftTree(tokens={list(self._tokens)}, parents={list(self._parents)}, "
            f"sampled={self.sampled})"
        )


def chain_tree(
    token_ids: Sequence[int] | torch.Tensor,  # [K]
    draft_probs: torch.Tensor | None = None,  # [K + 1, V] or [K, V]
) -> DraftTree:
    """A chain as a tree: node ``j`` is the child of node ``j - 1``.

    ``draft_probs`` may be the chain verifier's ``[K, V]`` rows (row ``j`` is the distribution
    draft ``j`` was sampled from); a row of NaN is appended for the last node, whose children do
    not exist. With ``draft_probs`` the tree counts as sampled (each node is the one draw of its
    parent's row), without it as deterministic.
    """
    k = len(_as_list(token_ids, "token_ids"))
    if draft_probs is not None and draft_probs.dim() == 2 and draft_probs.shape[0] == k:
        pad = torch.full(
            (1, draft_probs.shape[1]),
            float("nan"),
            dtype=draft_probs.dtype,
            device=draft_probs.device,
        )
        draft_probs = torch.cat([draft_probs, pad])
    confidence = None
    if draft_probs is not None and k:
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=draft_probs.device)
        confidence = draft_probs[:k].gather(1, ids[:, None]).squeeze(1).float()
    return DraftTree(
        token_ids,
        list(range(-1, k - 1)),
        confidence,
        draft_probs,
        sampled=draft_probs is not None,
    )


def _as_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(values.shape)}")
        return [int(v) for v in values.tolist()]
    return list(values)
