"""Tokenizer wrapper: encode, decode, chat templating and the end-of-sequence ids of one model.

Wraps a Hugging Face tokenizer so the rest of the engine sees one small interface, validates chat
messages before they reach the Jinja template (a template fails with obscure errors on bad input),
and exposes a cheap window decode for the incremental detokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import CorruptModelFileError, InvalidRequestError, ModelNotFoundError

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# Any one of these marks a directory as holding a tokenizer (fast, BPE vocab or SentencePiece).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """One model's tokenizer.

    ``eos_token_ids`` holds every id that ends generation: the tokenizer's own eos token plus, when
    loaded from a directory, the ``eos_token_id`` of ``generation_config.json`` (instruct models
    often stop on a chat end token such as ``<|im_end|>`` that the tokenizer's eos is not).
    """

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        ids: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            ids.append(int(hf_tokenizer.eos_token_id))
        ids.extend(int(i) for i in eos_token_ids or ())
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        # The Rust tokenizer behind a fast HF tokenizer decodes without the Python wrapper's
        # argument handling; the detokenizer calls it once per generated token.
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a local model directory (no network access)."""
        model_dir = Path(path).expanduser()
        if not model_dir.is_dir():
            raise ModelNotFoundError(f"model directory {str(model_dir)!r} does not exist")
        if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelNotFoundError(
                f"no tokenizer files in {str(model_dir)!r} (expected one of "
                f"{', '.join(_TOKENIZER_FILES)})"
            )
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:  # the HF loaders raise many unrelated types for a bad file
            raise CorruptModelFileError(
                f"could not load the tokenizer in {str(model_dir)!r}: {exc}"
            ) from exc
        return cls(hf_tokenizer, eos_token_ids=_generation_config_eos_ids(model_dir))

    # ----------------------------------------------------------------------------- encode/decode

    def encode(
        self, text: str, add_special_tokens: bool = False, param: str = "prompt"
    ) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS etc. where the model uses them.

        Text that is not valid Unicode (a lone surrogate, which JSON's ``\\ud800`` escape can
        carry) raises InvalidRequestError naming ``param``.
        """
        check_text(text, param)
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` as the Hugging Face tokenizer decodes it."""
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_window(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode a short run of ids for streaming, without clean-up of tokenization spaces.

        Clean-up rewrites text around later tokens (" ." -> "."), which a stream that has already
        sent the earlier text cannot take back, so streaming never applies it.
        """
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf_tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of ``ids`` (byte-level or SentencePiece pieces, not plain text)."""
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(ids)))

    # ---------------------------------------------------------------------------------- chat

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    def render_chat(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """Render validated chat ``messages`` through the model's chat template to prompt text."""
        normalized = validate_chat_messages(messages)
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template, so chat messages cannot be turned into a "
                "prompt; use /v1/completions with a plain text prompt instead",
                param="messages",
            )
        try:
            rendered = self.hf_tokenizer.apply_chat_template(
                normalized, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # templates raise their own errors ("roles must alternate")
            raise InvalidRequestError(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc
        return str(rendered)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for chat ``messages``.

        The template writes BOS and control tokens itself, so the rendered text is encoded
        without adding special tokens again.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False, param="messages")


def unicode_error(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (it holds a lone surrogate), or None if it can.

    Python strings decoded from JSON may hold surrogates U+D800..U+DFFF on their own (the escape
    ``\\ud800`` without its pair); they are not characters, and tokenizers refuse them.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"text must be valid Unicode: it holds a lone surrogate "
            f"U+{ord(text[exc.start]):04X} at index {exc.start}"
        )
    return None


def check_text(text: str, param: str) -> None:
    """Raise InvalidRequestError naming ``param`` if ``text`` is not valid Unicode."""
    problem = unicode_error(text)
    if problem is not None:
        raise InvalidRequestError(problem, param=param)


def validate_chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies with ``content`` normalized to a string.

    Content may be a string, a list of ``{"type": "text", "text": ...}`` parts (joined with a
    newline, so words of separate parts never run together), or None for an assistant message
    (one that only carries tool calls). Other keys (``name``, ``tool_calls``, ...) pass through.
    """

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(why, param="messages")

    if not isinstance(messages, (list, tuple)) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects")
    normalized: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object with 'role' and 'content', got {message!r}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        if "content" not in message:
            raise bad(f"{where} has no 'content'")
        content = _content_text(message["content"], role, where)
        normalized.append({**message, "content": content})
    return normalized


def _content_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise InvalidRequestError(
            f"{where}.content may be null only for assistant messages", param="messages"
        )
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"{where}.content[{j}] must be {{'type': 'text', 'text': <string>}} "
                    f"(only text parts are supported), got {part!r}",
                    param="messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
        param="messages",
    )


def _generation_config_eos_ids(model_dir: Path) -> list[int]:
    """``eos_token_id`` of generation_config.json (an int or a list), or [] without one."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise CorruptModelFileError(f"could not parse {str(path)!r}: {exc}") from exc
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CorruptModelFileError(f"eos_token_id in {str(path)!r} must be ints, got {value!r}")
    return list(values)
