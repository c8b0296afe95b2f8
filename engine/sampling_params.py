"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.engine.errors import InvalidRequestError

# Upper bound on stop strings / stop ids per request: matching cost grows with their number.
MAX_STOP_SEQUENCES = 16


@dataclass(frozen=True)
class Bound:
    """A closed or half-open interval of accepted values; ``None`` is an open end."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        return f"must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def json_schema(self) -> dict[str, float]:
        """The bound as JSON Schema keywords (for the OpenAPI document)."""
        schema: dict[str, float] = {}
        if self.low is not None:
            schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


# The accepted range of every numeric sampling parameter: the one table both the validation below
# and the API schema (api.protocol) read.
# - temperature: OpenAI's [0, 2]; 0 is greedy, tiny positive values are clamped by the sampler.
# - top_p, min_p: probabilities; top_p = 0 would keep nothing.
# - top_k: -1 or 0 disable it, k >= 1 keeps the k most likely tokens (k >= vocab keeps all); the
#   upper end keeps the value a 32-bit integer on the device.
# - presence/frequency penalty: OpenAI's [-2, 2].
# - repetition_penalty: the HF/vLLM multiplicative penalty (1 = off). Logits of seen tokens are
#   divided (or multiplied) by it, so tiny values blow them up past float range (inf, then NaN
#   probabilities); [0.01, 2] keeps a logit's magnitude within x100 and covers every setting in
#   practical use (1.0-1.3 to discourage repetition, < 1 to encourage it).
# - seed: any 64-bit value, signed or unsigned (the noise stream reduces it modulo 2^64).
# - max_tokens: at least one token; the upper end is max_model_len (checked by the engine).
BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, 2.0),
    "top_p": Bound(0.0, 1.0, low_open=True),
    "top_k": Bound(-1, 2**31 - 1),
    "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.01, 2.0),
    "seed": Bound(-(2**63), 2**64 - 1),
    "max_tokens": Bound(1),
}

_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INTS = ("top_k", "seed", "max_tokens")


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    Every numeric field must lie in its range of ``BOUNDS``. ``temperature == 0`` means greedy.
    ``top_k <= 0`` disables top-k; ``top_p == 1`` and
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
            """``why`` is a phrase that follows the parameter's name ("must be ...")."""
            return InvalidRequestError(f"{param} {why}", param=param)

        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise bad(name, f"must be finite, got {value!r}")
        for name in _INTS:
            value = getattr(self, name)
            if value is None and name != "top_k":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, f"must be an integer, got {value!r}")
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value not in bound:
                raise bad(name, f"{bound.describe()}, got {value}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad(
                "stop", f"holds {len(self.stop)} strings, at most {MAX_STOP_SEQUENCES} allowed"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"must hold non-empty strings, got {s!r}")
        if len(self.stop_token_ids) > 4 * MAX_STOP_SEQUENCES:
            raise bad(
                "stop_token_ids",
                f"holds {len(self.stop_token_ids)} ids, at most {4 * MAX_STOP_SEQUENCES} allowed",
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
                raise bad("stop_token_ids", f"must hold token ids (integers >= 0), got {t!r}")

    @property
    def greedy(self) -> bool:
        """Greedy requests take the argmax; top_k == 1 is greedy too."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def warped(self) -> bool:
        """Whether the request's tokens are drawn from a full warped distribution: the sampling
        work a step pays per row of it, which the step-cost model prices (greedy rows take an
        argmax)."""
        return not self.greedy

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )
