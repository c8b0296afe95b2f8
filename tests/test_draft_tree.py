"""Draft token trees: structure, growth, and exact verification.

Greedy and seeded checks decode against a fixed random target over a small vocabulary whose
next-token distribution is a function of the whole prefix (logits from a generator seeded by a hash
of the prefix), so a verifier reading the wrong row for a node would diverge from plain decode.
The statistical checks use first-order Markov target and draft chains (as `test_rejection_sampler`
does), where the exact distribution of the first two emitted tokens is cheap to compute; each
trial grows a fresh tree with the library's growth functions and verifies it, and the same
chi-square check must reject two deliberately wrong rules.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable

import pytest
import torch
from scipy import stats
from specdec.engine.gpu_sampling import sample_from_probs, verify_drafts
from specdec.engine.sampling import sample

from specdec import tree_verify
from specdec.draft_tree import DraftTree, chain_tree
from specdec.rejection_sampler import rejection_sample
from specdec.tree_drafting import (
    empty_tree,
    frontier,
    grow_dynamic_level,
    grow_static_level,
    grow_tree,
    prune_to_best,
    sampled_children,
    top_children,
)
from specdec.tree_verify import verify_trees

HASH_VOCAB = 12
P_THRESHOLD = (
    1e-4  # family-wise threshold for the chi-square p-values, as in test_rejection_sampler
)

# ---------------------------------------------------------------- prefix-hashed target and draft


def _hashed_logits(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    key = zlib.crc32(repr((salt, prefix)).encode())
    return torch.randn(HASH_VOCAB, generator=torch.Generator().manual_seed(key)) * 2.0


def target_row(prefix: tuple[int, ...]) -> torch.Tensor:
    return torch.softmax(_hashed_logits(prefix, 0), dim=-1)


def draft_row(prefix: tuple[int, ...]) -> torch.Tensor:
    """Correlated with the target: its logits plus independent noise."""
    return torch.softmax(_hashed_logits(prefix, 0) + 1.5 * _hashed_logits(prefix, 1), dim=-1)


def one_hot(rows: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(rows.argmax(dim=-1), rows.shape[-1]).float()


def tree_rows(row_fn: Callable, prefix: tuple[int, ...], tree: DraftTree) -> torch.Tensor:
    """``[N + 1, V]``: the row after the prefix, then the row after each node's path."""
    paths = [prefix + tuple(tree.path_tokens(i)) for i in range(tree.num_nodes)]
    return torch.stack([row_fn(prefix)] + [row_fn(p) for p in paths])


def draft_fn(prefix: tuple[int, ...]) -> Callable:
    def rows(tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        return torch.stack(
            [draft_row(prefix + (tuple(tree.path_tokens(n)) if n >= 0 else ())) for n in nodes]
        )

    return rows


def random_tree(gen: torch.Generator, num_nodes: int, vocab: int) -> DraftTree:
    """A random BFS-ordered tree with distinct sibling tokens."""
    parents: list[int] = []
    tokens: list[int] = []
    for i in range(num_nodes):
        low = parents[-1] if parents else -1
        parent = int(torch.randint(low, i, (), generator=gen)) if i > low + 1 else low
        used = {t for t, p in zip(tokens, parents, strict=True) if p == parent}
        free = [t for t in range(vocab) if t not in used]
        parents.append(parent)
        tokens.append(free[int(torch.randint(len(free), (), generator=gen))])
    return DraftTree(tokens, parents, vocab_size=vocab)


# ---------------------------------------------------------------- structure


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(token_ids=[1, 2], parents=[-1]), "2 token_ids but 1 parents"),
        (dict(token_ids=[1, 2], parents=[-1, 1]), "must be -1 or an earlier node"),
        (dict(token_ids=[1, 2], parents=[-1, -2]), "must be -1 or an earlier node"),
        (dict(token_ids=[1, 2, 3, 4], parents=[-1, -1, 1, 0]), "BFS order"),
        (dict(token_ids=[1, 2, 1], parents=[-1, -1, -1]), "repeats token 1"),
        (dict(token_ids=[1, 2, 3], parents=[-1, 0, 1], max_nodes=2), "more than max_nodes=2"),
        (dict(token_ids=[1, 12], parents=[-1, 0], vocab_size=12), "outside [0, 12)"),
        (dict(token_ids=[-3], parents=[-1]), "token id -3"),
        (dict(token_ids=[1], parents=[-1], draft_probs=torch.ones(1, 4)), "must be [2, vocab]"),
        (dict(token_ids=[1], parents=[-1], sampled=True), "needs draft_probs"),
        (dict(token_ids=[1], parents=[-1], confidence=torch.ones(2)), "confidence must be [1]"),
        (dict(token_ids=[1], parents=[-1], confidence=torch.tensor([1.5])), "in [0, 1]"),
        (dict(token_ids=torch.ones(1, 1), parents=[-1]), "one-dimensional"),
    ],
)
def test_malformed_tree_raises(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DraftTree(**kwargs)


def test_mask_positions_paths_of_a_small_tree() -> None:
    #        root
    #       /    \
    #     0:5    1:7
    #    /   \      \
    #  2:1   3:2    4:1
    #   |
    #  5:9
    tree = DraftTree([5, 7, 1, 2, 1, 9], [-1, -1, 0, 0, 1, 2])
    assert tree.depths == (1, 1, 2, 2, 2, 3)
    assert tree.max_depth == 3
    assert tree.children(-1) == (0, 1) and tree.children(0) == (2, 3) and tree.children(5) == ()
    assert tree.path(5) == [0, 2, 5] and tree.ancestors(5) == [2, 0]
    assert tree.path_tokens(5) == [5, 1, 9] and tree.path_tokens(4) == [7, 1]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [0, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attention_mask(), expected)
    assert tree.positions(10).tolist() == [11, 11, 12, 12, 12, 13]
    assert not tree.is_chain() and chain_tree([4, 4, 4]).is_chain()
    with pytest.raises(ValueError, match="root_position"):
        tree.positions(-1)
    with pytest.raises(ValueError, match="outside"):
        tree.path(6)


def test_growth_shapes_and_scores() -> None:
    prefix = (3,)
    static = grow_tree(draft_fn(prefix), HASH_VOCAB, 3, branching=2, sampled=False)
    assert static.num_nodes == 2 + 4 + 8
    assert all(len(static.children(n)) == 2 for n in [-1, *range(6)])
    # Deterministic children are the parent row's most probable tokens, best first.
    root_top = draft_row(prefix).topk(2).indices.tolist()
    assert [static.tokens[c] for c in static.children(-1)] == root_top
    scores = static.path_scores()
    expected = draft_row(prefix)[root_top[0]] * draft_row(prefix + (root_top[0],)).max()
    assert torch.isclose(scores[2], expected)

    dynamic = grow_tree(draft_fn(prefix), HASH_VOCAB, 4, width=4, max_nodes=7, sampled=False)
    assert dynamic.num_nodes == 7
    # The kept nodes are the 7 best-scoring nodes of the grown tree (best-first is ancestor-closed).
    full = grow_tree(draft_fn(prefix), HASH_VOCAB, 4, width=4, max_nodes=16, sampled=False)
    kept = sorted(dynamic.path_scores().tolist(), reverse=True)
    assert kept == pytest.approx(sorted(full.path_scores().tolist(), reverse=True)[:7])
    with pytest.raises(ValueError, match="cannot be pruned"):
        prune_to_best(grow_tree(draft_fn(prefix), HASH_VOCAB, 2, branching=2, sampled=True), 3)

    torch.manual_seed(0)
    sampled = grow_tree(draft_fn(prefix), HASH_VOCAB, 3, width=3, max_nodes=8, sampled=True)
    assert sampled.sampled and sampled.num_nodes <= 8
    assert all(len(sampled.children(n)) <= 3 for n in [-1, *range(sampled.num_nodes)])


def test_sampled_children_are_draws_without_replacement() -> None:
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    torch.manual_seed(1)
    draws = sampled_children(q.expand(20_000, 4), [2] * 20_000)
    pairs = torch.tensor(draws)
    assert bool((pairs[:, 0] != pairs[:, 1]).all()) and bool((pairs < 3).all())
    # P(x1 = a, x2 = b) = q_a q_b / (1 - q_a) for sequential draws without replacement.
    observed = torch.zeros(3, 3)
    for a, b in pairs.tolist():
        observed[a, b] += 1
    expected = torch.tensor(
        [[q[0, a] * q[0, b] / (1 - q[0, a]) if a != b else 0 for b in range(3)] for a in range(3)]
    )
    mask = expected > 0
    _, p_value = stats.chisquare(observed[mask].numpy(), (expected[mask] * 20_000).numpy())
    assert p_value > P_THRESHOLD
    # A row with fewer non-zero tokens than asked for yields only those.
    assert sampled_children(q, [5]) and len(sampled_children(q, [5])[0]) == 3
    with pytest.raises(ValueError, match="one position per row"):
        sampled_children(q, [1], seed=3)


def test_level_functions_reject_bad_input() -> None:
    tree = DraftTree([1, 2], [-1, -1], vocab_size=4)
    with pytest.raises(ValueError, match=r"must be \[2, vocab\]"):
        grow_static_level(tree, torch.ones(1, 4) / 4, 2, sampled=False)
    with pytest.raises(ValueError, match="branching must be >= 1"):
        grow_static_level(tree, torch.ones(2, 4) / 4, 0, sampled=False)
    with pytest.raises(ValueError, match="has width 5"):
        grow_dynamic_level(tree, torch.ones(2, 5) / 5, 2, 8, sampled=False)
    with pytest.raises(ValueError, match="either all sampled"):
        grow_static_level(tree, torch.ones(2, 4) / 4, 1, sampled=True)
    with pytest.raises(ValueError, match="exactly one of"):
        grow_tree(draft_fn(()), 4, 2, sampled=False)
    assert frontier(tree) == [0, 1] and frontier(DraftTree([], [])) == [-1]


# ---------------------------------------------------------------- greedy and seeded: the coupling

SHAPES = {
    "chain": dict(branching=1),
    "static_b2": dict(branching=2),
    "static_b3": dict(branching=3),
    "dynamic": dict(width=4, max_nodes=10),
}
PROMPTS = [(1,), (2, 5), (7, 7, 3)]
NUM_OUTPUT = 24


def decode(
    shape: dict | None, greedy: bool, seeds: list[int | None], sampled: bool = False
) -> list[list[int]]:
    """Speculative decode of every prompt with one tree per step, all in one batched verify;
    ``shape=None`` drafts random trees unrelated to the draft model."""
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    gen = torch.Generator().manual_seed(5)
    while min(len(o) for o in outputs) < NUM_OUTPUT:
        trees, rows, firsts = [], [], []
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            prefix = prompt + tuple(out)
            if shape is None:
                tree = random_tree(gen, int(torch.randint(0, 9, (), generator=gen)), HASH_VOCAB)
            else:
                seed = seeds[len(trees)]
                tree = grow_tree(
                    draft_fn(prefix), HASH_VOCAB, 3, sampled=sampled, seed=seed,
                    first_position=len(prefix), **shape,
                )  # fmt: skip
            target = tree_rows(target_row, prefix, tree)
            trees.append(tree)
            rows.append(one_hot(target) if greedy else target)
            firsts.append(len(prefix))
        result = verify_trees(trees, rows, [greedy] * len(trees), seeds, firsts)
        for b, out in enumerate(outputs):
            n = int(result.num_accepted[b])
            emitted = result.output_token_ids[b, : n + 1].tolist()
            assert emitted[:n] == trees[b].path_tokens(result.accepted_nodes[b][-1]) if n else True
            assert -1 not in emitted
            out.extend(emitted)
    return [o[:NUM_OUTPUT] for o in outputs]


def plain_decode(seeds: list[int | None]) -> list[list[int]]:
    outputs = []
    for prompt, seed in zip(PROMPTS, seeds, strict=True):
        out: list[int] = []
        for _ in range(NUM_OUTPUT):
            row = target_row(prompt + tuple(out))[None]
            pos = len(prompt) + len(out)
            out.append(int(row.argmax() if seed is None else sample(row, [seed], [pos])[0]))
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("shape", [*SHAPES, "random"])
def test_greedy_tree_decode_equals_plain_greedy(shape: str) -> None:
    seeds = [None] * len(PROMPTS)
    assert decode(SHAPES.get(shape), True, seeds) == plain_decode(seeds)


SEEDED_CASES = [(shape, sampled) for shape in SHAPES for sampled in (True, False)]


@pytest.mark.parametrize(
    ("shape", "sampled"),
    [*SEEDED_CASES, ("random", False)],
    ids=[f"{s}-{'race_siblings' if d else 'top_b'}" for s, d in SEEDED_CASES] + ["random"],
)
def test_seeded_tokens_do_not_depend_on_the_tree(shape: str, sampled: bool) -> None:
    seeds: list[int | None] = [11, 12, 2**40 + 3]
    assert decode(SHAPES.get(shape), False, seeds, sampled) == plain_decode(seeds)


@pytest.mark.parametrize("seed", [None, 77])
def test_branching_one_drafts_the_chain_the_proposer_draws(seed: int | None) -> None:
    """A one-child-per-node sampled tree draws each token by the proposer's rule
    (`sample_from_probs` on the draft row at the token's position) from the same generator."""
    prefix = (4, 1)
    torch.manual_seed(3)
    tree = grow_tree(
        draft_fn(prefix), HASH_VOCAB, 5, branching=1, sampled=True, seed=seed, first_position=2
    )
    torch.manual_seed(3)
    chain: list[int] = []
    for step in range(5):
        row = draft_row(prefix + tuple(chain))[None]
        chain.append(int(sample_from_probs(row, [False], [seed], [2 + step])[0]))
    assert tree.is_chain() and list(tree.tokens) == chain
    expected_q = [draft_row(prefix + tuple(chain[:j]))[chain[j]] for j in range(5)]
    assert torch.allclose(tree.confidence, torch.stack(expected_q))


def test_tree_accepts_as_much_as_its_best_chain_on_greedy_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    for trial in range(150):
        prefix = (trial % HASH_VOCAB,)
        if trial % 2:
            tree = random_tree(gen, int(torch.randint(1, 12, (), generator=gen)), HASH_VOCAB)
        else:
            tree = grow_tree(draft_fn(prefix), HASH_VOCAB, 3, branching=2, sampled=False)
        rows = one_hot(tree_rows(target_row, prefix, tree))
        got = verify_trees([tree], [rows], [True], [None], [1])
        leaves = [i for i in range(tree.num_nodes) if not tree.children(i)]
        chains = [chain_tree(tree.path_tokens(leaf)) for leaf in leaves]
        chain_results = verify_trees(
            chains,
            [one_hot(tree_rows(target_row, prefix, c)) for c in chains],
            [True] * len(chains),
            [None] * len(chains),
            [1] * len(chains),
        )
        best = int(chain_results.num_accepted.max())
        assert int(got.num_accepted[0]) >= best
        # The greedy walk is unique, so the tree accepts exactly the best chain's tokens.
        assert int(got.num_accepted[0]) == best
        winner = int(chain_results.num_accepted.argmax())
        assert torch.equal(
            got.output_token_ids[0, : best + 1], chain_results.output_token_ids[winner, : best + 1]
        )


# ---------------------------------------------------------------- chains: identical to today


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("with_q", [True, False], ids=["sampled_q", "one_hot_q"])
def test_chain_tree_matches_rejection_sample(k: int, with_q: bool) -> None:
    batch, vocab = 300, 8
    gen = torch.Generator().manual_seed(k)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 1.5, dim=-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    torch.manual_seed(7)
    ref = rejection_sample(target, drafts, q if with_q else None, torch.full((batch,), k))
    trees = [chain_tree(drafts[b], q[b] if with_q else None) for b in range(batch)]
    torch.manual_seed(7)
    got = verify_trees(trees, list(target), [False] * batch, [None] * batch, [0] * batch)
    assert torch.equal(got.output_token_ids, ref.output_token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert got.accepted_nodes == [list(range(n)) for n in ref.num_accepted.tolist()]
    assert all(r == [0] * len(r) for r in got.accepted_ranks)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_chain_tree_matches_coupled_verify(mode: str) -> None:
    batch, k, vocab = 64, 4, 8
    gen = torch.Generator().manual_seed(4)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)
    greedy = [mode == "greedy"] * batch
    if mode == "greedy":
        target = one_hot(target)
    seeds = [None if g else 100 + b for b, g in enumerate(greedy)]
    positions = [int(torch.randint(0, 50, (), generator=gen)) for _ in range(batch)]
    # Drafts that mostly are the target's own picks, with a random token now and then.
    picks = torch.stack(
        [
            sample(target[:, j], seeds, [p + j for p in positions]) if mode == "seeded"
            else target[:, j].argmax(-1)
            for j in range(k)
        ],
        dim=1,
    )  # fmt: skip
    noise = torch.randint(0, vocab, (batch, k), generator=gen)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.25, noise, picks)
    ref = verify_drafts(target, drafts, None, [k] * batch, greedy, seeds, positions)
    trees = [chain_tree(drafts[b]) for b in range(batch)]
    got = verify_trees(trees, list(target), greedy, seeds, positions)
    assert torch.equal(got.output_token_ids, ref.output_token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert 0 < int(got.num_accepted.sum()) < batch * k


def test_verify_rejects_bad_input() -> None:
    tree = DraftTree([1, 2], [-1, 0])
    rows = torch.ones(3, 4) / 4
    with pytest.raises(ValueError, match=r"must be \[3, vocab\]"):
        verify_trees([tree], [rows[:2]], [True], [None], [0])
    with pytest.raises(ValueError, match="1 trees, 1 target_probs, 2 greedy"):
        verify_trees([tree], [rows], [True, True], [None], [0])
    with pytest.raises(ValueError, match="outside the target's vocab"):
        verify_trees([DraftTree([5], [-1])], [rows[:2]], [True], [None], [0])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3)
    impossible = DraftTree([0], [-1], draft_probs=q[:2], sampled=True)
    with pytest.raises(ValueError, match="zero probability"):
        verify_trees([impossible], [rows[:2]], [False], [None], [0])
    unread_root = DraftTree([0], [-1], draft_probs=torch.full((2, 4), float("nan")), sampled=True)
    with pytest.raises(ValueError, match="draft row of node -1"):
        verify_trees([unread_root], [rows[:2]], [False], [None], [0])
    # Greedy and seeded verification never read the draft rows.
    assert verify_trees([unread_root], [one_hot(rows[:2])], [True], [None], [0]).num_accepted == 1


# ---------------------------------------------------------------- sampled: exact distribution

MARKOV_VOCAB = 5
START = 0
TRIALS = 3_000


def markov_chains() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    target = torch.softmax(torch.randn(MARKOV_VOCAB, MARKOV_VOCAB, generator=gen), dim=-1)
    draft = torch.softmax(2.0 * torch.randn(MARKOV_VOCAB, MARKOV_VOCAB, generator=gen), dim=-1)
    return target, draft


def grow_markov(draft: torch.Tensor, roots: list[int], rule: str) -> list[DraftTree]:
    """One depth-2 tree per root from the Markov draft: 3 children at the root, 2 under each.

    Static rules draw each level for all trials at once with the library's child pickers;
    ``dynamic`` grows each tree through `grow_dynamic_level` (width 4, at most 7 nodes)."""
    sampled = rule in ("sampled", "stale_q", "dynamic", "sampled_pruned")
    if rule == "dynamic":
        trees = []
        for root in roots:
            tree = empty_tree(MARKOV_VOCAB, sampled=True)
            for _ in range(2):
                rows = draft[[root if n < 0 else tree.tokens[n] for n in frontier(tree)]]
                tree = grow_dynamic_level(tree, rows, 4, 7, sampled=True)
            trees.append(tree)
        return trees

    def pick(rows: torch.Tensor, count: int) -> list[list[int]]:
        counts = [count] * rows.shape[0]
        return sampled_children(rows, counts) if sampled else top_children(rows, counts)

    level1 = pick(draft[roots], 3)
    if rule == "sampled_pruned":  # wrong: drop the drawn child of lowest draft probability
        level1 = [
            [t for t in kids if t != min(kids, key=lambda t: float(draft[root, t]))]
            for root, kids in zip(roots, level1, strict=True)
        ]
    level2 = iter(pick(draft[[t for kids in level1 for t in kids]], 2))
    trees = []
    for root, kids in zip(roots, level1, strict=True):
        grandkids = [next(level2) for _ in kids]
        tokens = kids + [t for g in grandkids for t in g]
        parents = [-1] * len(kids) + [i for i, g in enumerate(grandkids) for _ in g]
        rows = draft[[root, *tokens]]  # leaves' rows are never read
        confidence = rows[[p + 1 for p in parents], tokens]
        # top_b_as_sampled is wrong on purpose: deterministic candidates under the sampled rule.
        as_sampled = sampled or rule == "top_b_as_sampled"
        trees.append(DraftTree(tokens, parents, confidence, rows, sampled=as_sampled))
    return trees


def first_two_tokens(rule: str, trials: int) -> torch.Tensor:
    """``[trials, 2]``: the first two tokens each trial emits, one tree per verify step."""
    target, draft = markov_chains()
    out = torch.full((trials, 2), -1)
    roots = [START] * trials
    pending = list(range(trials))
    filled = [0] * trials
    while pending:
        trees = grow_markov(draft, [roots[t] for t in pending], rule)
        rows = [target[[roots[t], *tree.tokens]] for t, tree in zip(pending, trees, strict=True)]
        n = len(pending)
        result = verify_trees(trees, rows, [False] * n, [None] * n, [0] * n)
        for i, t in enumerate(pending):
            emitted = result.output_token_ids[i, : int(result.num_accepted[i]) + 1].tolist()
            take = emitted[: 2 - filled[t]]
            out[t, filled[t] : filled[t] + len(take)] = torch.tensor(take)
            filled[t] += len(take)
            roots[t] = emitted[-1]
        pending = [t for t in pending if filled[t] < 2]
    return out


def chi_square_p_values(tokens: torch.Tensor) -> tuple[float, float]:
    target, _ = markov_chains()
    target = target.double()
    first = torch.bincount(tokens[:, 0], minlength=MARKOV_VOCAB).double()
    joint = torch.bincount(tokens[:, 0] * MARKOV_VOCAB + tokens[:, 1], minlength=MARKOV_VOCAB**2)
    p_values = []
    for observed, probs in ((first, target[START]), (joint, target[START][:, None] * target)):
        expected = probs.flatten() / probs.sum() * len(tokens)
        p_values.append(float(stats.chisquare(observed.double().numpy(), expected.numpy())[1]))
    return p_values[0], p_values[1]


@pytest.mark.parametrize("rule", ["sampled", "top_b", "dynamic"])
def test_sampled_tree_verification_keeps_the_target_distribution(rule: str) -> None:
    """Siblings drawn without replacement (static and dynamic shapes) under the sampled rule, and
    top-b candidates under the one-hot rule, emit the target's first token and first two tokens."""
    torch.manual_seed(123)
    trials = TRIALS if rule != "dynamic" else TRIALS * 2 // 3  # per-tree growth costs more
    p_first, p_joint = chi_square_p_values(first_two_tokens(rule, trials))
    assert p_first > P_THRESHOLD and p_joint > P_THRESHOLD, (p_first, p_joint)


@pytest.mark.parametrize("rule", ["top_b_as_sampled", "stale_q", "sampled_pruned"])
def test_wrong_tree_rules_fail_the_same_check(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has power: top-b candidates under the without-replacement rule, a q that is not
    updated after a rejected sibling, and a drawn sibling pruned for its own low probability."""
    if rule == "stale_q":
        monkeypatch.setattr(tree_verify, "_without", lambda q, token: q)
    torch.manual_seed(123)
    p_first, p_joint = chi_square_p_values(first_two_tokens(rule, TRIALS))
    assert min(p_first, p_joint) < P_THRESHOLD, (p_first, p_joint)
