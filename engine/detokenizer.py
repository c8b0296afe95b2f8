"""Streaming text out of generated token ids: incremental detokenizer and stop-string matcher.

Both run once per generated token outside the model step, so each keeps its per-token work
bounded: the detokenizer decodes a window of a few recent ids, the matcher scans only the text it
is holding back plus the new delta.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Ids kept in front of the newest ones when the decode window slides. Decoding an id in context is
# what gives it the right leading space (SentencePiece drops the space of the first piece of a
# decode; a special id is skipped and gives no context, hence more than one).
_CONTEXT_IDS = 4
# The window slides once it holds more ids than this, so the decoded run stays short.
_MAX_WINDOW_IDS = 16
# A UTF-8 character is at most 4 bytes, so at most 3 ids in a row can add bytes without finishing
# a character; this many ids without any new finished text mean the bytes are truly invalid.
_MAX_PENDING_IDS = 8
# Emitted text kept to check a slid window against (a window decodes to far less than this).
_RECENT_CHARS = 4096


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into finished text deltas.

    Decoding works on a window of the most recent ids, ``_ids``; ``_emitted_chars`` counts the
    characters of ``decode(_ids)`` already accounted for (context text and everything emitted).
    Each ``add`` decodes the window once and emits ``text[_emitted_chars:]`` up to any trailing
    U+FFFD: a byte-level token can end in the middle of a multi-byte character, which decodes to
    U+FFFD until the ids carrying its remaining bytes arrive. Appending ids does not change the
    characters before the unfinished tail, so the slice is exactly the new text.

    When the window holds more than ``_MAX_WINDOW_IDS`` ids it restarts ``_CONTEXT_IDS`` or so ids
    back (one extra decode per slide, about every dozen tokens), so the per-token cost stays
    constant. It restarts at an id boundary where the text had no unfinished character when there
    is one; a byte-level run whose tokens all straddle characters (e.g. ``æ|Ĺ|¥æ|Ĺ|¥æ`` for CJK)
    has none, and is restarted mid-character: the orphan bytes decode to leading U+FFFD that stay
    the same as ids are appended, so they are simply counted as context. A slide is only taken
    when the new window's text provably lines up with what was emitted and what is held back.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters as context; the outputs are appended after it.
        self._ids, context_text = self._prompt_context(list(prompt_ids[-2 * _CONTEXT_IDS :]))
        # Window positions after which the text had no unfinished character: clean restarts.
        self._boundaries: list[int] = [len(self._ids)]
        # A prompt that itself ends mid-character is left open, so the output that completes the
        # character emits it rather than losing it.
        self._emitted_chars = len(context_text.rstrip(REPLACEMENT_CHAR))
        self._pending_ids = 0
        self._pieces: list[str] = []
        self._recent = ""

    @property
    def text(self) -> str:
        """All text emitted so far (by ``add`` and ``flush``)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it finishes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        text = self._decode_window()
        finished = len(text.rstrip(REPLACEMENT_CHAR))
        # A byte-fallback decoder turns a whole run of byte pieces into U+FFFD while any of its
        # characters is unfinished, so ``finished`` can drop below what was already emitted;
        # those characters come back once the run is complete.
        finished_dropped = finished < self._emitted_chars
        if finished == len(text):
            self._pending_ids = 0
            self._boundaries.append(len(self._ids))
        else:
            finished = max(finished, self._emitted_chars)
            self._pending_ids = 0 if finished > self._emitted_chars else self._pending_ids + 1
            if self._pending_ids > _MAX_PENDING_IDS:
                # Invalid bytes that no later id can complete: let them out as U+FFFD and restart
                # the window after them, so their decoding can no longer change.
                delta = text[self._emitted_chars :]
                self._restart(len(self._ids), 0)
                self._pending_ids = 0
                return self._emit(delta, 0)
        delta = self._emit(text[self._emitted_chars : finished], finished)
        if len(self._ids) > _MAX_WINDOW_IDS and not finished_dropped:
            self._slide_window(held=text[finished:])
        return delta

    def flush(self) -> str:
        """Release text held back at the end of the sequence (U+FFFD for bytes left unfinished)."""
        text = self._decode_window()
        delta = text[self._emitted_chars :]
        self._restart(len(self._ids), 0)
        self._pending_ids = 0
        return self._emit(delta, 0)

    def _prompt_context(self, prompt_ids: list[int]) -> tuple[list[int], str]:
        """The last few prompt ids, starting on a character boundary, and their text.

        A window that starts inside a multi-byte character decodes to a leading U+FFFD, and a
        byte-fallback decoder turns the whole run of byte pieces it belongs to into U+FFFD, output
        bytes included; so look a few ids further back (then forward) for a clean start.
        """
        last = len(prompt_ids)
        starts = [*range(last - _CONTEXT_IDS, last - 2 * _CONTEXT_IDS, -1), *range(last - 3, last)]
        fallback = None
        for start in starts:
            if start < 0:
                continue
            ids = prompt_ids[start:]
            text = self._tokenizer.decode_window(ids, self._skip_special_tokens)
            if not text.startswith(REPLACEMENT_CHAR):
                return ids, text
            fallback = fallback or (ids, text)
        if fallback is None:  # an empty prompt
            return prompt_ids, self._tokenizer.decode_window(prompt_ids, self._skip_special_tokens)
        return fallback

    def _decode_window(self) -> str:
        return self._tokenizer.decode_window(self._ids, self._skip_special_tokens)

    def _emit(self, delta: str, emitted_chars: int) -> str:
        self._emitted_chars = emitted_chars
        if delta:
            self._pieces.append(delta)
            self._recent = (self._recent + delta)[-_RECENT_CHARS:]
        return delta

    def _slide_window(self, held: str) -> None:
        """Restart the window near its end; ``held`` is the current window's unemitted tail."""
        end = len(self._ids)
        # The latest clean boundary with enough context, unless it would keep the window long.
        start = end - _CONTEXT_IDS
        for boundary in reversed(self._boundaries):
            if boundary <= end - _CONTEXT_IDS:
                if boundary >= end - 2 * _CONTEXT_IDS:
                    start = boundary
                break
        text = self._tokenizer.decode_window(self._ids[start:], self._skip_special_tokens)
        if not text.endswith(held):
            return  # the unfinished tail decodes differently here; try again next id
        emitted = text[: len(text) - len(held)]
        core = emitted.lstrip(REPLACEMENT_CHAR)
        # Orphan bytes at the start must be followed by a real character: that proves the run
        # of bytes they belong to is closed (a byte-fallback decoder would otherwise keep the
        # whole run U+FFFD for good).
        if len(core) < len(emitted) and not core:
            return
        # The new window (all output ids: the prompt's few context ids are gone by the first
        # slide) must decode, past its orphan bytes, to the end of the emitted text.
        if not self._recent.endswith(core):
            return
        self._restart(start, len(emitted))

    def _restart(self, start: int, emitted_chars: int) -> None:
        """Make ``_ids[start:]`` the window, ``emitted_chars`` of its text accounted for."""
        # Ids before the window are never decoded again; dropping them keeps memory bounded.
        del self._ids[:start]
        self._boundaries = [b - start for b in self._boundaries if b >= start]
        self._emitted_chars = emitted_chars
        if not self._boundaries or self._boundaries[0] != 0:
            self._boundaries.insert(0, 0)


class StopStringMatcher:
    """Cuts streamed text right before the first occurrence of any stop string.

    ``feed`` returns the text that is safe to send now. While the end of the text seen so far could
    be the start of a stop string, that tail is held back, so a client never receives part of a
    stop string; a stop that spans several deltas is still found, because the held-back tail is
    searched together with the next delta. Nothing before the held tail can start a stop string
    (it would have been held), so matches in ``held + delta`` are all the matches there are.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        # An empty stop string would match everywhere; ignore it rather than stop at once.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self.stopped = False
        self.matched_stop: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take a text delta; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        # Generation stops at the first stop string to be completed, as if the text arrived one
        # character at a time: the match ending earliest (then the longest) wins, whatever the
        # deltas' sizes.
        first: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                candidate = (at + len(stop), at, stop)
                first = candidate if first is None else min(first, candidate)
        if first is not None:
            _, at, stop = first
            self.stopped, self.matched_stop, self._held = True, stop, ""
            return text[:at], True
        keep = self._partial_stop_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release the held-back tail at the end of a sequence that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
