"""Prompt-lookup (n-gram) proposals: copy what followed the last n tokens the previous time."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Propose up to ``k`` tokens by prompt lookup.

    For ``n`` from ``n_max`` down to ``n_min``, the last ``n`` tokens form the pattern; its most
    recent earlier occurrence (start ``m < len - n``, overlaps with the suffix allowed) is found and
    the tokens ``token_ids[m + n : m + n + k]`` are proposed. The first (longest) ``n`` with a match
    wins. Returns fewer than ``k`` tokens when the continuation runs into the end of the sequence,
    and ``[]`` when no ``n`` matches.

    Search: for each ``n`` a numpy ``sliding_window_view`` compares every earlier window with the
    pattern in one vectorised pass, O(len * n) per ``n``; with ``n_max`` of a few and sequences of
    a few thousand tokens this is tens of microseconds and needs no index kept between steps.
    """
    _check_lookup(k, n_min, n_max)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    length = ids.size
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = ids[length - n :]
        # Windows starting at 0..length-n-1: every candidate except the suffix itself, each with at
        # least one following token.
        windows = sliding_window_view(ids[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


def propose_ngram_tree(
    token_ids: Sequence[int], k: int, n_min: int, n_max: int, max_nodes: int
) -> tuple[list[int], list[int]]:
    """Several prompt-lookup continuations merged into one token tree: ``(tokens, parents)`` in
    breadth-first order (parents -1 for the root's children), at most ``max_nodes`` nodes.

    Every earlier occurrence of the last ``n`` tokens (``n`` from ``n_max`` down to ``n_min``,
    most recent first within each ``n``) offers the up to ``k`` tokens that followed it; they
    are merged into a prefix tree, a continuation's new tokens added while they fit. Siblings keep
    the order their continuations came in, so the tree's first root path is `propose_ngram`'s
    chain. Returns ``([], [])`` when nothing matches.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    _check_lookup(k, n_min, n_max)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    length = ids.size
    trie: dict[int, dict] = {}
    count = 0
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = ids[length - n :]
        windows = sliding_window_view(ids[: length - 1], n)
        for hit in np.flatnonzero((windows == pattern).all(axis=1))[::-1]:
            node = trie
            for token in ids[hit + n : hit + n + k].tolist():
                if token not in node:
                    if count == max_nodes:
                        break
                    node[token] = {}
                    count += 1
                node = node[token]
            if count == max_nodes:
                break
        if count == max_nodes:
            break
    tokens: list[int] = []
    parents: list[int] = []
    level = [(-1, trie)]
    while level:
        nxt = []
        for parent, children in level:
            for token, grandchildren in children.items():
                tokens.append(token)
                parents.append(parent)
                nxt.append((len(tokens) - 1, grandchildren))
        level = nxt
    return tokens, parents


def _check_lookup(k: int, n_min: int, n_max: int) -> None:
    """ValueError on a draft length or suffix range a lookup cannot use."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
