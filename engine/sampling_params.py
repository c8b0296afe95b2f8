"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

# Upper bound on stop strings / stop ids per request: matching cost grows with their number.
MAX_STOP_SEQUENCES = 16


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters. Penalties follow OpenAI (presence/frequency, additive on
    logits of tokens already generated) and the HF/vLLM repetition penalty (multiplicative on logits
    of tokens in prompt or output, 1.0 = off). ``max_tokens=None`` generates until ``max_model_len``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists (and a single string for stop) for convenience, store tuples (hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        finite = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        for name, value in finite.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise bad(name, f"must be finite, got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise bad("top_k", f"must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad("stop", f"at most {MAX_STOP_SEQUENCES} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"stop strings must be non-empty strings, got {s!r}")
        if len(self.stop_token_ids) > 4 * MAX_STOP_SEQUENCES:
            raise bad("stop_token_ids", "too many stop token ids")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        """Greedy requests take the argmax; top_k == 1 is greedy too."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )
