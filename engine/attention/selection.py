"""Decide whether the FlashInfer backend can serve on this machine (import guard + self-test).

`--attention-backend auto` asks `flashinfer_usable` once per device at start-up. The answer is
True only when a CUDA device is present, the `flashinfer` package imports, and a small mixed batch
(prompt chunk, decode, verify, page boundaries) matches the torch reference. Any failure, an
exception included, means: use the torch backend, with one log line that says why. The result is
cached, so the self-test (and FlashInfer's JIT compilation behind it) runs once per process.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

_checked: dict[str, tuple[bool, str]] = {}


def flashinfer_status(device: torch.device) -> tuple[bool, str]:
    """(usable, reason): reason is empty when usable, else a one-line cause for the fallback."""
    key = str(device)
    if key not in _checked:
        _checked[key] = _check(device)
        ok, reason = _checked[key]
        if not ok:
            logger.info("FlashInfer attention unavailable (%s); using the torch backend", reason)
    return _checked[key]


def flashinfer_usable(device: torch.device) -> bool:
    """True when CUDA is present, FlashInfer imports and its self-test passes (cached per device)."""
    return flashinfer_status(device)[0]


def _check(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        # Importing the backend module registers it; flashinfer itself is imported by the test.
        from specdec.engine.attention import flashinfer_backend

        start = time.perf_counter()
        ok = flashinfer_backend.self_test(device)
        seconds = time.perf_counter() - start
    except Exception as exc:  # import, JIT or kernel failure alike: fall back
        return False, f"{type(exc).__name__}: {_first_line(str(exc))}"
    if not ok:
        return False, "self-test output differs from the torch reference"
    logger.info("FlashInfer attention self-test passed in %.1f s", seconds)
    return True, ""


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


def reset_cache() -> None:
    """Forget earlier answers (tests, or after installing FlashInfer into a running process)."""
    _checked.clear()
