"""Incremental detokenizer (UTF-8 hold-back, context, window size) and stop-string matching."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers_tokenizer import (
    FAMILY,
    IM_END,
    STREAM_TEXTS,
    build_byte_fallback_tokenizer,
    build_byte_level_tokenizer,
    byte_token_ids,
    save_tokenizer_dir,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from specdec.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from specdec.engine.tokenizer import Tokenizer

FFFD = "\ufffd"
# The default pair shares one tokenizer; the target is the one named in the brief, the draft is
# checked too when present.
_MODELS_HOME = Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec")) / "models"
REAL_MODEL_DIRS = [
    _MODELS_HOME / "qwen2.5-coder-1.5b-instruct",
    _MODELS_HOME / "qwen2.5-coder-0.5b-instruct",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(
        save_tokenizer_dir(build_byte_level_tokenizer(), tmp_path_factory.mktemp("bpe"))
    )


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    return Tokenizer(build_byte_fallback_tokenizer())


def stream(
    tok: Tokenizer, prompt_ids: Sequence[int], ids: Sequence[int], **kwargs: bool
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def splits_characters(tok: Tokenizer, ids: Sequence[int]) -> bool:
    """Whether some id of ``ids`` decodes alone to an unfinished UTF-8 character."""
    return any(FFFD in tok.decode_window([i]) for i in ids)


# ------------------------------------------------------------------------- byte-level BPE


@pytest.mark.parametrize("name", sorted(STREAM_TEXTS))
def test_streamed_deltas_concatenate_to_full_decode(tok: Tokenizer, name: str) -> None:
    text = STREAM_TEXTS[name]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text)
    deltas, tail = stream(tok, prompt, ids)
    assert "".join(deltas) == text == tok.decode(ids)
    assert tail == ""
    assert not any(FFFD in d for d in deltas)


def test_texts_really_split_multibyte_characters(tok: Tokenizer) -> None:
    # Guards the test above: with a richer vocabulary it would stop exercising the hold-back.
    for name in ("cjk", "emoji", "mixed"):
        assert splits_characters(tok, tok.encode(STREAM_TEXTS[name])), name


def test_unfinished_character_is_held_back_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("Go "))
    rocket = byte_token_ids(tok.hf_tokenizer, "🚀".encode())  # 4 single-byte tokens
    assert [detok.add(i) for i in rocket] == ["", "", "", "🚀"]
    assert detok.add(tok.encode("!")[0]) == "!"
    assert detok.text == "🚀!"


def test_finished_text_before_an_unfinished_character_is_not_delayed(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    for i in tok.encode("ab"):
        detok.add(i)
    first, *rest = byte_token_ids(tok.hf_tokenizer, "中".encode())
    assert detok.add(first) == ""
    assert [detok.add(i) for i in rest] == ["", "中"]
    assert detok.text == "ab中"


def test_family_emoji_streams_whole(tok: Tokenizer) -> None:
    data = FAMILY.encode()
    ids = byte_token_ids(tok.hf_tokenizer, data)  # 25 bytes, one token each
    deltas, tail = stream(tok, tok.encode("x"), ids)
    assert "".join(deltas) == FAMILY and tail == ""
    assert [d for d in deltas if d] == ["👨", "\u200d", "👩", "\u200d", "👧", "\u200d", "👦"]


def test_flush_releases_truly_unfinished_bytes(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    assert detok.add(tok.encode("ok")[0]) == "o"
    ids = tok.encode("k") + byte_token_ids(tok.hf_tokenizer, "🚀".encode()[:2])
    assert [detok.add(i) for i in ids] == ["k", "", ""]
    assert detok.flush() == FFFD
    assert detok.text == "ok" + FFFD


def test_invalid_bytes_are_emitted_once_valid_text_follows(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok.hf_tokenizer, b"\x80") + tok.encode("a")
    deltas, tail = stream(tok, [], ids)
    assert deltas == ["", FFFD + "a"] and tail == ""


def test_long_run_of_invalid_bytes_is_not_held_forever(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok.hf_tokenizer, b"\xff" * 20) + tok.encode("done")
    deltas, tail = stream(tok, [], ids)
    # Released in bounded chunks during the run, not all at the end.
    assert "".join(deltas[:20]).count(FFFD) >= 10
    assert "".join(deltas) + tail == tok.decode(ids) == FFFD * 20 + "done"


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    im_end = tok.hf_tokenizer.convert_tokens_to_ids(IM_END)
    ids = [*tok.encode("Hi"), im_end, *tok.encode(" there")]
    deltas, _ = stream(tok, [], ids)
    assert "".join(deltas) == "Hi there"
    assert deltas[len(tok.encode("Hi"))] == ""
    kept, _ = stream(tok, [], ids, skip_special_tokens=False)
    assert "".join(kept) == "Hi" + IM_END + " there"


def test_prompt_text_is_never_emitted(tok: Tokenizer) -> None:
    prompt = tok.encode("你好 👋🏽 prompt")
    deltas, tail = stream(tok, prompt, tok.encode(" answer"))
    assert "".join(deltas) + tail == " answer"


class CountingTokenizer(Tokenizer):
    """Records the length of every window the detokenizer decodes."""

    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner.hf_tokenizer)
        self.window_lengths: list[int] = []

    def decode_window(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.window_lengths.append(len(ids))
        return super().decode_window(ids, skip_special_tokens)


@pytest.mark.parametrize("tokenizer", ["tok", "sp_tok"])
def test_per_token_cost_is_one_short_decode(request: pytest.FixtureRequest, tokenizer: str) -> None:
    tok: Tokenizer = request.getfixturevalue(tokenizer)
    counting = CountingTokenizer(tok)
    text = " ".join(STREAM_TEXTS.values()) * 8
    prompt, ids = tok.encode("a long prompt " * 50), tok.encode(text)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(counting, prompt)
    counting.window_lengths.clear()
    for i in ids:
        detok.add(i)
    assert detok.text + detok.flush() == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert max(counting.window_lengths) <= 24  # bounded, independent of the output length
    assert len(counting.window_lengths) <= 1.15 * len(ids)  # about one decode per token


def test_long_run_of_tokens_straddling_characters(tok: Tokenizer) -> None:
    # In this vocabulary "日" is split as æ|Ĺ|¥æ|Ĺ|¥æ...: no token boundary is a character
    # boundary, yet the text must come out character by character with a short window.
    text = "日" * 300 + " ok " + "日本" * 100
    ids = tok.encode(text)
    assert "¥æ" in tok.convert_ids_to_tokens(ids)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("x"))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text and detok.flush() == ""
    assert not any(FFFD in d for d in deltas)
    assert sum(1 for d in deltas if d) > 300  # streamed as it goes, not held to the end
    assert max(counting.window_lengths) <= 24
    assert len(counting.window_lengths) <= 1.5 * len(ids)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from([*"ab xyz.\n中文日本語你好é", "👋🏽", "🚀", FAMILY, "🎉"]), max_size=40
    ).map("".join)
)
def test_property_any_text_streams_exactly(tok: Tokenizer, sp_tok: Tokenizer, text: str) -> None:
    for tokenizer in (tok, sp_tok):
        prompt, ids = tokenizer.encode("prompt:"), tokenizer.encode(text)
        deltas, tail = stream(tokenizer, prompt, ids)
        expected = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
        assert "".join(deltas) + tail == expected
        assert expected.lstrip(" ") == text.lstrip(" ")  # the sentencepiece one adds a space
        assert tail == "" and not any(FFFD in d for d in deltas)


# ------------------------------------------------------------- SentencePiece byte fallback


def test_sentencepiece_first_token_keeps_its_space_from_context(sp_tok: Tokenizer) -> None:
    # The tokenizer prefixes "▁" to what it encodes, so "world" becomes the piece "▁world", the
    # token a model generates after "Hello".
    prompt, output = sp_tok.encode("Hello"), sp_tok.encode("world")
    assert sp_tok.convert_ids_to_tokens(output)[0] == "▁world"
    # Decoded alone the leading space is stripped; after the prompt it must be kept.
    assert sp_tok.decode(output) == "world"
    assert sp_tok.decode(prompt + output) == "Hello world"
    deltas, tail = stream(sp_tok, prompt, output)
    assert "".join(deltas) + tail == " world"


@pytest.mark.parametrize("name", sorted(STREAM_TEXTS))
def test_sentencepiece_byte_fallback_streams_exactly(sp_tok: Tokenizer, name: str) -> None:
    prompt = sp_tok.encode("Prompt 中文")  # ends in <0xXX> byte pieces
    ids = sp_tok.encode(STREAM_TEXTS[name])
    assert splits_characters(sp_tok, ids) == (name != "english")
    # What the output adds to the text of the whole sequence.
    expected = sp_tok.decode(prompt + ids)[len(sp_tok.decode(prompt)) :]
    assert expected == " " + STREAM_TEXTS[name]
    deltas, tail = stream(sp_tok, prompt, ids)
    assert "".join(deltas) + tail == expected
    assert tail == "" and not any(FFFD in d for d in deltas)


def test_sentencepiece_prompt_tail_starting_mid_character(sp_tok: Tokenizer) -> None:
    # Four ids before the end of this prompt fall inside a run of byte pieces; the output's byte
    # pieces continue that run, so a context starting mid-character would turn it all into U+FFFD.
    prompt = sp_tok.encode("x 中文")
    tokens = sp_tok.convert_ids_to_tokens(prompt[-4:])
    assert tokens[0].startswith("<0x") and int(tokens[0][3:5], 16) & 0xC0 == 0x80
    # Drop the "▁" the tokenizer puts first, so the output's bytes continue the prompt's run.
    output = sp_tok.encode("本語 ok")[1:]
    assert sp_tok.convert_ids_to_tokens(output)[0].startswith("<0x")
    assert sp_tok.decode(prompt + output).endswith("中文本語 ok")
    deltas, tail = stream(sp_tok, prompt, output)
    assert "".join(deltas) + tail == "本語 ok"


# ------------------------------------------------------------------------- stop strings


def feed_all(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[list[str], bool]:
    out: list[str] = []
    stopped = False
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            break
    return out, stopped


def test_no_stops_passes_everything_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == ""


def test_stop_inside_one_delta() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello STOP world") == ("hello ", True)
    assert matcher.matched_stop == "STOP"
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_spanning_deltas_is_never_partly_emitted() -> None:
    matcher = StopStringMatcher(["</answer>"])
    out, stopped = feed_all(matcher, ["42 <", "/ans", "wer", "> trailing"])
    assert out == ["42 ", "", "", ""]
    assert stopped


def test_earliest_stop_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w", "hello"])
    assert matcher.feed("say hello world") == ("say ", True)
    assert matcher.matched_stop == "hello"
    matcher = StopStringMatcher(["world", "lo w"])
    out, stopped = feed_all(matcher, ["hel", "lo", " world"])
    assert "".join(out) == "hel" and stopped
    assert matcher.matched_stop == "lo w"


@pytest.mark.parametrize("deltas", [["xbaa"], ["xba", "a"], ["x", "b", "a", "a"]])
def test_first_completed_stop_wins_whatever_the_delta_sizes(deltas: list[str]) -> None:
    # "a" is complete one character before "baa" is, so generation would already have stopped.
    matcher = StopStringMatcher(["baa", "a"])
    out, stopped = feed_all(matcher, deltas)
    assert "".join(out) == "xb" and stopped
    assert matcher.matched_stop == "a"


def test_stops_ending_together_cut_before_the_longer() -> None:
    matcher = StopStringMatcher(["c", "abc"])
    assert matcher.feed("xabcd") == ("x", True)
    assert matcher.matched_stop == "abc"


def test_partial_prefix_held_then_released_when_not_a_stop() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("line\n") == ("line", False)
    assert matcher.feed("\nUs") == ("", False)
    assert matcher.feed("ed it") == ("\n\nUsed it", False)
    assert matcher.feed("\n") == ("", False)
    assert matcher.flush() == "\n"
    assert matcher.flush() == ""


def test_overlapping_prefix_is_rechecked() -> None:
    # "aab" ends with "a", the start of "aaa": the held "aa" fails, but its last "a" may still start
    # a stop and must stay held.
    matcher = StopStringMatcher(["aaa"])
    assert matcher.feed("xaa") == ("x", False)
    assert matcher.feed("ba") == ("aab", False)
    assert matcher.feed("aa") == ("", True)


def test_empty_stop_string_is_ignored() -> None:
    matcher = StopStringMatcher(["", "END"])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.feed("xEND") == ("x", True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc中👋", max_size=40),
    stops=st.lists(st.text(alphabet="abc中👋", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_property_matches_whole_text_search(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # Reference: the first stop to be completed when reading the text left to right.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text
    matcher = StopStringMatcher(stops)
    emitted = ""
    stopped = False
    for delta in deltas:
        out, stopped = matcher.feed(delta)
        emitted += out
        # A client never sees anything past the cut, i.e. never part of a stop string.
        assert expected.startswith(emitted)
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    assert stopped == bool(hits)
    assert emitted == expected


# ------------------------------------------------------------------------- real model


@pytest.mark.real_model
@pytest.mark.parametrize("model_dir", REAL_MODEL_DIRS, ids=lambda p: p.name)
def test_real_qwen_tokenizer_streams_cjk_emoji_code(model_dir: Path) -> None:
    if not model_dir.is_dir():
        pytest.skip(f"{model_dir} not in the local cache (fetched by `specdec pull`)")
    tok = Tokenizer.from_dir(model_dir)
    assert 151645 in tok.eos_token_ids  # <|im_end|>: Qwen instruct models end their turn on it
    prompt = tok.apply_chat_template([{"role": "user", "content": "写一个函数 👋🏽"}])
    text = (
        "当然！这是一个函数：\n```python\ndef greet(name: str) -> str:\n"
        '    return f"こんにちは, {name} 👋🏽🚀"\n```\n' + FAMILY + " 完成。𠀀𪚥 🧑🏿‍💻"
    )
    ids = tok.encode(text)
    assert splits_characters(tok, ids)
    assert prompt[-3:] == tok.encode("<|im_start|>assistant\n")
    deltas, tail = stream(tok, prompt, ids)
    assert "".join(deltas) + tail == text == tok.decode(ids)
    assert tail == "" and not any(FFFD in d for d in deltas)
