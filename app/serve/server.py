"""An OpenAI- and Ollama-compatible HTTP API over the `Engine`: what `llmlocal serve` runs.

A thin layer, so every backend is served the same way: each connection gets a thread that
calls `Engine.generate`, and the engine decides how concurrent requests share the model (the
paged backend batches them; llama.cpp takes them in turn). This module is the server itself:
routing, the API key, CORS, the request log and streaming; the errors and request-reading
helpers both APIs share are `serve_protocol`'s. The routes live with their API:

    /v1/..., /tokenize, ...      OpenAI's API (`openai_api`): models, chat and text completions
    /api/...                     Ollama's API (`ollama_api`): version, tags, show, generate, chat
    GET  /metrics                Prometheus text (`serve_metrics`): requests, tokens, TTFT and ITL, KV blocks
    GET  /health

A client that disconnects mid-stream cancels its request. Each request is logged in one line
(prompt text only with ``log_prompts``).

Before any route runs, a request must pass `serve_access`: a Host this server answers (not a
DNS-rebinding page's domain) and, when it carries an Origin, a local page's or one of
``cors_origin`` (not another site's). Connections are counted by `serve_connections`: past
``max_connections`` the longest-idle one is hung up, and a new one is answered 503 only when all
are busy; a connection idle for ``idle_timeout`` seconds is closed.
"""

from __future__ import annotations

import hmac
import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TextIO

from llmlocal.engine.engine import Engine
from llmlocal.engine.types import DoneEvent, Event, Request, TokenEvent
from llmlocal.models.errors import ContextOverflowError, LLMLocalError

from .access import Access, refused_host, refused_origin, require_key
from .connections import Connections
from .metrics import Metrics
from .protocol import APIError

MAX_BODY_BYTES = 32 * 1024 * 1024
GONE = (ConnectionError, TimeoutError)  # the client hung up, or stopped reading for the idle timeout


class OpenAIServer(ThreadingHTTPServer):
    """``OpenAIServer(engine).serve_forever()`` answers until `shutdown()` (Ollama's API too)."""

    daemon_threads = True  # a stream still open at shutdown does not hold the process
    allow_reuse_address = True
    request_queue_size = 128  # a burst of connections waits in the kernel, not in SYN retries

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
        log: TextIO | None = None, log_prompts: bool = False, cors_origin: str | Sequence[str] | None = None,
        allow_hosts: Sequence[str] = (), insecure_no_key: bool = False, max_connections: int = 64,
        idle_timeout: float = 60.0,
    ) -> None:
        """``cors_origin``: the browser origins let in besides local pages' ("*": any);
        ``allow_hosts``: Host names answered besides this machine's; a bind beyond loopback
        needs ``api_key`` unless ``insecure_no_key``."""
        require_key(host, api_key, insecure_no_key)
        if max_connections < 1:
            raise LLMLocalError(f"--max-connections must be at least 1, got {max_connections}.")
        self.engine = engine
        self.api_key = api_key
        self.log = log  # one line per request, when given
        self.log_prompts = log_prompts
        self.metrics = Metrics()
        self.model_name = engine.model.name
        self.created = int(time.time())
        self.connections = Connections(max_connections)
        self.idle_timeout = idle_timeout
        self._log_lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, port), Handler)
        except OSError as e:
            raise LLMLocalError(f"Cannot listen on {host}:{port} ({e.strerror}): pick another --port or --host.") from None
        origins = [cors_origin] if isinstance(cors_origin, str) else list(cors_origin or ())
        try:
            self.access = Access.for_bind(self.server_address[0], allow_hosts, origins)
        except LLMLocalError:
            self.server_close()
            raise

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def note(self, line: str) -> None:
        if self.log is not None:
            with self._log_lock:
                print(line, file=self.log, flush=True)

    def kv_blocks(self) -> tuple[int, int] | None:
        """The KV pool's (used, total) blocks now, from a backend that keeps one (paged, sparse).
        (`Stats` give the pool at a request's last step; a gauge wants it now, idle too.)"""
        blocks = getattr(self.engine.backend, "blocks", None)
        return None if blocks is None else (blocks.num_used_blocks, blocks.num_blocks)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up between requests is routine, not a traceback; anything else is
        a bug and is printed as socketserver does."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection, if it finds room (`Connections`); else a 503, from here."""
        if self.connections.admit(request):
            super().process_request(request, client_address)
            return
        self._answer_busy(request, client_address)
        self.shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        self.connections.release(request)  # before the close (see `Connections.release`)
        super().shutdown_request(request)

    def _answer_busy(self, sock: socket.socket, client_address: Any) -> None:
        """503 to a connection that finds every other one busy. The request is not read: the
        answer is OpenAI's error shape whatever the path."""
        error = APIError(503, f"All {self.connections.limit} connections of this server are busy: retry shortly, "
                              "or start it with a higher --max-connections.", "server_busy", kind="server_error")
        body = json.dumps(error.body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Retry-After: 1\r\nConnection: close\r\n\r\n")
        try:
            sock.settimeout(1.0)  # a few hundred bytes fit any socket's buffer: this never waits long
            sock.sendall(head.encode() + body)
            sock.setblocking(False)
            sock.recv(65536)  # what the client sent: closing over unread bytes would reset, losing the 503
        except OSError:
            pass
        self.metrics.answered("other", 503, [])
        self.note(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {client_address[0]} - - 503  all {self.connections.limit} connections busy")

    def start(self) -> threading.Thread:
        """Serve from a background thread (tests, embedding); `shutdown()` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="llmlocal-serve", daemon=True)
        thread.start()
        return thread


class Reply(Protocol):
    """How one API words a generation: the items of a stream, or one whole answer."""

    content_type: str  # of the stream

    def opening(self) -> list[Any]: ...
    def token(self, event: TokenEvent) -> Any | None: ...
    def done(self, event: DoneEvent) -> Any | None: ...
    def closing(self, done: list[DoneEvent]) -> list[Any]: ...
    def whole(self, done: list[DoneEvent]) -> dict[str, Any]: ...
    def error(self, message: str) -> Any: ...
    def frame(self, item: Any) -> bytes: ...


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server: OpenAIServer
    server_version = "llmlocal"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the server logs one line of its own per request (_finish)

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout  # a socket timeout: waiting for a request, reading or writing one
        super().setup()

    @property
    def engine(self) -> Engine:
        return self.server.engine

    # ---- routing -------------------------------------------------------------------------
    def routes(self) -> dict[tuple[str, str], Callable[[Any], Any]]:
        from . import ollama_api, openai_api  # each imports Handler for its type hints only

        own: dict[tuple[str, str], Callable[[Any], Any]] = {
            ("GET", "/health"): lambda _: {"status": "ok"},
            ("GET", "/metrics"): self._metrics,
        }
        apis = openai_api.ROUTES | ollama_api.ROUTES
        return own | {key: (lambda body, f=f: f(self, body)) for key, f in apis.items()}

    def _handle(self) -> None:
        self.t0 = time.perf_counter()
        # NOTE: `self.request` is the socket (socketserver's name); the generation is `self.generation`.
        self.status, self.done, self.generation, self.streaming, self.gone = 0, [], None, False, False
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        self.ollama = path.startswith("/api/")
        routes = self.routes()
        known = path if any(p == path for _, p in routes) else "other"  # /metrics labels: no series per scanned path
        try:
            body = self._read_body()
            self._check_access(path)
            self.server.connections.busy(self.request)
            if self.command == "OPTIONS":
                return self._preflight()
            if path != "/health":  # health checks need no key
                self._authorize()
            route = routes.get((self.command, path))
            if route is None:
                raise APIError(404, f"There is no {self.command} {path} here: see /v1/models, /v1/chat/completions, /v1/completions, /api/tags.", "not_found")
            result = route(body)
            if result is not None:
                self._send_json(200, result)
        except APIError as e:
            self._send_error(e)
        except ContextOverflowError as e:
            self._send_error(APIError(400, str(e), "context_length_exceeded"))
        except LLMLocalError as e:
            self._send_error(APIError(400, str(e)))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug: logged, and the client gets a 500
            traceback.print_exc()
            if self.streaming:  # the head is out: all that is left is to hang up
                self.close_connection = True
            else:
                self._send_error(APIError(500, f"Internal error ({type(e).__name__}): see the server's log.", kind="server_error"))
        finally:
            self._finish(path, known)

    do_GET = do_POST = do_OPTIONS = _handle

    def _finish(self, path: str, known: str) -> None:
        """Count the request in /metrics and log one line: who, what, how it ended, how long."""
        self.server.connections.idle(self.request)
        done = sorted(self.done, key=lambda d: d.index)
        self.server.metrics.answered(known, self.status, done)
        parts = [f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.client_address[0]} {self.command} {path} {self.status} "
                 f"{time.perf_counter() - self.t0:.3f} s"]
        if done:
            s = done[0].stats
            parts += [f"{s.prompt_tokens} prompt + {sum(d.stats.completion_tokens for d in done)} completion tokens",
                      "stream" if self.streaming else "whole", "finish " + ",".join(d.finish_reason for d in done)]
            if s.ttft_s is not None:
                parts.append(f"TTFT {s.ttft_s * 1000:.0f} ms")
            if s.decode_tok_s is not None:
                parts.append(f"{s.decode_tok_s:.1f} tok/s")
        if self.generation is not None:
            parts.append(f"id {self.generation.id}")
            if self.server.log_prompts:
                r = self.generation
                prompt = r.prompt if r.prompt is not None else [{"role": m.role, "content": m.content} for m in r.messages]
                parts.append("prompt " + json.dumps(prompt, ensure_ascii=False))
        self.server.note("  ".join(parts))

    def _read_body(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise APIError(411, "Send the request body with a Content-Length.")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise APIError(400, "The Content-Length header is not a number.") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise APIError(413, f"The request body is over {MAX_BODY_BYTES // 2**20} MB.")
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError:
            self.close_connection = True
            raise APIError(408, f"The request body stopped coming for {self.server.idle_timeout:g} s: send it whole.") from None
        if self.command != "POST":
            return None
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.")
        return body

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "Invalid or missing API key: send it as 'Authorization: Bearer KEY'.", "invalid_api_key")

    # ---- who may call: Host, Origin, CORS ------------------------------------------------
    def _check_access(self, path: str) -> None:
        """403 for what only a web page sends: a Host that is not this server's (DNS rebinding),
        an Origin not let in (a cross-site request, simple ones too). It runs before any route,
        so a refused request starts nothing. /health answers any Host: it tells nothing."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) > 1:
            raise APIError(400, "The request has several Host headers: send one.")
        if path != "/health" and hosts and not self.server.access.host_allowed(hosts[0]):
            raise APIError(403, refused_host(hosts[0]), "host_not_allowed")
        origin = self.headers.get("Origin")
        if origin is not None and not self.server.access.origin_allowed(origin):
            raise APIError(403, refused_origin(origin), "origin_not_allowed")

    def _allowed_origin(self) -> str | None:
        """The value of Access-Control-Allow-Origin for this request's Origin, if it is allowed."""
        return self.server.access.cors_value(self.headers.get("Origin"))

    def _preflight(self) -> None:
        """A browser asks whether its origin may call: yes (204) for local pages and --cors-origin's."""
        if self.headers.get("Origin") is None:
            raise APIError(403, "A CORS preflight names the page asking: send its Origin header.", "origin_not_allowed")
        self._head(204, None, 0, {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": self.headers.get("Access-Control-Request-Headers") or "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
        })

    def _metrics(self, _: Any) -> None:
        self._send_bytes(200, self.server.metrics.render(self.server.kv_blocks()).encode(), "text/plain; version=0.0.4; charset=utf-8")

    # ---- generation, shared by both APIs -------------------------------------------------
    def respond(self, request: Request, reply: Reply, stream: bool) -> dict[str, Any] | None:
        """Run ``request``: the whole answer to send, or None once it has been streamed."""
        self.generation = request
        events = self._observed(self.engine.generate(request))  # raises ContextOverflowError up front
        if stream:
            self._stream(request, events, reply)
            return None
        for _ in events:
            pass
        return reply.whole(sorted(self.done, key=lambda d: d.index))

    def _observed(self, events: Iterator[Event]) -> Iterator[Event]:
        """The events, as they pass timed for /metrics; the DoneEvents kept for the log."""
        last: dict[int, float] = {}  # sample index -> time of its latest token
        metrics = self.server.metrics
        try:
            for event in events:
                now = time.perf_counter()
                if isinstance(event, DoneEvent):
                    self.done.append(event)
                elif event.token_ids:
                    with metrics.lock:
                        if not last:
                            metrics.ttft.observe(now - self.t0)
                        elif event.index in last:  # a multi-token event (speculation) splits its gap
                            for _ in event.token_ids:
                                metrics.itl.observe((now - last[event.index]) / len(event.token_ids))
                    last[event.index] = now
                yield event
        finally:
            if hasattr(events, "close"):
                events.close()

    def _stream(self, request: Request, events: Iterator[Event], reply: Reply) -> None:
        self._on_gone = lambda: self.engine.cancel(request.id)  # events are then drained unsent
        try:
            self._head(200, reply.content_type, None)
        except GONE:
            self._lost()
        try:
            for item in reply.opening():
                self._chunk(reply.frame(item))
            for event in events:
                item = reply.done(event) if isinstance(event, DoneEvent) else reply.token(event)
                if item is not None:
                    self._chunk(reply.frame(item))
        except LLMLocalError as e:  # after the head: the error travels in the stream
            self._chunk(reply.frame(reply.error(str(e))))
        finally:
            events.close()  # type: ignore[attr-defined]
        for item in reply.closing(sorted(self.done, key=lambda d: d.index)):
            self._chunk(reply.frame(item))
        self._chunk(b"")  # the chunked body's terminator

    # ---- writing -------------------------------------------------------------------------
    def _head(self, status: int, content_type: str | None, length: int | None, extra: dict[str, str] | None = None) -> None:
        """The response line and headers; ``length=None`` starts a chunked stream."""
        self.status = status
        self.send_response(status, HTTPStatus(status).phrase)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        if length is None:
            self.streaming = True
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        allowed = self._allowed_origin()
        if allowed is not None:
            self.send_header("Access-Control-Allow-Origin", allowed)
            self.send_header("Vary", "Origin")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        """Write one HTTP chunk of a stream. Nothing is written once the client is gone; the
        first failed write marks it gone and cancels its request."""
        if self.gone:
            return
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except GONE:
            self._lost()

    def _lost(self) -> None:
        self.gone = True
        self.close_connection = True
        self._on_gone()

    def _send_bytes(self, status: int, raw: bytes, content_type: str) -> None:
        try:
            self._head(status, content_type, len(raw))
            self.wfile.write(raw)
        except GONE:
            self.close_connection = True

    def _send_json(self, status: int, payload: Any) -> None:
        self._send_bytes(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json")

    def _send_error(self, error: APIError) -> None:
        self._send_json(error.status, error.body(ollama=self.ollama))
