"""How many connections `llmlocal serve` holds (`app/serve/connections.py`): sockets held
open without a request are closed and cannot lock clients out or pile up threads; past the
limit, with every connection busy, a new one is answered 503. Real sockets on loopback."""

from __future__ import annotations

import io
import json
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from llmlocal.app.serve.connections import Connections
from llmlocal.app.serve.server import OpenAIServer
from llmlocal.engine import Engine


def until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail after ``seconds`` (a bound, not a speed claim)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.05)


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def closed_by_server(sockets: list[socket.socket], seconds: float) -> None:
    """Wait until the server has closed every one of ``sockets`` (end-of-file or a reset)."""
    open_ = set(sockets)
    with selectors.DefaultSelector() as sel:
        for s in open_:
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + seconds
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                s = key.fileobj
                try:
                    data = s.recv(4096)  # type: ignore[union-attr]
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                if not data:
                    sel.unregister(s)
                    open_.discard(s)  # type: ignore[arg-type]
    assert not open_, f"{len(open_)} of {len(sockets)} connections still open after {seconds} s"


def test_idle_connections_are_closed_and_do_not_lock_clients_out(engine: Engine) -> None:
    server = OpenAIServer(engine, "127.0.0.1", 0, log=io.StringIO(), idle_timeout=1.0)
    thread = server.start()
    host, port = server.server_address[:2]
    before = set(threading.enumerate())  # threads of earlier tests may end meanwhile: count only new ones

    def new_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before]

    idle: list[socket.socket] = []
    try:
        for i in range(500):  # nothing sent, a request line cut short, headers never ended
            s = socket.create_connection((host, port), timeout=30)
            s.sendall([b"", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: localhost\r\n"][i % 3])
            idle.append(s)
        assert health(server.url) == 200  # a client still gets in: the longest-idle connection makes room
        until(lambda: len(new_threads()) <= server.connections.limit, 60, "threads within the limit")
        closed_by_server(idle, seconds=60)  # the timeout is 1 s; the bound is for a loaded machine
        until(lambda: not new_threads(), 60, "every connection's thread ended")
        assert len(server.connections) == 0
        assert health(server.url) == 200
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()
        thread.join()


def test_when_every_connection_is_busy_a_new_one_gets_503(engine: Engine) -> None:
    server = OpenAIServer(engine, "127.0.0.1", 0, log=io.StringIO(), max_connections=1)
    thread = server.start()
    # A stream the grammar keeps going (no end-of-text before 100 numbers): busy until hung up.
    schema = {"type": "array", "minItems": 100, "items": {"type": "integer"}}
    body = json.dumps({"prompt": "Numbers:", "stream": True, "max_tokens": 400, "temperature": 0,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).encode()
    stream = socket.create_connection(server.server_address[:2], timeout=120)
    try:
        stream.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert stream.recv(4096).startswith(b"HTTP/1.1 200")  # the head is out: the request runs
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(server.url + "/v1/models", timeout=60)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
        error = json.loads(refused.value.read())["error"]
        assert error["code"] == "server_busy" and error["message"] == (
            "All 1 connections of this server are busy: retry shortly, or start it with a higher --max-connections.")
    finally:
        stream.close()  # the server sees it gone at its next write and cancels the request
    try:
        until(lambda: health(server.url) == 200, 120, "the slot freed once the stream's client left")
        assert "- - 503  all 1 connections busy" in server.log.getvalue()  # type: ignore[union-attr]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_longest_idle_connection_makes_room() -> None:
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        conns = Connections(3)
        a, b, c, d = (p[0] for p in pairs)
        assert conns.admit(a) and conns.admit(b) and conns.admit(c)
        conns.busy(a)
        conns.busy(b)
        conns.idle(a)  # a is idle again, newer than c
        assert conns.admit(d) and len(conns) == 3
        assert pairs[2][1].recv(1) == b""  # c, the longest idle, was hung up
        conns.busy(c)  # its thread, late, finds it gone: it stays out
        conns.busy(a)
        conns.busy(d)
        assert not conns.admit(pairs[3][1]) and len(conns) == 3  # all busy: refused
        conns.release(b)
        assert len(conns) == 2
        with pytest.raises(ValueError):
            Connections(0)
    finally:
        for p in pairs:
            for s in p:
                s.close()
