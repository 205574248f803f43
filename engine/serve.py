"""An OpenAI- and Ollama-compatible HTTP API over the `Engine`: what `llmlocal serve` runs.

A thin layer, so every backend is served the same way: each connection gets a thread that
calls `Engine.generate`, and the engine decides how concurrent requests share the model (the
paged backend batches them; llama.cpp takes them in turn). Endpoints:

    GET  /v1/models              the one model served (with max_model_len = the context window)
    POST /v1/chat/completions    chat messages, rendered with the model's template
    POST /v1/completions         a raw prompt
    POST /tokenize, /detokenize  the model's tokenizer (vLLM's request and answer shapes)
    POST /apply-template         the prompt text of chat messages (llama.cpp's shapes)
    /api/...                     Ollama's API (`ollama_api`): version, tags, show, generate, chat
    GET  /metrics                Prometheus text: requests, tokens, TTFT and ITL, KV blocks
    GET  /health

Both completion endpoints stream server-sent events with ``"stream": true``, and report
``usage`` (with ``stream_options.include_usage`` when streaming) plus the engine's own
`Stats` under the ``llmlocal`` key. A request field llmlocal does not implement gets a 400
naming it, unless its value asks for nothing (``"logprobs": false``, ``"tools": []``). A
client that disconnects mid-stream cancels its request. Each request is logged in one line
(prompt text only with ``log_prompts``); ``cors_origin`` lets one browser origin call the API.
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TextIO

from llmlocal.models.errors import LLMLocalError

from .engine import ContextOverflowError, Engine
from .types import DoneEvent, Event, Grammar, Message, Request, SamplingParams, TokenEvent, TokenLogprob

MAX_BODY_BYTES = 32 * 1024 * 1024
FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# OpenAI request fields, by endpoint: what llmlocal honours, and the fields it does not
# implement that a client may still send at a value asking for nothing (null always is).
_SAMPLING_FIELDS = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
                    "repeat_penalty", "repetition_penalty", "seed", "max_tokens", "stop", "n", "user", "response_format"}
_FIELDS = {True: _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
           False: _SAMPLING_FIELDS | {"prompt", "logprobs"}}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,), "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (True, False), "store": (False,),
}


class APIError(Exception):
    """An error answered as JSON: OpenAI's {"error": {message, type, param, code}}, or on
    Ollama's routes its {"error": message}."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param

    def body(self, ollama: bool = False) -> dict[str, Any]:
        if ollama:
            return {"error": self.message}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refuse_unknown(fields: dict[str, Any], known: set[str], neutral: dict[str, tuple[Any, ...]], what: str = "field") -> None:
    """A 400 naming every field outside ``known`` whose value asks for something (null, and
    the values in ``neutral``, ask for nothing)."""
    def asks_nothing(key: str, value: Any) -> bool:
        return value is None or any(type(value) is type(n) and value == n for n in neutral.get(key, ()))

    bad = sorted(k for k, v in fields.items() if k not in known and not asks_nothing(k, v))
    if bad:
        names = ", ".join(f"'{k}'" for k in bad)
        raise APIError(400, f"llmlocal does not implement the {what}{'s' if len(bad) > 1 else ''} {names}: "
                       f"remove {'them' if len(bad) > 1 else 'it'} from the request.", "unsupported_parameter", param=bad[0])


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, their sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.buckets, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            self.buckets[i] += value <= bound

    def lines(self, name: str) -> list[str]:
        rows = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.bounds, self.buckets)]
        return rows + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """What ``GET /metrics`` reports, in Prometheus' text exposition format."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (path, status) -> answered
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)  # request arrival -> first token, seconds
        self.itl = Histogram(ITL_BUCKETS)  # between two tokens of one sample, seconds

    def answered(self, path: str, status: int, done: list[DoneEvent]) -> None:
        with self.lock:
            self.requests[path, status] += 1
            if done:
                self.prompt_tokens += done[0].stats.prompt_tokens  # the n samples share one prompt
                self.completion_tokens += sum(d.stats.completion_tokens for d in done)

    def render(self, kv_blocks: tuple[int, int] | None) -> str:
        def family(name: str, kind: str, help_: str, rows: list[str]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *rows]

        with self.lock:
            out = family("llmlocal_requests_total", "counter", "HTTP requests answered, by path and status.",
                         [f'llmlocal_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())])
            out += family("llmlocal_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                          [f"llmlocal_prompt_tokens_total {self.prompt_tokens}"])
            out += family("llmlocal_completion_tokens_total", "counter", "Tokens generated.",
                          [f"llmlocal_completion_tokens_total {self.completion_tokens}"])
            out += family("llmlocal_time_to_first_token_seconds", "histogram", "Request arrival to first token.",
                          self.ttft.lines("llmlocal_time_to_first_token_seconds"))
            out += family("llmlocal_inter_token_latency_seconds", "histogram", "Time between two tokens of a reply.",
                          self.itl.lines("llmlocal_inter_token_latency_seconds"))
        if kv_blocks is not None:
            out += family("llmlocal_kv_blocks_used", "gauge", "KV cache blocks held by running requests.", [f"llmlocal_kv_blocks_used {kv_blocks[0]}"])
            out += family("llmlocal_kv_blocks_total", "gauge", "KV cache blocks in the pool.", [f"llmlocal_kv_blocks_total {kv_blocks[1]}"])
        return "\n".join(out) + "\n"


class OpenAIServer(ThreadingHTTPServer):
    """``OpenAIServer(engine).serve_forever()`` answers until `shutdown()` (Ollama's API too)."""

    daemon_threads = True  # a stream still open at shutdown does not hold the process
    allow_reuse_address = True

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
        log: TextIO | None = None, log_prompts: bool = False, cors_origin: str | None = None,
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.log = log  # one line per request, when given
        self.log_prompts = log_prompts
        self.cors_origin = cors_origin  # the one browser origin allowed ("*": any), or None
        self.metrics = Metrics()
        self.model_name = engine.model.name
        self.created = int(time.time())
        self._log_lock = threading.Lock()
        try:
            super().__init__((host, port), Handler)
        except OSError as e:
            raise LLMLocalError(f"Cannot listen on {host}:{port} ({e.strerror}): pick another --port or --host.") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def note(self, line: str) -> None:
        if self.log is not None:
            with self._log_lock:
                print(line, file=self.log, flush=True)

    def kv_blocks(self) -> tuple[int, int] | None:
        """The KV pool's (used, total) blocks now, from a backend that keeps one (paged, sparse).
        (`Stats` give the pool at a request's last step; a gauge wants it now, idle too.)"""
        blocks = getattr(self.engine.backend, "blocks", None)
        return None if blocks is None else (blocks.num_used_blocks, blocks.num_blocks)

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

    @property
    def engine(self) -> Engine:
        return self.server.engine

    # ---- routing -------------------------------------------------------------------------
    def routes(self) -> dict[tuple[str, str], Callable[[Any], Any]]:
        from . import ollama_api  # it imports this module, so not at the top

        own: dict[tuple[str, str], Callable[[Any], Any]] = {
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): lambda _: {"status": "ok"},
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): lambda body: self._complete(body, chat=True),
            ("POST", "/v1/completions"): lambda body: self._complete(body, chat=False),
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/apply-template"): lambda body: {"prompt": self.engine.render(_messages(body.get("messages")))},
        }
        return own | {key: (lambda body, f=f: f(self, body)) for key, f in ollama_api.ROUTES.items()}

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
        raw = self.rfile.read(length) if length else b""
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

    # ---- CORS ----------------------------------------------------------------------------
    def _allowed_origin(self) -> str | None:
        """The value of Access-Control-Allow-Origin for this request's Origin, if it is allowed."""
        origin, allowed = self.headers.get("Origin"), self.server.cors_origin
        if origin is None or allowed is None or allowed not in ("*", origin):
            return None
        return allowed

    def _preflight(self) -> None:
        """A browser asks whether its origin may call: yes (204) only for --cors-origin's."""
        if self._allowed_origin() is None:
            origin = self.headers.get("Origin") or "ORIGIN"
            raise APIError(403, f"Cross-origin requests from {origin} are not allowed: start the server with --cors-origin {origin}.")
        self._head(204, None, 0, {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": self.headers.get("Access-Control-Request-Headers") or "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
        })

    # ---- OpenAI endpoints ----------------------------------------------------------------
    def _models(self, _: Any) -> dict[str, Any]:
        entry = {
            "id": self.server.model_name,
            "object": "model",
            "created": self.server.created,
            "owned_by": "llmlocal",
            "max_model_len": self.engine.n_ctx,
            "architecture": self.engine.model.spec.architecture,
            "backend": self.engine.backend_name,
            "device": self.engine.device,
        }
        return {"object": "list", "data": [entry]}

    def _metrics(self, _: Any) -> None:
        self._send_bytes(200, self.server.metrics.render(self.server.kv_blocks()).encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model not in (None, "", self.server.model_name):
            raise APIError(404, f"The model '{model}' is not served here: this server serves '{self.server.model_name}'.", "model_not_found")

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        if "messages" in body:
            # NOTE: the generation prompt is always appended (Engine.render's contract).
            tokens = self.engine.prompt_ids(Request.chat(_messages(body["messages"])))
        elif isinstance(body.get("prompt"), str):
            tokens = self.engine.tokenize(body["prompt"], add_special=bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "Pass 'prompt' (a string) or 'messages' to tokenize.")
        return {"count": len(tokens), "max_model_len": self.engine.n_ctx, "tokens": tokens}

    def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise APIError(400, "Pass 'tokens', a list of token ids.")
        return {"prompt": self.engine.backend.detokenize(tokens)}

    def _complete(self, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
        refuse_unknown(body, _FIELDS[chat], _NEUTRAL)
        options = body.get("stream_options") or {}
        refuse_unknown({f"stream_options.{k}": v for k, v in options.items()}, {"stream_options.include_usage"}, {})
        self._check_model(body)
        request = _request(body, chat)
        reply = OpenAIReply(self.server.model_name, request, chat, include_usage=bool(options.get("include_usage")),
                            token_bytes=self.engine.token_bytes)
        return self.respond(request, reply, stream=bool(body.get("stream")))

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
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
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
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self._lost()

    def _lost(self) -> None:
        self.gone = True
        self.close_connection = True
        self._on_gone()

    def _send_bytes(self, status: int, raw: bytes, content_type: str) -> None:
        try:
            self._head(status, content_type, len(raw))
            self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _send_json(self, status: int, payload: Any) -> None:
        self._send_bytes(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json")

    def _send_error(self, error: APIError) -> None:
        self._send_json(error.status, error.body(ollama=self.ollama))


@dataclass
class OpenAIReply:
    """A generation in OpenAI's words: SSE chunks of deltas, or a (chat) completion object."""

    model: str
    request: Request
    chat: bool
    include_usage: bool
    token_bytes: Callable[[int], bytes]
    content_type = "text/event-stream; charset=utf-8"
    _offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset, per sample

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.request.id, "object": kind, "created": int(time.time()), "model": self.model}

    def opening(self) -> list[Any]:
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [self._chunk({"index": i, "delta": delta, "finish_reason": None}) for i in range(self.request.sampling.n)]

    def token(self, event: TokenEvent) -> Any | None:
        if not event.text:
            return None
        piece: dict[str, Any] = {"index": event.index, "finish_reason": None, "logprobs": self._logprobs(event.index, event.logprobs)}
        piece["delta" if self.chat else "text"] = {"content": event.text} if self.chat else event.text
        return self._chunk(piece)

    def done(self, event: DoneEvent) -> Any | None:
        end: dict[str, Any] = {"index": event.index, "finish_reason": FINISH[event.finish_reason], "logprobs": None}
        end["delta" if self.chat else "text"] = {} if self.chat else ""
        return {**self._chunk(end), "llmlocal": {**event.stats.to_dict(), "finish_reason": event.finish_reason}}

    def closing(self, done: list[DoneEvent]) -> list[Any]:
        usage = [{**self.envelope(chunk=True), "choices": [], **_usage(done)}] if self.include_usage else []
        return [*usage, "[DONE]"]

    def whole(self, done: list[DoneEvent]) -> dict[str, Any]:
        choices = []
        for d in done:
            choice: dict[str, Any] = {"index": d.index, "finish_reason": FINISH[d.finish_reason],
                                      "logprobs": self._logprobs(d.index, d.logprobs)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": d.text}
            else:
                choice["text"] = d.text
            choices.append(choice)
        return {**self.envelope(chunk=False), "choices": choices, **_usage(done)}

    def error(self, message: str) -> Any:
        return APIError(400, message).body()

    def frame(self, item: Any) -> bytes:
        data = item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
        return b"data: " + data.encode() + b"\n\n"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.envelope(chunk=True), "choices": [choice]}

    def _logprobs(self, index: int, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens of sample ``index`` (None when not asked for)."""
        if self.request.sampling.logprobs is None:
            return None
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                raw = self.token_bytes(token)
                return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs]}
        text = [self.token_bytes(lp.token).decode("utf-8", errors="replace") for lp in logprobs]
        offsets = []
        for piece in text:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(piece)
        return {
            "tokens": text,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_bytes(t).decode("utf-8", errors="replace"): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


def _messages(value: Any) -> list[Message]:
    """OpenAI chat messages -> ours; content may be a string or a list of text parts."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.")
    out = []
    for m in value:
        if not isinstance(m, dict):
            raise APIError(400, "Each message must be an object with 'role' and 'content'.")
        refuse_unknown(m, {"role", "content"}, {"tool_calls": ([],), "annotations": ([],)}, what="message field")
        role = "system" if m.get("role") == "developer" else m.get("role")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise APIError(400, "Only text message parts are supported: send {'type': 'text', 'text': ...} parts.")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"A {role} message needs its 'content' as a string.")
        out.append(Message(role=role, content=content))  # raises on an unknown role
    return out


def number(fields: dict[str, Any], key: str, default: Any, kind: type = float, label: str | None = None) -> Any:
    """``fields[key]`` as a ``kind`` (absent or null: ``default``), else a 400 naming it."""
    value = fields.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (kind is int and value != int(value)):
        raise APIError(400, f"'{label or key}' must be {'an integer' if kind is int else 'a number'}.", param=key)
    return kind(value)


def stop_strings(value: Any, label: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise APIError(400, f"'{label}' must be a string or a list of strings.", param=label)
    return tuple(value)


def _request(body: dict[str, Any], chat: bool) -> Request:
    defaults = SamplingParams()
    max_tokens = number(body, "max_tokens", None, int)
    sampling = SamplingParams(
        temperature=number(body, "temperature", defaults.temperature),
        top_p=number(body, "top_p", defaults.top_p),
        top_k=number(body, "top_k", defaults.top_k, int),
        min_p=number(body, "min_p", defaults.min_p),
        repeat_penalty=number(body, "repeat_penalty", number(body, "repetition_penalty", defaults.repeat_penalty)),
        seed=number(body, "seed", None, int),
        max_tokens=number(body, "max_completion_tokens", max_tokens, int),
        stop=stop_strings(body.get("stop")),
        n=number(body, "n", 1, int),
        grammar=response_format(body.get("response_format")),
        logprobs=_logprobs(body, chat),
    )
    if chat:
        return Request.chat(_messages(body.get("messages")), sampling)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "'prompt' must be one string.")
    return Request(prompt=prompt, sampling=sampling)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives a token reports (None: no logprobs). Chat: ``logprobs`` true and
    ``top_logprobs`` N; completions: ``logprobs`` N."""
    value = body.get("logprobs")
    if not chat:
        return number(body, "logprobs", None, int)
    if value is None or value is False:
        if body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs \"logprobs\": true.", param="top_logprobs")
        return None
    if value is not True:
        raise APIError(400, "'logprobs' must be true or false.", param="logprobs")
    return number(body, "top_logprobs", 0, int)


def response_format(value: Any) -> Grammar | None:
    """OpenAI's ``response_format``: ``text`` (free), ``json_object`` (any JSON object) or
    ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``: a document valid against
    ``schema``, enforced token by token whether ``strict`` or not)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {"type": "object"}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format.json_schema' must be an object with the JSON schema under 'schema'.",
                           param="response_format")
        return Grammar.json_schema(schema)
    raise APIError(400, "'response_format' must be an object whose 'type' is text, json_object or json_schema.",
                   param="response_format")


def _usage(done: list[DoneEvent]) -> dict[str, Any]:
    if not done:
        return {"usage": None}
    prompt = done[0].stats.prompt_tokens  # the n samples share one prompt
    completion = sum(d.stats.completion_tokens for d in done)
    cached = done[0].stats.cached_prompt_tokens
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"usage": usage, "llmlocal": done[-1].stats.to_dict()}
