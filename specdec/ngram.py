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
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
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
