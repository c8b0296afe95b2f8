"""Which replica holds a prompt's prefix: the routing decision, without Ray.

A prompt's prefix is named by the same keys the engine's prefix cache uses
(``engine.block_allocator.chain_hash`` over full ``page_size`` blocks), so what a replica reports
from its cache and what the router computes from a prompt compare directly. Keys are truncated to
``KEY_BYTES`` to keep the reports small; a false match on 8 bytes of SHA-256 only costs a less
useful routing choice, never a wrong answer (the engine checks the block's tokens itself).

Per replica the index keeps two sets: the keys the replica last reported (its cache as it is,
evictions included) and the keys of prompts routed to it recently (not yet visible in a report:
the prefill may not even have run). A new report replaces the first set and drops routed keys
older than ``routed_ttl_s``, which should cover a report period plus a prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from specdec.engine.block_allocator import chain_hash

KEY_BYTES = 8


def prompt_keys(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Keys of the prompt's full blocks that the engine's prefix lookup can reuse (it always
    leaves the last token to compute, hence ``len - 1``)."""
    keys: list[bytes] = []
    prev: bytes | None = None
    for i in range((len(token_ids) - 1) // page_size):
        prev = chain_hash(prev, token_ids[i * page_size : (i + 1) * page_size])
        keys.append(prev[:KEY_BYTES])
    return keys


def short_keys(full_keys: Iterable[bytes]) -> list[bytes]:
    """The engine's full cache keys as the router's truncated ones."""
    return [k[:KEY_BYTES] for k in full_keys]


class PrefixIndex:
    """Cached-prefix keys per replica (any hashable replica id); event-loop use only."""

    def __init__(self, routed_ttl_s: float = 10.0, max_routed_keys: int = 65536) -> None:
        self.routed_ttl_s = routed_ttl_s
        self.max_routed_keys = max_routed_keys
        self._reported: dict[Hashable, frozenset[bytes]] = {}
        self._report_version: dict[Hashable, object] = {}
        self._routed: dict[Hashable, OrderedDict[bytes, float]] = {}

    def report(self, replica: Hashable, version: object, keys: Iterable[bytes], now: float) -> None:
        """The replica's own list of cached keys; ``version`` identifies the report (Serve hands
        the same report to the router many times, it is read once)."""
        if self._report_version.get(replica) == version:
            return
        self._report_version[replica] = version
        self._reported[replica] = frozenset(keys)
        lru = self._routed.get(replica)
        while lru and next(iter(lru.values())) < now - self.routed_ttl_s:
            lru.popitem(last=False)

    def routed(self, replica: Hashable, keys: Sequence[bytes], now: float) -> None:
        """A prompt with these keys was sent to ``replica``: it will hold them once prefilled."""
        lru = self._routed.setdefault(replica, OrderedDict())
        for key in keys:
            lru[key] = now
            lru.move_to_end(key)
        while len(lru) > self.max_routed_keys:
            lru.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        self._reported.pop(replica, None)
        self._report_version.pop(replica, None)
        self._routed.pop(replica, None)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        live = set(replicas)
        for replica in list({*self._reported, *self._routed}):
            if replica not in live:
                self.forget(replica)

    def match(self, replica: Hashable, keys: Sequence[bytes]) -> int:
        """How many leading keys of a prompt the replica holds."""
        reported = self._reported.get(replica, frozenset())
        routed = self._routed.get(replica, {})
        n = 0
        for key in keys:
            if key not in reported and key not in routed:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Choice:
    """Replicas in order of preference (each inner list one rank) and why."""

    ranks: list[list[Hashable]]
    reason: str  # "affine" | "least_loaded"
    matched_blocks: int


def choose(
    loads: dict[Hashable, float], matches: dict[Hashable, int], imbalance_threshold: float
) -> Choice:
    """Rank replicas for one request.

    ``loads``: requests in flight per replica; ``matches``: leading prompt blocks each holds.
    The replica with the longest match is preferred when its load exceeds the least-loaded
    replica's by at most ``imbalance_threshold``; otherwise, or when nothing matches, the
    least-loaded replicas come first. The rest follow by load, so a full first choice falls
    through to the next instead of waiting.
    """
    if not loads:
        return Choice([], "least_loaded", 0)
    least = min(loads.values())
    best = max(matches.get(r, 0) for r in loads)
    by_load = sorted(loads, key=lambda r: (loads[r], -matches.get(r, 0)))
    if best > 0:
        holders = [r for r in by_load if matches.get(r, 0) == best]
        affine = [r for r in holders if loads[r] - least <= imbalance_threshold]
        if affine:
            first = affine[:1]
            return Choice([first, [r for r in by_load if r not in first]], "affine", best)
    first = [r for r in by_load if loads[r] == least]
    return Choice([first, [r for r in by_load if r not in first]], "least_loaded", best)
