"""Verification of draft token trees (`specdec.draft_tree.DraftTree`) in one target pass.

The target has scored the root and every node: ``target_probs[0]`` is its distribution of the token
after the root, ``target_probs[i + 1]`` the one after node ``i``'s path. Verification walks down
from the root, at each visited node deciding which child (if any) to accept, and emits the
accepted path plus one token from the target: a correction where the walk stopped, or the bonus
token after a leaf. Three rules, by the sequence's mode:

**Greedy and seeded sequences: the coupling.** At every visited node the target's pick is the token
it commits on its own: the argmax for a greedy sequence, and for a seeded one the winner of the
exponential race on the noise keyed by (seed, position) (`specdec.engine.sampling.sample`, the rule
plain decode and `specdec.rejection_sampler.coupled_verify` use). The child whose token is the pick
is accepted; if none is, the pick is emitted and the walk stops. The committed token at each
position is therefore the target's pick given the committed prefix, exactly what plain decode
commits, whatever the tree: its shape only decides how many of those tokens one pass yields.

**Unseeded sampled sequences, siblings drawn without replacement** (``tree.sampled``). At a node
with target row ``p`` and draft row ``q``, the children ``x_1..x_m`` were drawn one after another
from ``q`` without replacement: ``x_i ~ q_i``, where ``q_1 = q`` and ``q_{i+1}`` is ``q_i`` with
``x_i`` removed and renormalised. With ``p_1 = p``, try the children in order: accept ``x_i`` with
probability ``min(1, p_i(x_i) / q_i(x_i))``; on rejection set ``p_{i+1} = norm(max(0, p_i - q_i))``
and try the next; if all are rejected emit a draw from ``p_{m+1}``. (SpecInfer, Miao et al. 2023;
Sequoia, Chen et al. 2024.)

Why this is exact: claim that the procedure started at try ``i`` with residual ``p_i`` emits a token
distributed as ``p_i``, for any proposal ``q_i`` the remaining children are drawn from. With no
child left it draws from ``p_i`` itself. Otherwise ``x_i ~ q_i`` given everything before it, so
with ``beta = sum_y min(p_i(y), q_i(y))``

    P(y) = q_i(y) min(1, p_i(y) / q_i(y)) + (1 - beta) p_{i+1}(y)
         = min(p_i(y), q_i(y)) + max(0, p_i(y) - q_i(y)) = p_i(y),

where the second term uses the claim for try ``i + 1``: it holds whatever ``x_i`` was, so the
dependence of ``q_{i+1}`` on ``x_i`` does not matter. At ``i = 1`` the emitted token follows ``p``.
When a child is accepted the walk continues below it with the target row after that child, and
the child's own children were drawn from the draft given that path only, so by induction over
depth every emitted token follows the target given the tokens before it. Two things the proof
needs of the drafting: siblings are tried in the order they were drawn (a draw without
replacement is not exchangeable), and whether an ``i``-th sibling exists may depend on the
earlier siblings and on the rest of the tree but not on ``x_i`` itself (pruning a drawn node
because of its own probability breaks the claim). A chain is the case ``m <= 1`` everywhere and
then this is exactly `specdec.rejection_sampler.rejection_sample`.

**Unseeded sampled sequences, deterministic candidates** (``not tree.sampled``: top-b by draft
probability, n-gram continuations). Each candidate is a fixed token ``c_i`` given the path, i.e. a
draw from the one-hot ``q_i = delta(c_i)``, so the same claim applies with that ``q_i``: accept
``c_i`` with probability ``p_i(c_i)``, on rejection ``p_{i+1} = p_i`` with ``c_i`` removed and
renormalised, and ``P(y) = p_i(c_i) delta(c_i, y) + (1 - p_i(c_i)) p_{i+1}(y) = p_i(y)``. This rule
is exact for any choice of distinct candidates. The without-replacement rule is not exact for
top-b candidates: it assumes ``x_1 ~ q`` while top-1 is always the mode of ``q``. With ``q = (0.6,
0.4)``, ``p = (0.5, 0.5)`` and the top-1 token 0 it accepts with probability 5/6, so token 0 is
emitted with probability 5/6, not 1/2; the one-hot rule accepts it with probability 1/2.

Acceptance is tested as ``u * q(x) < p(x)`` with ``u ~ U[0, 1)`` (one uniform per node), as the
chain verifier does. The uniforms of all unseeded sampled trees come from one ``torch.rand`` call
(tree after tree, node by node) and their final tokens from one `sample` call, so a batch of
chains of equal length consumes the default generator exactly as `rejection_sample` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.draft_tree import DraftTree
from specdec.engine.sampling import sample


@dataclass
class TreeVerifyResult:
    """Verification outcome for ``B`` trees; ``D`` is the largest tree depth in the batch."""

    output_token_ids: torch.Tensor  # [B, D + 1] int64: accepted tokens, then one token, then -1
    num_accepted: torch.Tensor  # [B] int64: accepted nodes; a sequence emits num_accepted + 1
    accepted_nodes: list[list[int]]  # per tree, node indices of the accepted path from the root
    accepted_ranks: list[list[int]]  # per tree, rank of each accepted node among its siblings
    tree_depths: list[int]  # per tree, the deepest level drafted


def verify_trees(
    trees: Sequence[DraftTree],
    target_probs: Sequence[torch.Tensor],  # per tree [N_b + 1, V]
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    first_positions: Sequence[int],
) -> TreeVerifyResult:
    """Verify one tree per sequence against the target (rules in the module docstring).

    Args:
        trees: one tree per sequence; an empty tree samples row 0 like plain decode.
        target_probs: per tree, row 0 is the (warped) target distribution after the root and row
            ``i + 1`` the one after node ``i``'s path.
        greedy: per sequence, pick by argmax.
        seeds: per sequence, the request's seed for the exponential race, or None.
        first_positions: per sequence, the absolute position of the token row 0 picks (the root's
            position + 1); node ``i``'s row picks at ``first_positions[b] + depth(i)``.

    Returns:
        `TreeVerifyResult`; tensors on the device of ``target_probs``.
    """
    batch = len(trees)
    if not len(target_probs) == len(greedy) == len(seeds) == len(first_positions) == batch:
        raise ValueError(
            f"got {batch} trees, {len(target_probs)} target_probs, {len(greedy)} greedy flags, "
            f"{len(seeds)} seeds and {len(first_positions)} positions"
        )
    if batch == 0:
        raise ValueError("verify_trees needs at least one tree")
    device = target_probs[0].device
    rows: list[torch.Tensor] = []
    for b, (tree, probs) in enumerate(zip(trees, target_probs, strict=True)):
        if probs.dim() != 2 or probs.shape[0] != tree.num_nodes + 1:
            raise ValueError(
                f"target_probs[{b}] must be [{tree.num_nodes + 1}, vocab], got {tuple(probs.shape)}"
            )
        vocab = probs.shape[1]
        if tree.vocab_size is not None and tree.vocab_size != vocab:
            raise ValueError(f"tree {b} has vocab {tree.vocab_size}, target_probs[{b}] has {vocab}")
        if tree.tokens and max(tree.tokens) >= vocab:
            raise ValueError(f"tree {b} has a token id outside the target's vocab of {vocab}")
        rows.append(probs.to(device=device, dtype=torch.float32))

    picked = [b for b in range(batch) if greedy[b] or seeds[b] is not None]
    free = [b for b in range(batch) if not (greedy[b] or seeds[b] is not None)]
    paths: list[list[int]] = [[] for _ in range(batch)]
    ranks: list[list[int]] = [[] for _ in range(batch)]
    last: list[int] = [0] * batch

    if picked:
        picks = _target_picks(
            [trees[b] for b in picked],
            [rows[b] for b in picked],
            [greedy[b] for b in picked],
            [seeds[b] for b in picked],
            [first_positions[b] for b in picked],
        )
        for b, tree_picks in zip(picked, picks, strict=True):
            paths[b], ranks[b], last[b] = _walk_picks(trees[b], tree_picks)

    if free:
        uniforms = torch.rand(sum(trees[b].num_nodes for b in free), device=device)
        finals = []
        offset = 0
        for b in free:
            n = trees[b].num_nodes
            paths[b], ranks[b], final = _walk_rejection(trees[b], rows[b], uniforms[offset:])
            offset += n
            finals.append(final)
        final_tokens = sample(torch.stack(finals)).tolist()
        for b, token in zip(free, final_tokens, strict=True):
            last[b] = int(token)

    depth = max(t.max_depth for t in trees)
    out = torch.full((batch, depth + 1), -1, dtype=torch.int64)
    for b in range(batch):
        tokens = [trees[b].tokens[i] for i in paths[b]] + [last[b]]
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return TreeVerifyResult(
        output_token_ids=out.to(device),
        num_accepted=torch.tensor([len(p) for p in paths], dtype=torch.int64, device=device),
        accepted_nodes=paths,
        accepted_ranks=ranks,
        tree_depths=[t.max_depth for t in trees],
    )


def _target_picks(
    trees: Sequence[DraftTree],
    rows: Sequence[torch.Tensor],  # per tree [N + 1, V]
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    first_positions: Sequence[int],
) -> list[list[int]]:
    """The target's pick at every row of every tree, in one `sample` call: the argmax for greedy
    trees (one-hot rows, so the noise never matters), the seeded race at the row's position."""
    flat = torch.cat(list(rows))  # [sum(N + 1), V]
    row_seeds: list[int | None] = []
    row_positions: list[int] = []
    for tree, g, seed, first in zip(trees, greedy, seeds, first_positions, strict=True):
        depths = (0, *tree.depths)
        row_seeds += [None if g else seed] * len(depths)
        row_positions += [first + d for d in depths]
    argmax = flat.argmax(dim=-1)  # lowest id on ties, as `compute_probs` makes greedy rows
    seeded = [i for i, s in enumerate(row_seeds) if s is not None]
    if seeded:
        idx = torch.tensor(seeded, device=flat.device)
        raced = sample(
            flat.index_select(0, idx),
            [row_seeds[i] for i in seeded],
            [row_positions[i] for i in seeded],
        )
        argmax = argmax.index_copy(0, idx, raced)
    picks = argmax.tolist()
    out = []
    offset = 0
    for tree in trees:
        out.append(picks[offset : offset + tree.num_nodes + 1])
        offset += tree.num_nodes + 1
    return out


def _walk_picks(tree: DraftTree, picks: list[int]) -> tuple[list[int], list[int], int]:
    """Descend while a child's token is the target's pick at its parent; returns the accepted
    path, the sibling rank of each accepted node and the emitted pick."""
    path: list[int] = []
    ranks: list[int] = []
    node = -1
    while True:
        pick = picks[node + 1]
        hit = [r for r, c in enumerate(tree.children(node)) if tree.tokens[c] == pick]
        if not hit:
            return path, ranks, pick
        node = tree.children(node)[hit[0]]
        path.append(node)
        ranks.append(hit[0])


def _walk_rejection(
    tree: DraftTree,
    rows: torch.Tensor,  # [N + 1, V] target rows
    uniforms: torch.Tensor,  # [>= N] one per node
) -> tuple[list[int], list[int], torch.Tensor]:
    """Recursive rejection over siblings (module docstring); returns the accepted path, the
    sibling rank of each accepted node and the distribution ``[V]`` to draw the last token from."""
    path: list[int] = []
    ranks: list[int] = []
    node = -1
    p = rows[0]
    while True:
        children = tree.children(node)
        if not children:
            return path, ranks, p  # bonus token from the target after the last accepted node
        q = None
        if tree.sampled:
            q = tree.draft_probs[node + 1].to(device=p.device, dtype=torch.float32)
            if not bool(torch.isfinite(q).all()):
                raise ValueError(f"the draft row of node {node} (parent of {children}) is missing")
        accepted = None
        for rank, child in enumerate(children):
            token = tree.tokens[child]
            if q is None:
                q_token = torch.ones((), device=p.device)
                proposal = torch.zeros_like(p)
                proposal[token] = 1.0
            else:
                q_token = q[token]
                if not bool(q_token > 0):
                    raise ValueError(
                        f"node {child} (token {token}) has zero probability under the draft row "
                        "its siblings were drawn from; it cannot have been drawn"
                    )
                proposal = q
            if bool(uniforms[child] * q_token < p[token]):
                accepted = rank, child
                break
            residual = (p - proposal).clamp_min(0.0)
            mass = residual.sum()
            # An all-zero residual means p == q up to rounding; p itself is then the right answer.
            if bool(mass > 0):
                p = residual / mass.clamp_min(1e-30)
            if q is not None:
                q = _without(q, token)
        if accepted is None:
            return path, ranks, p  # every child rejected: draw from the final residual
        rank, node = accepted
        path.append(node)
        ranks.append(rank)
        p = rows[node + 1]


def _without(q: torch.Tensor, token: int) -> torch.Tensor:
    """``q`` (``[V]``) with ``token`` removed and renormalised: the distribution the next sibling
    drawn without replacement came from."""
    q = q.clone()
    q[token] = 0.0
    mass = q.sum()
    return q / mass if bool(mass > 0) else q
