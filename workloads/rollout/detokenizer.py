"""A completion's text as its tokens arrive one by one, with OpenAI's stop strings.

Tokens are decoded in a sliding window (the last released text's tokens, plus the new ones), so each token costs
a short decode however long the completion grows, and text is released only once it no longer ends in an
incomplete UTF-8 sequence (a byte-level token can hold half a character). When stop strings are set, the last
`longest stop - 1` characters are held back until the next token shows they do not begin a stop string, so a
stream never shows text that the final answer cuts off.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..rl.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what a decoder yields for bytes that do not yet form a character
MAX_UTF8_BYTES = 4


class CompletionText:
    """`incremental=False` (no stop strings, nobody reading along): tokens are only kept, and decoded once by
    `finish` (the RL client's case: the cheapest)."""

    def __init__(self, tokenizer: Tokenizer, stops: Iterable[str] = (), hidden: Iterable[int] = (), *,
                 incremental: bool = True) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.incremental = incremental or bool(self.stops)
        self.hidden = frozenset(hidden)  # stop/end-of-sequence token ids: part of token_ids, never of the text
        self.text = ""  # decoded so far (complete characters), before any stop string
        self.tokens = 0  # tokens fed, hidden ones included
        self.stopped_by: str | None = None  # the stop string that ended the text
        self.kept_tokens: int | None = None  # when stopped: the tokens that made the text up to the stop string
        self._window: list[int] = []
        self._window_start = 0  # how many of the window's tokens were already released as text
        self._released = 0  # characters of `text` handed out by `take`

    def add(self, token: int) -> None:
        """Feed the next sampled token (ignored after a stop string ended the text)."""
        if self.stopped_by is not None:
            return
        self.tokens += 1
        if token in self.hidden:
            return
        self._window.append(token)
        if not self.incremental:
            return
        before = self.tokenizer.decode(self._window[:self._window_start])
        after = self.tokenizer.decode(self._window)
        # A UTF-8 character spans at most 4 byte tokens: past that, U+FFFD is a byte that never decodes, shown
        # as it is rather than held (which would also make each decode longer than the last).
        held = len(self._window) - self._window_start
        if (len(after) <= len(before) or after.endswith(INCOMPLETE)) and held < MAX_UTF8_BYTES:
            return
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stops), default=0) + 1)
        self.text += after[len(before):]
        self._window, self._window_start = self._window[self._window_start:], len(self._window) - self._window_start
        self._find_stop(searched_from)

    def finish(self) -> None:
        """The row ended: release what was held as possibly incomplete (a final undecodable byte stays visible as
        U+FFFD, so a broken completion is never mistaken for a clean one)."""
        if self.stopped_by is None and self._window:
            rest = self.tokenizer.decode(self._window)[len(self.tokenizer.decode(self._window[:self._window_start])):]
            searched_from = max(0, len(self.text) - max((len(s) for s in self.stops), default=0) + 1)
            self.text += rest
            self._window = []
            self._find_stop(searched_from)

    def take(self, final: bool = False) -> str:
        """The text not handed out yet; unless `final`, minus a tail that may still become a stop string."""
        end = len(self.text)
        if not final and self.stopped_by is None and self.stops:
            end = max(self._released, end - max(len(s) for s in self.stops) + 1)
        out, self._released = self.text[self._released:end], max(self._released, end)
        return out

    def _find_stop(self, start: int) -> None:
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, stop = min(hits)
            self.text, self.stopped_by, self.kept_tokens = self.text[:at], stop, self.tokens
