"""`ThreadCount`: how many of the app's threads are in the engine or the store right now."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ThreadCount:
    """How many of the app's threads are using the engine or the store. Textual cancels its
    workers before the app unmounts, but a thread cannot be stopped from outside: the app
    waits here before it closes what those threads use."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._changed:
            self._count += 1
        try:
            yield
        finally:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout)
