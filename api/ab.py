"""A/B assignment of requests to the speculative (`spec`) or plain-decode (`plain`) arm.

A request chooses its speculation mode with the body field ``speculative`` or, failing that, the
header ``X-Specdec-Speculative``; the body wins when both are present. A request that did not
choose gets the server default, unless ``--ab-split P`` is set: then it goes to ``spec`` with
probability P and to ``plain`` (mode ``off``) otherwise, drawn from a seedable RNG in arrival
order. The arm of a request is ``plain`` exactly when it never speculates (mode ``off``, or an
engine without a proposer), ``spec`` otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specdec.engine.errors import InvalidRequestError

SPECULATIVE_HEADER = "X-Specdec-Speculative"
ARM_HEADER = "X-Specdec-Arm"
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Assignment:
    mode: str  # effective speculation mode passed to the engine: "auto" | "on" | "off"
    arm: str  # "spec" | "plain"
    chosen_by: str  # "body" | "header" | "ab_split" | "default"


class ArmAssigner:
    """Decides each request's speculation mode and arm (not thread-safe: event loop only)."""

    def __init__(
        self,
        default_mode: str,
        has_proposer: bool,
        split: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.default_mode = default_mode
        self.has_proposer = has_proposer
        self.split = split
        self._rng = random.Random(seed)
        # The spec arm speculates the way the server would by default, or with the controller
        # deciding when the server default is plain decode.
        self.spec_arm_mode = default_mode if default_mode != "off" else "auto"

    def arm_of(self, mode: str) -> str:
        return "plain" if mode == "off" or not self.has_proposer else "spec"

    def assign(self, body_mode: str | None, header_mode: str | None) -> Assignment:
        """Mode and arm for one request; raises InvalidRequestError for a bad header value."""
        if body_mode is not None:
            return Assignment(body_mode, self.arm_of(body_mode), "body")
        if header_mode is not None:
            mode = header_mode.strip().lower()
            if mode not in MODES:
                raise InvalidRequestError(
                    f"header {SPECULATIVE_HEADER} must be one of {', '.join(MODES)}, "
                    f"got {header_mode!r}",
                    param=SPECULATIVE_HEADER,
                )
            return Assignment(mode, self.arm_of(mode), "header")
        if self.split is not None and self.has_proposer:
            if self._rng.random() < self.split:
                return Assignment(self.spec_arm_mode, "spec", "ab_split")
            return Assignment("off", "plain", "ab_split")
        return Assignment(self.default_mode, self.arm_of(self.default_mode), "default")
