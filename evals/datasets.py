"""Prompt sets: the seven built-in categories in evals/data/ and user JSONL files.

A prompt file holds one JSON object per line, either ``{"messages": [{"role": ..., "content":
...}, ...]}`` (chat) or ``{"prompt": "..."}`` (raw text), with an optional ``"id"`` and
``"category"``. Blank lines are skipped; anything else that is not such an object is an error that
names the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.engine.errors import SpecdecError

DATA_DIR = Path(__file__).resolve().parent / "data"

# The built-in categories, one file each (evals/data/<name>.jsonl), in report order.
CATEGORIES: tuple[str, ...] = (
    "code_generation",
    "code_editing",
    "multi_turn_chat",
    "summarization",
    "math",
    "translation",
    "context_qa",
)

ROLES = ("system", "user", "assistant")


class DatasetError(SpecdecError):
    """A prompt file or category selection the caller has to fix."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat ``messages`` or a raw ``text`` (exactly one of them is set)."""

    id: str
    category: str
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs
    text: str | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        """OpenAI-style messages; a raw prompt becomes one user message."""
        if self.messages is None:
            return [{"role": "user", "content": self.text or ""}]
        return [{"role": r, "content": c} for r, c in self.messages]

    def plain_text(self) -> str:
        """The prompt as one string (for /v1/completions and tokenizers without a template)."""
        if self.text is not None:
            return self.text
        return "\n\n".join(content for _, content in self.messages or ())


def parse_categories(text: str | None) -> list[str]:
    """``"math,code_editing"`` -> validated list; None or "all" -> every built-in category."""
    if text is None or text.strip() in ("", "all"):
        return list(CATEGORIES)
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in CATEGORIES]
    if unknown:
        raise DatasetError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}"
            f"; known: {', '.join(CATEGORIES)}",
            param="categories",
        )
    return list(dict.fromkeys(names))


def load_categories(categories: Sequence[str], limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts (all when None) of each built-in category, in order."""
    prompts: list[Prompt] = []
    for name in parse_categories(",".join(categories)):
        prompts.extend(load_prompt_file(DATA_DIR / f"{name}.jsonl", category=name))
    return limit_per_category(prompts, limit)


def limit_per_category(prompts: Sequence[Prompt], limit: int | None) -> list[Prompt]:
    """Keep the first ``limit`` prompts of each category (all when None), in file order."""
    if limit is None:
        return list(prompts)
    if limit < 1:
        raise DatasetError(f"--limit must be >= 1, got {limit}", param="limit")
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p.category] = seen.get(p.category, 0) + 1
        if seen[p.category] <= limit:
            kept.append(p)
    return kept


def load_prompt_file(path: str | Path, category: str | None = None) -> list[Prompt]:
    """Read a JSONL prompt file; raise DatasetError naming the line of the first bad record."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"prompt file {str(path)!r} does not exist", param="dataset") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(
            f"cannot read prompt file {str(path)!r}: {exc}", param="dataset"
        ) from None
    default_category = category or path.stem
    prompts: list[Prompt] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        prompts.append(_parse_record(line, f"{path}:{lineno}", default_category, len(prompts)))
    if not prompts:
        raise DatasetError(f"prompt file {str(path)!r} holds no prompts (it is empty)")
    return prompts


def _parse_record(line: str, where: str, category: str, index: int) -> Prompt:
    def bad(why: str) -> DatasetError:
        return DatasetError(f"{where}: {why}", param="dataset")

    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise bad(f"expected a JSON object, got {type(record).__name__}")
    prompt_id = str(record.get("id", f"{category}-{index + 1:02d}"))
    category = str(record.get("category", category))
    has_text, has_messages = "prompt" in record, "messages" in record
    if has_text == has_messages:
        raise bad('each record needs exactly one of "prompt" (a string) or "messages" (a list)')
    if has_text:
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise bad('"prompt" must be a non-empty string')
        return Prompt(prompt_id, category, text=text)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad('"messages" must be a non-empty list')
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise bad(f'messages[{i}] must be an object with a string "content"')
        if m.get("role") not in ROLES:
            raise bad(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}"
            )
        pairs.append((m["role"], m["content"]))
    return Prompt(prompt_id, category, messages=tuple(pairs))


def prompt_token_ids(prompt: Prompt, tokenizer, vocab_size: int) -> list[int]:
    """Token ids the engine is given for ``prompt``.

    Chat prompts go through the model's chat template when it has one; without one the contents
    are joined as plain text. A model without any tokenizer (test models built from bare weights)
    gets the UTF-8 bytes folded into its vocabulary, which keeps the eval runnable on any pair.
    """
    if tokenizer is None:
        return [b % vocab_size for b in prompt.plain_text().encode("utf-8")]
    if prompt.messages is not None and tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(prompt.chat_messages())
    return tokenizer.encode(prompt.plain_text())
