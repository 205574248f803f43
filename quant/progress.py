"""Progress of a long phase on stderr: a bar redrawn in place on a terminal, otherwise a plain
line every tenth of the way (so logs of a batch job stay short).

    converting [##########..........]  52%  141/272 tensors  280/540 MB  95 MB/s  ETA 0:03
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

Listener = Callable[[str, int, int], None]  # (phase, done, total), called on every update

_BAR = 20


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") or n >= 100 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _clock(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "bytes",  # "bytes", or a noun for counted things ("tokens")
        items: int = 0,  # when > 0, also show "i/items <item_noun>"
        item_noun: str = "tensors",
        stream: TextIO | None = None,
        enabled: bool = True,
        listener: Listener | None = None,
    ) -> None:
        self.label = label
        self.total = max(int(total), 1)
        self.unit = unit
        self.items = items
        self.item_noun = item_noun
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.listener = listener
        self.done = 0
        self.items_done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    def advance(self, amount: int = 0, items: int = 0) -> None:
        self.update(self.done + amount, self.items_done + items)

    def update(self, done: int, items_done: int | None = None) -> None:
        self.done = min(int(done), self.total)
        if items_done is not None:
            self.items_done = items_done
        if self.listener is not None:
            self.listener(self.label, self.done, self.total)
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 0.2 or self.done >= self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()
        else:
            decile = self.done * 10 // self.total
            if decile > self._last_decile:
                self._last_decile = decile
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def line(self) -> str:
        frac = self.done / self.total
        elapsed = time.monotonic() - self._start
        filled = int(frac * _BAR)
        parts = [f"{self.label} [{'#' * filled}{'.' * (_BAR - filled)}] {frac * 100:3.0f}%"]
        if self.items:
            parts.append(f"{self.items_done}/{self.items} {self.item_noun}")
        if self.unit == "bytes":
            parts.append(f"{_size(self.done)}/{_size(self.total)}")
            if elapsed > 0.5:
                parts.append(f"{_size(self.done / elapsed)}/s")
        else:
            parts.append(f"{self.done:,}/{self.total:,} {self.unit}")
        if 0 < frac < 1 and elapsed > 1:
            parts.append(f"ETA {_clock(elapsed * (1 - frac) / frac)}")
        elif frac >= 1:
            parts.append(f"in {_clock(elapsed)}")
        return "  ".join(parts)

    def close(self) -> None:
        """End the phase: the bar's line is finished (shown complete only if it completed)."""
        if self.enabled and self._tty:
            self.stream.write("\r" + self.line() + "\x1b[K\n")
            self.stream.flush()
