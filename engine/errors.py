"""Errors the engine raises for bad input, each carrying what the caller needs to answer it.

The API layer maps these onto OpenAI-style error bodies; the CLI prints their message. Every one is
raised *before* any engine state changes, so a rejected request costs nothing.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class for errors that are the caller's to fix (never an engine bug)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(SpecdecError, ValueError):
    """A request parameter is out of range or of the wrong kind."""


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus requested output) does not fit in max_model_len."""


class ModelNotFoundError(SpecdecError, FileNotFoundError):
    """Unknown model name or a path that does not hold a loadable model."""

    status_code = 404
    error_type = "not_found_error"


class CorruptModelFileError(SpecdecError):
    """A model file is truncated, fails its checksum or cannot be parsed."""

    status_code = 500
    error_type = "model_file_error"


class ConfigError(SpecdecError, ValueError):
    """An engine option is invalid or two options contradict each other."""
