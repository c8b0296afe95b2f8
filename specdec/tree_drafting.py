"""Growing a draft tree level by level from the draft's distributions at the frontier.

Each level the caller runs the draft once over the frontier (the nodes of the deepest level, or the
root of an empty tree) and passes its distributions ``frontier_probs`` (``[F, V]``, one row per
frontier node in order); a level function returns the tree with the new children appended and the
frontier rows stored as those nodes' draft rows. Children are chosen one of two ways:

* **deterministic** (``sampled=False``): the most probable tokens of the row, in descending order.
  The verifier then treats each as a one-hot proposal, which is exact for any candidates
  (`specdec.tree_verify`); for greedy requests this is the only sensible choice.
* **sampled** (``sampled=True``): draws without replacement, in draw order: the first child is the
  exponential race on the row (`specdec.engine.sampling.sample`), the next the race on the row with
  the earlier children removed, and so on. Unseeded rows race on the default generator, so the
  children are a sequential sample without replacement, which is what the sampled verification
  rule assumes. A seeded request's rows race on its (seed, position) noise, so the first child is
  the draft's winner (as a seeded chain drafts) and the next are the runners-up of the same race.
  Top-b by probability is *not* a valid input to the sampled rule (see `specdec.tree_verify`).

Shapes:

* `grow_static_level`: every frontier node gets ``branching`` children (fewer when its row has
  fewer tokens of non-zero probability). ``branching=1`` is a chain, drafted exactly as a chain is.
* `grow_dynamic_level` (after EAGLE-2, Li et al. 2024): the level's ``width`` child slots go to the
  (frontier node, rank) pairs of highest value ``score(node) * q_node[rank-th largest]``, where a
  node's score is the product of draft probabilities along its path. For deterministic children
  the value is exactly the new node's score; `prune_to_best` then keeps the ``max_nodes`` best
  nodes of the grown tree (ancestor-closed, since a child's score never exceeds its parent's). For
  sampled children the slot counts are decided from the sorted rows before anything is drawn, so
  whether a sibling exists never depends on its own token, and no drawn node is pruned afterwards;
  both would bias the sampled verification. Growth stops adding nodes at ``max_nodes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.draft_tree import DraftTree
from specdec.engine.sampling import sample

# (tree, frontier node indices, -1 for the root) -> the draft's rows [F, V] after each of them
DraftFn = Callable[[DraftTree, list[int]], torch.Tensor]


def frontier(tree: DraftTree) -> list[int]:
    """The nodes the next level grows from: the deepest level, or ``[-1]`` (the root) when empty."""
    if tree.num_nodes == 0:
        return [-1]
    return [i for i, d in enumerate(tree.depths) if d == tree.max_depth]


def empty_tree(
    vocab_size: int, device: torch.device | str = "cpu", sampled: bool = False
) -> DraftTree:
    """A tree with no nodes yet (only the root), ready for its first level."""
    probs = torch.full((1, vocab_size), float("nan"), device=device) if sampled else None
    return DraftTree([], [], draft_probs=probs, sampled=sampled, vocab_size=vocab_size)


def top_children(probs: torch.Tensor, counts: Sequence[int]) -> list[list[int]]:
    """The ``counts[f]`` most probable tokens of row ``f`` of ``probs`` (``[F, V]``), most probable
    first (in no fixed order among equal probabilities); never a token of zero probability."""
    if not counts or max(counts) == 0:
        return [[] for _ in counts]
    values, ids = probs.float().topk(min(max(counts), probs.shape[1]), dim=-1, sorted=True)
    values, ids = values.tolist(), ids.tolist()
    return [
        [t for t, v in zip(ids[f][:c], values[f][:c], strict=True) if v > 0]
        for f, c in enumerate(counts)
    ]


def sampled_children(
    probs: torch.Tensor,  # [F, V]
    counts: Sequence[int],
    seed: int | None = None,
    positions: Sequence[int] | None = None,
) -> list[list[int]]:
    """``counts[f]`` draws without replacement from row ``f``, in draw order, by repeated races
    (module docstring); at most as many as the row has tokens of non-zero probability.

    ``seed`` and ``positions`` (one per row: the position of the token the row picks) make the
    races the request's seeded ones; without a seed they use the default generator."""
    rows = probs.float().clone()
    num_rows = rows.shape[0]
    if len(counts) != num_rows:
        raise ValueError(f"got {len(counts)} counts for {num_rows} rows")
    if seed is not None and (positions is None or len(positions) != num_rows):
        raise ValueError(f"a seeded draw needs one position per row ({num_rows} rows)")
    support = (rows > 0).sum(dim=-1).tolist()
    want = [min(c, s) for c, s in zip(counts, support, strict=True)]
    out: list[list[int]] = [[] for _ in range(num_rows)]
    for r in range(max(want, default=0)):
        active = [f for f in range(num_rows) if want[f] > r]
        idx = torch.tensor(active, device=rows.device)
        seeds = [seed] * len(active) if seed is not None else None
        pos = [positions[f] for f in active] if positions is not None else None
        drawn = sample(rows.index_select(0, idx), seeds, pos)  # [len(active)]
        rows[idx, drawn] = 0.0  # the next race runs on the row without the tokens drawn so far
        for f, token in zip(active, drawn.tolist(), strict=True):
            out[f].append(int(token))
    return out


def expand(
    tree: DraftTree,
    frontier_probs: torch.Tensor,  # [F, V]
    children: Sequence[Sequence[int]],
    sampled: bool,
) -> DraftTree:
    """Append ``children[f]`` under frontier node ``f``; a sampled tree also stores the frontier
    rows (its verification reads them; deterministic candidates are verified one-hot, so their
    tree keeps none: no vocabulary-wide row per node copied each level)."""
    nodes = _check_frontier(tree, frontier_probs)
    if len(children) != len(nodes):
        raise ValueError(f"got children for {len(children)} of {len(nodes)} frontier nodes")
    vocab = frontier_probs.shape[1]
    if tree.num_nodes and sampled != tree.sampled:
        raise ValueError("a tree's children are either all sampled or all deterministic")
    device = frontier_probs.device
    q = frontier_probs.float()
    rows = None
    if sampled:
        rows = tree.draft_probs
        if rows is None:
            rows = torch.full((tree.num_nodes + 1, vocab), float("nan"), device=device)
        rows = rows.to(device).clone()
        rows[[n + 1 for n in nodes]] = q

    tokens = list(tree.tokens)
    parents = list(tree.parents)
    confidence = [tree.confidence.to(device)]
    for f, node in enumerate(nodes):
        kids = [int(t) for t in children[f]]
        tokens += kids
        parents += [node] * len(kids)
        confidence.append(q[f, torch.tensor(kids, dtype=torch.int64, device=device)])
    added = len(tokens) - tree.num_nodes
    if rows is not None:
        rows = torch.cat([rows, torch.full((added, vocab), float("nan"), device=device)])
    return DraftTree(
        torch.tensor(tokens, dtype=torch.int64, device=device),
        parents,
        torch.cat(confidence),
        rows,
        sampled=sampled,
        vocab_size=vocab,
    )


def grow_static_level(
    tree: DraftTree,
    frontier_probs: torch.Tensor,  # [F, V]
    branching: int,
    *,
    sampled: bool,
    seed: int | None = None,
    first_position: int = 0,
) -> DraftTree:
    """Give every frontier node ``branching`` children (top-b, or b draws without replacement).

    ``first_position`` is the position of the token the root's row picks; it only matters for a
    seeded request's races."""
    if branching < 1:
        raise ValueError(f"branching must be >= 1, got {branching}")
    _check_frontier(tree, frontier_probs)
    counts = [branching] * len(frontier(tree))
    return expand(
        tree,
        frontier_probs,
        _children(tree, frontier_probs, counts, sampled, seed, first_position),
        sampled,
    )


def grow_dynamic_level(
    tree: DraftTree,
    frontier_probs: torch.Tensor,  # [F, V]
    width: int,
    max_nodes: int,
    *,
    sampled: bool,
    seed: int | None = None,
    first_position: int = 0,
) -> DraftTree:
    """Add at most ``width`` children (and never past ``max_nodes`` nodes) where the slot value
    ``score(parent) * q_parent(rank-th most probable token)`` is highest (module docstring)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if max_nodes < tree.num_nodes:
        raise ValueError(f"max_nodes={max_nodes} is below the tree's {tree.num_nodes} nodes")
    nodes = _check_frontier(tree, frontier_probs)
    budget = min(width, max_nodes - tree.num_nodes)
    counts = [0] * len(nodes)
    if budget > 0:
        scores = tree.path_scores().to(frontier_probs.device)
        parent_score = torch.stack([scores[n] if n >= 0 else scores.new_ones(()) for n in nodes])
        k = min(budget, frontier_probs.shape[1])
        top = frontier_probs.float().topk(k, dim=-1).values  # [F, k] descending
        values = (parent_score[:, None] * top).flatten()  # [F * k]: slot (f, r) at f * k + r
        # Stable descending order puts (f, r) before (f, r + 1) on ties, so the chosen slots of a
        # node are always its first ones.
        order = torch.sort(values, descending=True, stable=True).indices[:budget]
        for slot in order.tolist():
            if values[slot] > 0:
                counts[slot // k] += 1
    children = _children(tree, frontier_probs, counts, sampled, seed, first_position)
    return expand(tree, frontier_probs, children, sampled)


def prune_to_best(tree: DraftTree, max_nodes: int) -> DraftTree:
    """Keep the ``max_nodes`` nodes of highest path score (deterministic trees only: pruning a
    drawn node by its own probability would bias the sampled verification rule)."""
    if tree.sampled:
        raise ValueError("a sampled tree cannot be pruned by score; limit it while growing")
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    if tree.num_nodes <= max_nodes:
        return tree
    scores = tree.path_scores().tolist()
    # Descending score, earlier node first on ties: a parent (earlier, score >= child's) is always
    # ranked before its children, so the kept set is closed under taking ancestors.
    ranked = sorted(range(tree.num_nodes), key=lambda i: (-scores[i], i))
    keep = sorted(ranked[:max_nodes])
    new_index = {old: new for new, old in enumerate(keep)}
    rows = None
    if tree.draft_probs is not None:
        rows = tree.draft_probs[[0] + [i + 1 for i in keep]]
    return DraftTree(
        tree.token_ids[keep],
        [new_index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep],
        tree.confidence[keep],
        rows,
        sampled=False,
        vocab_size=tree.vocab_size,
    )


def grow_tree(
    draft_fn: DraftFn,
    vocab_size: int,
    depth: int,
    *,
    branching: int | None = None,
    width: int | None = None,
    max_nodes: int | None = None,
    sampled: bool,
    seed: int | None = None,
    first_position: int = 0,
    device: torch.device | str = "cpu",
) -> DraftTree:
    """Grow a whole tree of at most ``depth`` levels, one ``draft_fn`` call per level.

    Exactly one of ``branching`` (static top-b / b draws per node) and ``width`` (dynamic
    expansion, which then needs ``max_nodes``) is given. A deterministic dynamic tree is pruned to
    its ``max_nodes`` best nodes at the end; a static tree stops before the level that would take
    it past ``max_nodes``."""
    if (branching is None) == (width is None):
        raise ValueError("give exactly one of branching (static) and width (dynamic)")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    if width is not None and max_nodes is None:
        raise ValueError("dynamic expansion needs max_nodes")
    tree = empty_tree(vocab_size, device, sampled)
    for _ in range(depth):
        nodes = frontier(tree)
        probs = draft_fn(tree, nodes)
        if width is not None:
            grown = grow_dynamic_level(
                tree,
                probs,
                width,
                max_nodes if sampled else width * depth,
                sampled=sampled,
                seed=seed,
                first_position=first_position,
            )
        else:
            grown = grow_static_level(
                tree, probs, branching, sampled=sampled, seed=seed, first_position=first_position
            )
            if max_nodes is not None and grown.num_nodes > max_nodes:
                break
        if grown.num_nodes == tree.num_nodes:
            tree = grown
            break
        tree = grown
    if width is not None and not sampled:
        tree = prune_to_best(tree, max_nodes)
    return tree


def _children(
    tree: DraftTree,
    frontier_probs: torch.Tensor,
    counts: Sequence[int],
    sampled: bool,
    seed: int | None,
    first_position: int,
) -> list[list[int]]:
    if not sampled:
        return top_children(frontier_probs, counts)
    # The row after a node at depth d picks the token at first_position + d.
    positions = [first_position + (tree.depths[n] if n >= 0 else 0) for n in frontier(tree)]
    return sampled_children(frontier_probs, counts, seed, positions if seed is not None else None)


def _check_frontier(tree: DraftTree, frontier_probs: torch.Tensor) -> list[int]:
    """The tree's frontier, after checking that ``frontier_probs`` has one row per node of it."""
    nodes = frontier(tree)
    if frontier_probs.dim() != 2 or frontier_probs.shape[0] != len(nodes):
        raise ValueError(
            f"frontier_probs must be [{len(nodes)}, vocab] (one row per frontier node), "
            f"got {tuple(frontier_probs.shape)}"
        )
    vocab = frontier_probs.shape[1]
    if tree.vocab_size is not None and tree.vocab_size != vocab:
        raise ValueError(f"frontier_probs has width {vocab}, the tree's vocab is {tree.vocab_size}")
    return nodes
