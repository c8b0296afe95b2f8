"""Tokenizer wrapper: encode, decode, chat templating and the end-of-sequence ids of one model.

Wraps a Hugging Face tokenizer so the rest of the engine sees one small interface, validates chat
messages before they reach the Jinja template (a template fails with obscure errors on bad input),
and exposes a cheap window decode for the incremental detokenizer.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from specdec.engine.errors import (
    CorruptModelFileError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from transformers import AutoTokenizer, PreTrainedTokenizerBase

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

    # ------------------------------------------------------------------------------ size bound

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """Most characters of input text one token can stand for, or None if not known.

        See ``chars_per_token_bound``; computed once from the tokenizer's own description.
        """
        backend = self._backend
        if backend is None:
            return None
        return chars_per_token_bound(json.loads(backend.to_str()))

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on the token count of any text of ``num_chars`` characters (0 when the
        tokenizer gives no bound): no token stands for more than ``max_chars_per_token``."""
        per_token = self.max_chars_per_token
        return 0 if per_token is None else math.ceil(num_chars / per_token)

    def check_fits(self, text: str, max_tokens: int | None, param: str = "prompt") -> None:
        """Raise PromptTooLongError if ``text`` has at least ``max_tokens`` tokens for sure,
        without tokenizing it (a length check, cheap for any size)."""
        if max_tokens is None:
            return
        least = self.min_num_tokens(len(text))
        if least >= max_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(text)} characters, so at least {least} tokens (no token of "
                f"this tokenizer stands for more than {self.max_chars_per_token} characters), "
                f"but max_model_len is {max_tokens}: shorten the prompt",
                param=param,
            )

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
        return self._render(validate_chat_messages(messages), add_generation_prompt)

    def _render(self, normalized: list[dict[str, Any]], add_generation_prompt: bool) -> str:
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

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        max_prompt_tokens: int | None = None,
    ) -> list[int]:
        """Prompt token ids for chat ``messages``.

        The template writes BOS and control tokens itself, so the rendered text is encoded
        without adding special tokens again. Message text is text: special-token strings inside
        it (``"<|im_end|>"``) are tokenized as the plain characters they are, so a message cannot
        forge a turn of another role, unless ``special_tokens_in_content`` (trusted clients).
        ``max_prompt_tokens``: refuse (PromptTooLongError) a rendered prompt that surely has at
        least this many tokens, before tokenizing it.
        """
        normalized = validate_chat_messages(messages)
        if special_tokens_in_content or not self._holds_special_text(normalized):
            text = self._render(normalized, add_generation_prompt)
            self.check_fits(text, max_prompt_tokens, param="messages")
            return self.encode(text, add_special_tokens=False, param="messages")
        return self._encode_chat_as_text(normalized, add_generation_prompt, max_prompt_tokens)

    # ------------------------------------------------------------------ special tokens in text

    @cached_property
    def _special_tokens(self) -> dict[int, str]:
        """Id -> text of the added tokens flagged special (the control tokens)."""
        decoder = self.hf_tokenizer.added_tokens_decoder
        return {i: t.content for i, t in decoder.items() if t.special}

    @cached_property
    def _special_text(self) -> re.Pattern[str] | None:
        """Matches any special token's text."""
        contents = list(self._special_tokens.values())
        if not contents:
            return None
        return re.compile("|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True)))

    @cached_property
    def _plain_backend(self) -> Any:
        """A copy of the Rust tokenizer that reads special-token text as plain text (a copy:
        the flag is tokenizer state, and the original serves other threads meanwhile)."""
        from tokenizers import Tokenizer as RustTokenizer

        plain = RustTokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def _holds_special_text(self, value: Any) -> bool:
        pattern = self._special_text
        if pattern is None or self._backend is None:
            return False
        if isinstance(value, str):
            return pattern.search(value) is not None
        if isinstance(value, dict):
            return any(self._holds_special_text(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self._holds_special_text(v) for v in value)
        return False

    def _encode_chat_as_text(
        self,
        normalized: list[dict[str, Any]],
        add_generation_prompt: bool,
        max_prompt_tokens: int | None,
    ) -> list[int]:
        """Token ids of the rendered chat where only the template's own special tokens are
        control tokens.

        Every message string holding special-token text is replaced by a unique marker, the
        template renders, and the markers are swapped back, which gives the character spans of
        message text in the prompt (the result must equal a plain rendering, else the template
        rewrites message text and the spans are unknown: refused). The prompt is tokenized as
        usual; special tokens inside a message span are dropped as such, and the text between
        the template's special tokens is tokenized with special-token parsing off. The Rust
        tokenizer splits text at special tokens before anything else, so every other token is
        what a plain tokenization gives.
        """
        originals: list[str] = []
        tag = secrets.token_hex(8)

        def mask(value: Any) -> Any:
            if isinstance(value, str):
                if not self._holds_special_text(value):
                    return value
                originals.append(value)
                return f"\ue000{tag}:{len(originals) - 1}\ue001"
            if isinstance(value, dict):
                return {k: (v if k == "role" else mask(v)) for k, v in value.items()}
            if isinstance(value, list):
                return [mask(v) for v in value]
            return value

        masked = self._render([mask(m) for m in normalized], add_generation_prompt)
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = length = 0
        for match in re.finditer(f"\ue000{tag}:(\\d+)\ue001", masked):
            parts.append(masked[pos : match.start()])
            length += match.start() - pos
            original = originals[int(match.group(1))]
            spans.append((length, length + len(original)))
            parts.append(original)
            length += len(original)
            pos = match.end()
        parts.append(masked[pos:])
        text = "".join(parts)
        if text != self._render(normalized, add_generation_prompt):
            raise InvalidRequestError(
                "a message holds special-token text and the model's chat template rewrites "
                "message text, so it cannot be kept as plain text: remove it (or the server "
                "can allow it with --allow-special-tokens-in-content)",
                param="messages",
            )
        self.check_fits(text, max_prompt_tokens, param="messages")
        check_text(text, "messages")
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        cut = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id not in self._special_tokens:
                continue
            if any(start < span_end and end > span_start for span_start, span_end in spans):
                continue  # special-token text a message wrote: plain text
            ids.extend(self._plain_backend.encode(text[cut:start], add_special_tokens=False).ids)
            ids.append(token_id)
            cut = end
        ids.extend(self._plain_backend.encode(text[cut:], add_special_tokens=False).ids)
        return ids


# Normalizers that never drop a character; composition (NFC, NFKC) may merge up to
# _MAX_COMPOSED characters into one: a composed character's canonical decomposition, which it
# replaces, has at most that many (tests/test_tokenizer.py checks it against unicodedata).
_KEEPING_NORMALIZERS = {"NFC", "NFKC", "NFD", "NFKD", "Prepend", "Lowercase", "Replace"}
_COMPOSING = {"NFC", "NFKC"}
_MAX_COMPOSED = 4
# Pre-tokenizers that split text without dropping any of it (unless behavior is "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation"}


def chars_per_token_bound(spec: dict[str, Any]) -> int | None:
    """Most input characters one token can stand for, from a tokenizer.json ``spec``; None when
    the pipeline can drop or fuse text (then a text's length bounds nothing).

    The bound holds when every character reaches some token: byte-level models (every byte is a
    token of the alphabet) and BPE with byte fallback (a character outside the vocabulary
    becomes its UTF-8 bytes), behind normalizers and pre-tokenizers that never drop text. Then a
    token covers at most as many characters as its vocabulary string is long (a byte-level
    string has one symbol per byte, and a character has at least one byte), an added token its
    content, and normalization shrinks text by at most the factor computed below. So a text of N
    characters has at least ceil(N / bound) tokens: exact arithmetic, not an estimate of typical
    text.
    """
    model = spec.get("model") or {}
    pre_types = _component_types(spec.get("pre_tokenizer"), "pretokenizers")
    norm_types = _component_types(spec.get("normalizer"), "normalizers")
    if pre_types is None or norm_types is None:
        return None
    if not (
        "ByteLevel" in pre_types or (model.get("type") == "BPE" and model.get("byte_fallback"))
    ):
        return None
    if not set(pre_types) <= _KEEPING_PRE_TOKENIZERS or not set(norm_types) <= _KEEPING_NORMALIZERS:
        return None
    shrink = 1.0
    for component in _components(spec.get("normalizer"), "normalizers"):
        if component["type"] in _COMPOSING:
            shrink *= _MAX_COMPOSED
        elif component["type"] == "Replace":
            pattern = (component.get("pattern") or {}).get("String")
            content = component.get("content") or ""
            if pattern is None or not content:
                return None  # a regex or a deletion may remove any amount of text
            shrink *= max(1.0, len(pattern) / len(content))
    for component in _components(spec.get("pre_tokenizer"), "pretokenizers"):
        if component.get("behavior") in ("Removed", "removed"):
            return None
    vocab = model.get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)
    longest = max((len(p) for p in pieces), default=1)
    for added in spec.get("added_tokens") or ():
        longest = max(longest, len(added.get("content", "")))
    return math.ceil(longest * shrink)


def _components(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [c for sub in component.get(key, ()) for c in _components(sub, key)]
    return [component]


def _component_types(component: dict[str, Any] | None, key: str) -> list[str] | None:
    try:
        return [c["type"] for c in _components(component, key)]
    except (KeyError, TypeError):
        return None


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
