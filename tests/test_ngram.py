"""Prompt-lookup proposals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.ngram import propose_ngram, propose_ngram_tree


def test_simple_match_proposes_what_followed() -> None:
    tokens = [10, 11, 12, 13, 14, 10, 11]
    assert propose_ngram(tokens, k=3, n_min=1, n_max=2) == [12, 13, 14]


def test_longest_n_preferred() -> None:
    # Suffix [7, 8, 9]: the 3-gram occurs at 0 (followed by 1); the 1-gram [9] occurs more recently
    # at 6 (followed by 4). The longest n must win.
    tokens = [7, 8, 9, 1, 2, 3, 9, 4, 5, 7, 8, 9]
    assert propose_ngram(tokens, k=2, n_min=1, n_max=3) == [1, 2]
    # Allowed only 1-grams, the most recent [9] wins.
    assert propose_ngram(tokens, k=2, n_min=1, n_max=1) == [4, 5]


def test_falls_back_to_shorter_n() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 3]  # no earlier [6, 3], but [3] occurs at 2
    assert propose_ngram(tokens, k=2, n_min=1, n_max=3) == [4, 5]
    assert propose_ngram(tokens, k=2, n_min=2, n_max=3) == []


def test_most_recent_occurrence_wins() -> None:
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert propose_ngram(tokens, k=1, n_min=2, n_max=2) == [3]


def test_no_match_returns_empty() -> None:
    assert propose_ngram([1, 2, 3, 4], k=3, n_min=1, n_max=3) == []
    assert propose_ngram([], k=3, n_min=1, n_max=3) == []
    assert propose_ngram([1], k=3, n_min=1, n_max=3) == []


def test_continuation_shorter_than_k() -> None:
    tokens = [4, 5, 9, 4, 5]
    assert propose_ngram(tokens, k=5, n_min=2, n_max=2) == [9, 4, 5]


def test_overlapping_match_with_suffix() -> None:
    # Suffix [7, 7]; its most recent earlier start is 2, overlapping the suffix; one token follows.
    assert propose_ngram([7, 7, 7, 7], k=4, n_min=2, n_max=2) == [7]
    assert propose_ngram([7, 7, 7, 7], k=4, n_min=1, n_max=1) == [7]


def test_suffix_itself_is_not_a_match() -> None:
    assert propose_ngram([3, 1, 2], k=2, n_min=2, n_max=2) == []


def test_pattern_longer_than_sequence_is_skipped() -> None:
    assert propose_ngram([1, 2, 1], k=2, n_min=1, n_max=10) == [2, 1]


@pytest.mark.parametrize(
    ("k", "n_min", "n_max"), [(0, 1, 2), (-1, 1, 2), (2, 0, 2), (2, 3, 2), (2, -1, -1)]
)
def test_validation(k: int, n_min: int, n_max: int) -> None:
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 3], k=k, n_min=n_min, n_max=n_max)


def test_long_sequence() -> None:
    tokens = list(range(3000)) + [42, 43, 44]
    assert propose_ngram(tokens, k=4, n_min=1, n_max=3) == [45, 46, 47, 48]


def _reference(tokens: list[int], k: int, n_min: int, n_max: int) -> tuple[int, int] | None:
    """(n, match start) by a plain scan, or None."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        pattern = tokens[-n:]
        for m in range(len(tokens) - n - 1, -1, -1):
            if tokens[m : m + n] == pattern:
                return n, m
    return None


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 6),
    n_min=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_proposal_is_continuation_of_latest_longest_match(
    tokens: list[int], k: int, n_min: int, extra: int
) -> None:
    n_max = n_min + extra
    proposal = propose_ngram(tokens, k, n_min, n_max)
    found = _reference(tokens, k, n_min, n_max)
    if found is None:
        assert proposal == []
        return
    n, m = found
    assert 1 <= len(proposal) <= k
    assert len(proposal) == min(k, len(tokens) - (m + n))
    for i, token in enumerate(proposal):
        assert token == tokens[m + n + i]


def test_ngram_tree_merges_several_occurrences_and_starts_with_the_chain():
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 1, 2]
    ids, parents = propose_ngram_tree(tokens, k=3, n_min=1, n_max=2, max_nodes=8)
    # occurrences of [1, 2], newest first: ...3 7 1, ...4 5 1, ...3 9 1, merged by prefix
    assert ids == [3, 4, 7, 9, 5, 1, 1, 1]
    assert parents == [-1, -1, 0, 0, 1, 2, 3, 4]
    chain = propose_ngram(tokens, k=3, n_min=1, n_max=2)
    path, node = [], 0
    while True:
        path.append(ids[node])
        kids = [j for j, p in enumerate(parents) if p == node]
        if not kids:
            break
        node = kids[0]
    assert path == chain
    small, small_parents = propose_ngram_tree(tokens, k=3, n_min=1, n_max=2, max_nodes=4)
    # the newest continuation whole, then what of the next fits
    assert small == [3, 4, 7, 1] and small_parents == [-1, -1, 0, 2]
    assert propose_ngram_tree([1, 2, 3], k=2, n_min=2, n_max=2, max_nodes=4) == ([], [])
    with pytest.raises(ValueError, match="max_nodes"):
        propose_ngram_tree(tokens, k=3, n_min=1, n_max=2, max_nodes=0)
