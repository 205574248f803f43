"""The connections `llmlocal serve` holds open, at most a fixed number: each has a thread.

A connection is *idle* while the server waits for its next request (the request line, the
headers, the body) and *busy* while one request is answered. When a new connection would
pass the limit, the connection idle the longest is hung up to make room; only when every
connection is busy is the new one refused (the server answers it 503). So sockets held open
without a whole request, a slow-loris, cannot lock real clients out, and the threads stay at
most the limit (plus those of hung-up connections, which end at once). The idle timeout
closes what the limit leaves idle.
"""

from __future__ import annotations

import socket
import threading


class Connections:
    """The open connections, idle or busy, at most ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the connection limit must be at least 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._idle: dict[socket.socket, None] = {}  # an ordered set: the longest idle first
        self._busy: set[socket.socket] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle) + len(self._busy)

    def admit(self, sock: socket.socket) -> bool:
        """Count ``sock`` in, idle, hanging up the longest-idle connection if there is no room;
        False when every connection is busy (``sock`` is then not counted)."""
        with self._lock:
            if len(self._idle) + len(self._busy) >= self.limit:
                if not self._idle:
                    return False
                oldest = next(iter(self._idle))
                del self._idle[oldest]
                _hang_up(oldest)
            self._idle[sock] = None
            return True

    def busy(self, sock: socket.socket) -> None:
        """``sock`` has a whole request to answer: it is no longer the one to hang up."""
        with self._lock:
            if sock in self._idle:  # else it was hung up already: it stays out
                del self._idle[sock]
                self._busy.add(sock)

    def idle(self, sock: socket.socket) -> None:
        """``sock``'s request is answered: it waits for the next one, the newest idle."""
        with self._lock:
            if sock in self._busy:
                self._busy.discard(sock)
                self._idle[sock] = None

    def release(self, sock: socket.socket) -> None:
        """``sock`` is closing. NOTE: call this before closing it, so that `admit` never shuts
        down a socket that is closed (whose file number may belong to a new one by then)."""
        with self._lock:
            self._idle.pop(sock, None)
            self._busy.discard(sock)


def _hang_up(sock: socket.socket) -> None:
    """End ``sock`` from outside its thread: a shutdown wakes a thread blocked reading it with
    end-of-file, and that thread closes it (closing here could pull the file number from under it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # the client has gone already
