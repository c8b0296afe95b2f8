"""Parsers for comma-separated command-line lists, with errors that name the flag."""

from __future__ import annotations

from collections.abc import Callable

from specdec.engine.errors import SpecdecError


class ArgumentError(SpecdecError):
    """A command-line value that does not parse."""


def parse_list(text: str, flag: str, convert: Callable[[str], object], what: str) -> list:
    items = [part.strip() for part in str(text).split(",") if part.strip()]
    if not items:
        raise ArgumentError(f"{flag} is empty: give {what}", param=flag)
    out = []
    for item in items:
        try:
            out.append(convert(item))
        except ValueError:
            raise ArgumentError(f"{flag}: {item!r} is not {what}", param=flag) from None
    return list(dict.fromkeys(out))


def parse_ints(text: str, flag: str, minimum: int = 1, maximum: int | None = None) -> list[int]:
    values = parse_list(text, flag, int, "a comma-separated list of integers")
    for v in values:
        if v < minimum or (maximum is not None and v > maximum):
            bound = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise ArgumentError(f"{flag}: {v} is out of range (must be {bound})", param=flag)
    return values


def parse_floats(text: str, flag: str, minimum: float = 0.0) -> list[float]:
    values = parse_list(text, flag, float, "a comma-separated list of numbers")
    for v in values:
        if not v >= minimum:
            raise ArgumentError(f"{flag}: {v:g} must be >= {minimum:g}", param=flag)
    return values


def parse_choices(text: str, flag: str, choices: tuple[str, ...]) -> list[str]:
    values = parse_list(text, flag, str, f"a comma-separated list of {', '.join(choices)}")
    bad = [v for v in values if v not in choices]
    if bad:
        raise ArgumentError(
            f"{flag}: unknown value(s) {', '.join(map(repr, bad))}; "
            f"choose from {', '.join(choices)}",
            param=flag,
        )
    return values
