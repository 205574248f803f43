"""Progress of a long task on stderr: the one progress style of llmlocal, drawn by tqdm.

`models pull`, `quantize` (conversion, llama.cpp's quantizer, evaluation) and sparsity
calibration all show the same line, rendered by `render`:

    converting to Q8_0 [##########..........]  52%  141/272 tensors  280 MiB/540 MiB  95.0 MiB/s  ETA 0:03

On a terminal tqdm redraws it in place (at most five times a second, trimmed to the terminal's
width, its rate smoothed); anywhere else (a pipe, a CI log, `--json` runs) the same text is
written as a plain line every tenth of the way, so logs stay short and carry no control codes.
Sizes are `format_size`'s binary units.

Why tqdm rather than rich (both are installed; Textual brings rich): huggingface_hub reports
its downloads to a ``tqdm_class``, so `hub_progress_class` routes a pull into this same
`Progress`. With rich the download would still need that tqdm-shaped adapter, and the two
import in about the same time here (70-110 ms), so rich would add a second progress library
for nothing. The module lives in `models/` because that is the package every other one may
import, and downloads are its first user.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, TextIO

from tqdm import tqdm

from .sizes import format_size

Listener = Callable[[str, int, int], None]  # (phase, done, total), called on every update

BAR_FORMAT = "{desc} [{bar:20}] {percentage:3.0f}%{stats}"
BAR_CHARS = ".#"  # tqdm's `ascii` charset: empty, full (no partial blocks: plain in any log)


def render(
    label: str,
    done: float,
    total: float,
    elapsed: float,
    *,
    rate: float | None = None,
    unit: str = "bytes",
    items: tuple[int, int, str] | None = None,
    ncols: int | None = None,
) -> str:
    """The progress line: ``rate`` is per second (default: the average so far); ``unit`` is
    "bytes" or a noun for counted things ("tokens"); ``items`` is (done, total, noun)."""
    if rate is None and elapsed > 0.5:
        rate = done / elapsed
    stats = _stats(done, total, elapsed, rate, unit, items)
    return tqdm.format_meter(done, total, elapsed, ncols=ncols, prefix=label, ascii=BAR_CHARS,
                             bar_format=BAR_FORMAT, stats=stats)


def _stats(
    done: float, total: float, elapsed: float, rate: float | None, unit: str, items: tuple[int, int, str] | None
) -> str:
    parts = [""]
    if items is not None and items[1]:
        parts.append(f"{items[0]}/{items[1]} {items[2]}")
    if unit == "bytes":
        parts.append(f"{format_size(done)}/{format_size(total)}" if total else format_size(done))
        if rate:
            parts.append(f"{format_size(rate)}/s")
    else:
        parts.append(f"{int(done):,}/{int(total):,} {unit}")
    if total and done >= total:
        parts.append(f"in {_clock(elapsed)}")
    elif total and rate and elapsed > 1:
        parts.append(f"ETA {_clock((total - done) / rate)}")
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One phase's progress. Callers may set ``total``, ``unit``, ``items`` and ``item_noun``
    once they know them (before the first update); ``listener`` sees every update, and an
    exception it raises (Ctrl-C in tests) propagates to the caller. Thread-safe."""

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
        self._last_decile = -1
        self._bar: _Bar | None = None
        self._lock = threading.RLock()
        self._tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    def advance(self, amount: int = 0, items: int = 0) -> None:
        with self._lock:
            self.update(self.done + amount, self.items_done + items)

    def update(self, done: int, items_done: int | None = None) -> None:
        with self._lock:
            self.done = min(int(done), self.total)
            if items_done is not None:
                self.items_done = items_done
            if self.listener is not None:
                self.listener(self.label, self.done, self.total)
            if not self.enabled:
                return
            if self._tty:
                self._draw()
            else:
                self._log()

    def line(self) -> str:
        """The current line, as a log gets it (average rate)."""
        return render(self.label, self.done, self.total, time.monotonic() - self._start, unit=self.unit,
                      items=self._items())

    def close(self) -> None:
        """End the phase: a drawn bar's line is finished (shown complete only if it completed)."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _items(self) -> tuple[int, int, str] | None:
        return (self.items_done, self.items, self.item_noun) if self.items else None

    def _draw(self) -> None:
        if self._bar is None:
            self._bar = _Bar(self)
        self._bar.total = self.total
        self._bar.update(self.done - self._bar.n)  # tqdm redraws when its interval has passed

    def _log(self) -> None:
        decile = self.done * 10 // self.total
        if decile > self._last_decile:
            self._last_decile = decile
            self.stream.write(self.line() + "\n")
            self.stream.flush()


class _Bar(tqdm):
    """tqdm drawing a `Progress` on a terminal, its text from `render`."""

    monitor_interval = 0  # no monitor thread: `Progress` updates often enough

    def __init__(self, owner: Progress) -> None:
        self.owner = owner  # before tqdm's __init__, which draws the first frame
        # ncols/nrows given so tqdm does not probe the terminal: a pty without a size reports
        # -1 rows, which stops tqdm drawing at all. The width is measured at each draw instead.
        super().__init__(total=owner.total, desc=owner.label, file=owner.stream, leave=True, mininterval=0.2,
                         ncols=0, nrows=20, ascii=BAR_CHARS, bar_format=BAR_FORMAT)

    def __str__(self) -> str:
        d = self.format_dict
        return render(self.owner.label, d["n"], d["total"], d["elapsed"], rate=d["rate"], unit=self.owner.unit,
                      items=self.owner._items(), ncols=_width(self.owner.stream))


def _width(stream: TextIO) -> int | None:
    """The terminal's width in columns, None when it does not say (the line is not trimmed)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return None
    return columns if columns > 0 else None


def hub_progress_class(progress: Progress) -> type:
    """A ``tqdm_class`` for huggingface_hub's ``snapshot_download`` that feeds ``progress``.

    huggingface_hub makes several bars from it: one counting files, and byte bars. Only the
    bytes written to the cache (byte bars whose format shows a total) reach ``progress``; the
    network transfer bar (bytes without a total) counts the same download twice, and the files
    bar moves only after a file's bytes are all in, so it would lag the line's percentage.
    """

    class HubBar(_HubBar):
        target = progress
        byte_bars: list[_HubBar] = []

    return HubBar


_HUB_LOCK = threading.RLock()


class _HubBar:
    """The part of tqdm's interface huggingface_hub uses, forwarding to a `Progress`."""

    target: Progress
    byte_bars: list[_HubBar]  # of this download: their totals add up

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        shows_total = "total_fmt" in (kwargs.get("bar_format") or "{total_fmt}")
        self._counts = kwargs.get("unit") == "B" and shows_total
        if self._counts:
            self.byte_bars.append(self)
        self.n = 0
        self._total = 0
        self.total = kwargs.get("total") or 0
        if kwargs.get("initial"):
            self.update(kwargs["initial"])

    @property
    def total(self) -> int:
        return self._total

    @total.setter
    def total(self, value: int | None) -> None:
        self._total = int(value or 0)
        if self._counts:
            self.target.total = max(sum(b._total for b in self.byte_bars), 1)

    def update(self, n: int | float | None = 1) -> None:
        n = int(n or 0)
        self.n += n
        if self._counts:
            self.target.advance(n)

    def update_transfer(self, n: int | float | None = 1) -> None:
        pass

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self._total, "rate": None}

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    # tqdm's class-level lock, which thread pools hand to their workers (nothing to guard here:
    # `Progress` takes its own lock).
    @classmethod
    def get_lock(cls) -> Any:
        return _HUB_LOCK

    @classmethod
    def set_lock(cls, lock: Any) -> None:
        pass

    def __enter__(self) -> _HubBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
