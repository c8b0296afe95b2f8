"""Losslessness check: at temperature 0, speculative output must equal plain output exactly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

CONTEXT = 8  # tokens shown either side of the first difference


@dataclass(frozen=True)
class Mismatch:
    """The first position where one prompt's speculative and plain greedy outputs differ."""

    prompt_id: str
    category: str
    proposer: str
    k: int
    position: int  # index into the output of the first differing token
    spec_len: int
    plain_len: int
    spec_window: list[int]  # tokens around `position` in the speculative output
    plain_window: list[int]  # the same span of the plain output
    tree_nodes: int = 0  # > 0: the speculative run drafted trees of this many nodes

    def describe(self) -> str:
        return (
            f"FAILURE: {self.proposer} k={self.k}{f' tree={self.tree_nodes}' if self.tree_nodes else ''}"
            f" on {self.prompt_id} ({self.category}): greedy "
            f"speculative output differs from plain decode at output token {self.position} "
            f"(lengths {self.spec_len} vs {self.plain_len}); speculative ...{self.spec_window}... "
            f"plain ...{self.plain_window}..."
        )

    def to_dict(self) -> dict:
        return asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(
    spec: Mapping[str, Sequence[int]],
    plain: Mapping[str, Sequence[int]],
    categories: Mapping[str, str],
    proposer: str,
    k: int,
    tree_nodes: int = 0,
) -> list[Mismatch]:
    """Every prompt whose speculative output is not token-identical to its plain output.

    ``spec`` and ``plain`` map prompt id -> output token ids; a prompt missing from either side is
    a mismatch at position 0 (an output that was never produced cannot be checked).
    """
    mismatches = []
    for prompt_id in sorted(set(spec) | set(plain)):
        s = list(spec.get(prompt_id, ()))
        p = list(plain.get(prompt_id, ()))
        missing = prompt_id not in spec or prompt_id not in plain
        pos = 0 if missing else first_difference(s, p)
        if pos is None:
            continue
        lo, hi = max(0, pos - CONTEXT), pos + CONTEXT
        mismatches.append(
            Mismatch(
                prompt_id=prompt_id,
                category=categories.get(prompt_id, "?"),
                proposer=proposer,
                k=k,
                position=pos,
                spec_len=len(s),
                plain_len=len(p),
                spec_window=s[lo:hi],
                plain_window=p[lo:hi],
                tree_nodes=tree_nodes,
            )
        )
    return mismatches
