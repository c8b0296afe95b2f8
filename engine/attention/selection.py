"""Decide whether the FlashInfer backend can serve on this machine (import guard + self-test)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_checked: dict[str, bool] = {}


def flashinfer_usable(device: torch.device) -> bool:
    """True when CUDA is present and FlashInfer imports; logs one line saying why when it is not."""
    key = str(device)
    if key in _checked:
        return _checked[key]
    ok = False
    if device.type != "cuda" or not torch.cuda.is_available():
        reason = "no CUDA device"
    else:
        try:
            from engine.attention import flashinfer_backend  # noqa: F401  (registers itself)

            ok = flashinfer_backend.self_test(device)
            reason = "" if ok else "self-test failed"
        except Exception as exc:  # any import/runtime failure means: fall back
            reason = f"{type(exc).__name__}: {exc}"
    if not ok:
        logger.info("FlashInfer attention unavailable (%s); using the torch backend", reason)
    _checked[key] = ok
    return ok
