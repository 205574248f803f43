"""An OpenAI-compatible HTTP API over the `Engine`: what `llmlocal serve` runs.

A thin layer, so every backend is served the same way: each connection gets a thread that
calls `Engine.generate`, and the engine decides how concurrent requests share the model (the
paged backend batches them; llama.cpp takes them in turn). Endpoints:

    GET  /v1/models              the one model served (with max_model_len = the context window)
    POST /v1/chat/completions    chat messages, rendered with the model's template
    POST /v1/completions         a raw prompt
    POST /tokenize, /detokenize  the model's tokenizer (vLLM's request and answer shapes)
    POST /apply-template         the prompt text of chat messages (llama.cpp's shapes)
    GET  /health

Both completion endpoints stream server-sent events with ``"stream": true``, and report
``usage`` (with ``stream_options.include_usage`` when streaming) plus the engine's own
`Stats` under the ``llmlocal`` key. A client that disconnects mid-stream cancels its request.
"""

from __future__ import annotations

import hmac
import json
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

from llmlocal.models.errors import LLMLocalError

from .engine import ContextOverflowError, Engine
from .types import DoneEvent, Event, Message, Request, SamplingParams

MAX_BODY_BYTES = 32 * 1024 * 1024
_FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


class APIError(Exception):
    """An error answered to the client as OpenAI does: {"error": {message, type, code}}."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}


class OpenAIServer(ThreadingHTTPServer):
    """``OpenAIServer(engine).serve_forever()`` answers until `shutdown()`."""

    daemon_threads = True  # a stream still open at shutdown does not hold the process
    allow_reuse_address = True

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None, log: TextIO | None = None
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.log = log  # one line per completed request, when given
        self.model_name = engine.model.name
        self.created = int(time.time())
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            raise LLMLocalError(f"Cannot listen on {host}:{port} ({e.strerror}): pick another --port or --host.") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def note(self, handler: BaseHTTPRequestHandler, request: Request, done: list[DoneEvent], stream: bool) -> None:
        """Log one line for a finished request: who, what, how fast, how it ended."""
        if self.log is None or not done:
            return
        s = done[0].stats
        parts = [
            f"{handler.client_address[0]} {handler.path}",
            "stream" if stream else "whole",
            f"{s.prompt_tokens} prompt + {sum(d.stats.completion_tokens for d in done)} completion tokens",
            "finish " + ",".join(d.finish_reason for d in done),
        ]
        if s.ttft_s is not None:
            parts.append(f"TTFT {s.ttft_s * 1000:.0f} ms")
        if s.decode_tok_s is not None:
            parts.append(f"{s.decode_tok_s:.1f} tok/s")
        with self._log_lock:
            print(f"[{time.strftime('%H:%M:%S')}] " + "  ".join(parts) + f"  id {request.id}", file=self.log, flush=True)

    _log_lock = threading.Lock()

    def start(self) -> threading.Thread:
        """Serve from a background thread (tests, embedding); `shutdown()` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="llmlocal-serve", daemon=True)
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server: OpenAIServer
    server_version = "llmlocal"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the CLI prints what matters; per-request lines would drown it

    # ---- routing -------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._handle({"/v1/models": self._models, "/health": lambda _: {"status": "ok"}})

    def do_POST(self) -> None:
        self._handle({
            "/v1/chat/completions": lambda body: self._complete(body, chat=True),
            "/v1/completions": lambda body: self._complete(body, chat=False),
            "/tokenize": self._tokenize,
            "/detokenize": self._detokenize,
            "/apply-template": lambda body: {"prompt": self.server.engine.render(_messages(body.get("messages")))},
        })

    def _handle(self, routes: dict[str, Any]) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            body = self._read_body()
            if path != "/health":  # health checks need no key
                self._authorize()
            route = routes.get(path)
            if route is None:
                raise APIError(404, f"There is no {self.command} {path} here: see /v1/models, /v1/chat/completions, /v1/completions.", "not_found")
            result = route(body)
            if result is not None:
                self._send_json(200, result)
        except APIError as e:
            self._send_json(e.status, e.body())
        except ContextOverflowError as e:
            self._send_json(400, APIError(400, str(e), "context_length_exceeded").body())
        except LLMLocalError as e:
            self._send_json(400, APIError(400, str(e)).body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug: logged, and the client gets a 500
            traceback.print_exc(file=sys.stderr)
            if self.streaming:  # the head is out: all that is left is to hang up
                self.close_connection = True
                return
            self._send_json(500, APIError(500, f"Internal error ({type(e).__name__}): see the server's log.", kind="server_error").body())

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

    # ---- endpoints -----------------------------------------------------------------------
    def _models(self, _: Any) -> dict[str, Any]:
        engine = self.server.engine
        entry = {
            "id": self.server.model_name,
            "object": "model",
            "created": self.server.created,
            "owned_by": "llmlocal",
            "max_model_len": engine.n_ctx,
            "architecture": engine.model.spec.architecture,
            "backend": engine.backend_name,
            "device": engine.device,
        }
        return {"object": "list", "data": [entry]}

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model not in (None, "", self.server.model_name):
            raise APIError(404, f"The model '{model}' is not served here: this server serves '{self.server.model_name}'.", "model_not_found")

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        engine = self.server.engine
        if "messages" in body:
            # NOTE: the generation prompt is always appended (Engine.render's contract).
            tokens = engine.prompt_ids(Request.chat(_messages(body["messages"])))
        elif isinstance(body.get("prompt"), str):
            tokens = engine.tokenize(body["prompt"], add_special=bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "Pass 'prompt' (a string) or 'messages' to tokenize.")
        return {"count": len(tokens), "max_model_len": engine.n_ctx, "tokens": tokens}

    def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise APIError(400, "Pass 'tokens', a list of token ids.")
        return {"prompt": self.server.engine.backend.detokenize(tokens)}

    def _complete(self, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
        self._check_model(body)
        request = _request(body, chat)
        events = self.server.engine.generate(request)  # raises ContextOverflowError up front
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(request, events, chat, include_usage)
            return None
        done: dict[int, DoneEvent] = {}
        for event in events:
            if isinstance(event, DoneEvent):
                done[event.index] = event
        choices = []
        for i in sorted(done):
            d = done[i]
            choice: dict[str, Any] = {"index": i, "finish_reason": _FINISH[d.finish_reason], "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": d.text}
            else:
                choice["text"] = d.text
            choices.append(choice)
        self.server.note(self, request, list(done.values()), stream=False)
        return {**self._envelope(request, chat, chunk=False), "choices": choices, **_usage(list(done.values()))}

    def _envelope(self, request: Request, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + request.id, "object": kind, "created": int(time.time()), "model": self.server.model_name}

    # ---- streaming -----------------------------------------------------------------------
    def _stream(self, request: Request, events: Iterator[Event], chat: bool, include_usage: bool) -> None:
        done: list[DoneEvent] = []
        self.gone = False  # the client disconnected: its request is cancelled, events drained
        self._on_gone = lambda: self.server.engine.cancel(request.id)
        head = self._envelope(request, chat, chunk=True)
        self._send(None)  # the response head
        try:
            if chat:
                for i in range(request.sampling.n):
                    self._send({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            for event in events:
                if isinstance(event, DoneEvent):
                    done.append(event)
                    end = {"index": event.index, "finish_reason": _FINISH[event.finish_reason], "logprobs": None}
                    end["delta" if chat else "text"] = {} if chat else ""
                    stats = {**event.stats.to_dict(), "finish_reason": event.finish_reason}
                    self._send({**head, "choices": [end], "llmlocal": stats})
                elif event.text:
                    piece = {"index": event.index, "finish_reason": None, "logprobs": None}
                    piece["delta" if chat else "text"] = {"content": event.text} if chat else event.text
                    self._send({**head, "choices": [piece]})
        except LLMLocalError as e:  # after the head: the error travels in the stream
            self._send(APIError(400, str(e)).body())
        finally:
            if hasattr(events, "close"):
                events.close()
        if include_usage:
            self._send({**head, "choices": [], **_usage(done)})
        self._send(b"data: [DONE]\n\n")
        self._send(b"")  # the chunked body's terminator
        self.server.note(self, request, done, stream=True)

    gone = False
    streaming = False

    def _send(self, item: dict[str, Any] | bytes | None) -> None:
        """Write the stream's head (None), an event (a dict) or raw bytes as one HTTP chunk.

        Nothing is written once the client is gone; the first failed write marks it gone and
        cancels its request, whose remaining events are then drained unsent.
        """
        if self.gone:
            return
        try:
            if item is None:
                self.streaming = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                return
            data = item if isinstance(item, bytes) else b"data: " + json.dumps(item, ensure_ascii=False).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.gone = True
            self.close_connection = True
            self._on_gone()

    def _send_json(self, status: int, payload: Any) -> None:
        raw = json.dumps(payload, ensure_ascii=False).encode()
        try:
            self.send_response(status, HTTPStatus(status).phrase)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def _messages(value: Any) -> list[Message]:
    """OpenAI chat messages -> ours; content may be a string or a list of text parts."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.")
    out = []
    for m in value:
        if not isinstance(m, dict):
            raise APIError(400, "Each message must be an object with 'role' and 'content'.")
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


def _request(body: dict[str, Any], chat: bool) -> Request:
    defaults = SamplingParams()
    stop = body.get("stop") or ()
    penalty = body.get("repeat_penalty", body.get("repetition_penalty", defaults.repeat_penalty))

    def number(key: str, default: Any, kind: type = float) -> Any:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"'{key}' must be a number.")
        return kind(value)

    sampling = SamplingParams(
        temperature=number("temperature", defaults.temperature),
        top_p=number("top_p", defaults.top_p),
        top_k=number("top_k", defaults.top_k, int),
        min_p=number("min_p", defaults.min_p),
        repeat_penalty=float(penalty),
        seed=number("seed", None, int),
        max_tokens=number("max_completion_tokens", number("max_tokens", None, int), int),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        n=number("n", 1, int),
    )
    if chat:
        return Request.chat(_messages(body.get("messages")), sampling)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "'prompt' must be one string.")
    return Request(prompt=prompt, sampling=sampling)


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
