"""Prompt tokenization for the API: size checks first, then two bounded thread pools.

Tokenizing runs in threads (the Rust tokenizer releases the GIL), never on the event loop. A
prompt that cannot fit in ``max_model_len`` is refused by its length before any tokenizer work
(Tokenizer.check_fits: its character count bounds its token count from below). Prompts that
pass still cost time in proportion to their size, so they go to one of two pools by size: small
prompts to a pool of their own, large ones to a single-thread pool. However many large prompts
arrive, they queue behind each other and a small one never waits for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from specdec.engine.tokenizer import Tokenizer

T = TypeVar("T")

# Characters up to which a prompt counts as small: tokenizing this many takes milliseconds.
SMALL_PROMPT_CHARS = 32_768


class PromptTokenizer:
    """Turns completion prompts and chat messages into token ids off the event loop.

    ``max_model_len``: prompts with at least this many tokens are refused (PromptTooLongError).
    ``special_tokens_in_content``: parse special-token text inside chat message content as
    control tokens (see Tokenizer.apply_chat_template); completion prompts always parse them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        special_tokens_in_content: bool = False,
        small_chars: int = SMALL_PROMPT_CHARS,
        small_workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.special_tokens_in_content = special_tokens_in_content
        self.small_chars = small_chars
        self.small_pool = ThreadPoolExecutor(small_workers, thread_name_prefix="tokenize-small")
        self.large_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")

    def pool_for(self, num_chars: int) -> ThreadPoolExecutor:
        return self.small_pool if num_chars <= self.small_chars else self.large_pool

    async def _run(self, num_chars: int, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool_for(num_chars), fn, *args)

    async def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt (special-token text parsed, as the model reads it)."""
        self.tokenizer.check_fits(text, self.max_model_len, param="prompt")
        return await self._run(len(text), self.tokenizer.encode, text)

    async def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of chat messages through the model's template; the rendered text is
        checked against max_model_len before it is tokenized."""
        size = sum(_text_size(m) for m in messages)
        return await self._run(
            size,
            lambda: self.tokenizer.apply_chat_template(
                messages,
                special_tokens_in_content=self.special_tokens_in_content,
                max_prompt_tokens=self.max_model_len,
            ),
        )

    def shutdown(self) -> None:
        self.small_pool.shutdown(wait=False, cancel_futures=True)
        self.large_pool.shutdown(wait=False, cancel_futures=True)


def _text_size(value: Any) -> int:
    """Characters of all strings in a message (what rendering and tokenizing scale with)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0
