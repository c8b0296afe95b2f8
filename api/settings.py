"""Server options that are not engine options (the engine's live in engine.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.errors import ConfigError

DEFAULT_MAX_QUEUE_LEN = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings of `specdec serve`.

    ``served_model_names``: the names clients may put in ``model`` (the first is the one reported
    in responses). ``ab_split``: probability that a request which did not choose a speculation mode
    lands in the ``spec`` arm (None: no A/B assignment, the engine default applies).
    ``max_queue_len``: requests allowed to wait beyond the free batch slots before 429.
    ``max_tokens_limit``: the largest ``max_tokens`` a request may ask for (None: max_model_len).
    ``request_timeout_s``: a request still running after this long is aborted.
    ``header_timeout_s``: a connection whose request headers are not complete this long after
    they started (or after it opened) is closed. ``body_timeout_s``: a request body that stalls
    this long between chunks gets a 408.
    ``allow_special_tokens_in_content``: parse special-token text (``<|im_start|>``) inside chat
    message content as control tokens; by default it is plain text, so a message cannot forge
    the template's turns. For clients trusted to write the model's control tokens.
    """

    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    ab_split: float | None = None
    ab_seed: int | None = None
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN
    max_tokens_limit: int | None = None
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allow_special_tokens_in_content: bool = False
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(
            bool(self.served_model_names) and all(self.served_model_names),
            "served model names must be non-empty strings",
        )
        check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        check(
            self.ab_split is None or 0.0 <= self.ab_split <= 1.0,
            f"ab_split must be a probability in [0, 1], got {self.ab_split}",
        )
        check(
            self.max_queue_len is None or self.max_queue_len >= 0,
            f"max_queue_len must be >= 0, got {self.max_queue_len}",
        )
        check(
            self.max_tokens_limit is None or self.max_tokens_limit >= 1,
            f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}",
        )
        check(
            self.request_timeout_s is None or self.request_timeout_s > 0,
            f"request_timeout must be > 0 seconds, got {self.request_timeout_s}",
        )
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            check(value > 0, f"{name.removesuffix('_s')} must be > 0 seconds, got {value}")
        check(self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}")

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.served_model_names[0]
