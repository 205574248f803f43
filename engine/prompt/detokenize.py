"""Streaming text out of token bytes: whole UTF-8 characters only, stop strings withheld.

A token can end in the middle of a multi-byte UTF-8 character, and a stop string can span
several tokens. `TextStream` feeds token bytes through an incremental UTF-8 decoder and
holds back the tail of the text that could still be the start of a stop string, so the
consumer never sees a stop string, nor a character that is later found to be part of one.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.text = ""  # everything decoded so far, up to (excluding) a matched stop string
        self._emitted = 0  # len of self.text already handed out
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self.text += self._decoder.decode(data)
        return self._release()

    def flush(self) -> str:
        """End of stream: decode what remains and release everything still held back."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
            self._check_stop()
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out

    def _check_stop(self) -> None:
        if not self._stop:
            return
        # Only the region not yet emitted (plus a stop string's length of context) can hold
        # a new match; search from there so long replies stay linear.
        start = max(0, self._emitted - self._max_stop)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self) -> str:
        self._check_stop()
        if self.stopped:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
