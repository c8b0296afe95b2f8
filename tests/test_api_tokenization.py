"""Prompt tokenization of the API: too-long prompts are refused by their length without
tokenizer work, and large prompts cannot hold up small ones (separate bounded pools)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers_tokenizer import build_byte_level_tokenizer
from specdec.api.tokenization import PromptTokenizer
from specdec.engine.errors import PromptTooLongError
from specdec.engine.tokenizer import Tokenizer

MAX_MODEL_LEN = 64


class CountingTokenizer(Tokenizer):
    """Counts encodes; an encode of a text longer than ``block_above`` waits for ``release``."""

    def __init__(self, block_above: int | None = None) -> None:
        super().__init__(build_byte_level_tokenizer())
        self.encoded: list[int] = []
        self.block_above = block_above
        self.release = threading.Event()
        self.blocked = threading.Semaphore(0)

    def encode(self, text, add_special_tokens=False, param="prompt"):
        self.encoded.append(len(text))
        if self.block_above is not None and len(text) > self.block_above:
            self.blocked.release()
            assert self.release.wait(30)
        return super().encode(text, add_special_tokens, param)


def test_too_long_prompts_are_refused_without_tokenizing():
    tok = CountingTokenizer()
    prompts = PromptTokenizer(tok, MAX_MODEL_LEN)
    longest = MAX_MODEL_LEN * tok.max_chars_per_token

    async def run():
        with pytest.raises(PromptTooLongError, match="at least 64 tokens") as info:
            await prompts.encode_prompt("a" * longest)
        assert info.value.param == "prompt"
        with pytest.raises(PromptTooLongError) as info:
            await prompts.encode_chat([{"role": "user", "content": "a" * longest}])
        assert info.value.param == "messages"
        assert tok.encoded == []
        # Just under the bound the tokenizer decides (and "a" * n is far fewer tokens).
        ids = await prompts.encode_prompt("a" * (longest - tok.max_chars_per_token))
        assert len(ids) > 0 and tok.encoded == [longest - tok.max_chars_per_token]

    try:
        asyncio.run(run())
    finally:
        prompts.shutdown()


def test_large_prompts_do_not_hold_up_small_ones():
    tok = CountingTokenizer(block_above=100)
    prompts = PromptTokenizer(tok, 10**9, small_chars=100)
    assert prompts.pool_for(100) is prompts.small_pool
    assert prompts.pool_for(101) is prompts.large_pool

    async def run():
        large = [
            asyncio.ensure_future(prompts.encode_prompt("hello " * (50 + i))) for i in range(6)
        ]
        chat = [{"role": "user", "content": "x" * 200}]
        large.append(asyncio.ensure_future(prompts.encode_chat(chat)))
        # The first large prompt is in the tokenizer and stays there until released; the
        # others queue behind it on the one large-prompt thread.
        assert await asyncio.to_thread(tok.blocked.acquire, True, 30)
        for _ in range(3):
            small = await asyncio.wait_for(prompts.encode_prompt("hi there"), 30)
            assert small == tok.encode("hi there")
            small = await asyncio.wait_for(
                prompts.encode_chat([{"role": "user", "content": "hi"}]), 30
            )
        assert not any(f.done() for f in large)
        tok.release.set()
        results = await asyncio.gather(*large)
        assert all(results)

    try:
        asyncio.run(run())
    finally:
        tok.release.set()
        prompts.shutdown()
