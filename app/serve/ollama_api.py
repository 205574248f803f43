"""Ollama's HTTP API on `llmlocal serve`, so that Ollama clients work against llmlocal.

    GET  /api/version    llmlocal's version
    GET  /api/tags       the one model served, with Ollama's ``details``
    POST /api/show       its details, ``model_info`` (``<arch>.context_length`` is the served
                         window, not the trained one) and its chat template (Jinja)
    POST /api/generate   a prompt, rendered as a user turn with the model's chat template
                         (``system`` adds a system turn), or sent as is with ``"raw": true``
    POST /api/chat       messages, rendered with the model's chat template

Generation streams NDJSON unless ``"stream": false``; the last object has ``done: true``,
``done_reason`` and the timings in nanoseconds. Errors are ``{"error": message}``.

What is honoured, and what gets a 400 naming it:

* ``options``: temperature, top_p, top_k, min_p, seed, repeat_penalty, repeat_last_n, stop,
  num_predict (-1 and -2: until the model stops or the context is full) and num_ctx (at most
  the served window, which ``--ctx`` sets: prompt and reply then stay within num_ctx). Any
  other option is refused unless its value asks for nothing (``"mirostat": 0``); null
  options count as absent.
* ``format``: ``"json"`` (any JSON object) or a JSON schema, enforced token by token.
* ``tools`` on /api/chat (OpenAI's function list): rendered by the model's chat template (or
  described in the system message), the calls the model writes returned as
  ``message.tool_calls`` with the ``arguments`` as an object (streamed in one object once a
  call is complete). Messages take ``tool_calls`` and ``role: "tool"`` results back
  (``tool_name`` is accepted; the template sees the results in order).
* Refused: a Go ``template``, ``suffix``, ``images``, ``context``, ``think``, ``tools`` on
  /api/generate, ``logprobs``, and ``system`` with ``raw``.
* ``keep_alive`` is accepted and has no effect: the model is loaded when the server starts
  and stays loaded until it stops (so ``load_duration`` is 0). A request without a prompt
  (or without messages) answers at once with ``done_reason: "load"``, as Ollama's does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from typing import TYPE_CHECKING, Any

from llmlocal.engine.prompt.tool_calls import ToolCallStream, check_tools, parse_tool_calls, tool_request
from llmlocal.engine.types import DoneEvent, Grammar, Message, Request, SamplingParams, Stats, TokenEvent, ToolCall
from llmlocal.models.errors import ContextOverflowError, LLMLocalError
from llmlocal.models.spec import ModelSpec

from .protocol import FINISH, APIError, number, refuse_unknown, stop_strings

if TYPE_CHECKING:
    from .server import Handler

# Ollama option -> (SamplingParams field, number kind)
_SAMPLING_OPTIONS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int), "min_p": ("min_p", float),
    "seed": ("seed", int), "repeat_penalty": ("repeat_penalty", float), "repeat_last_n": ("repeat_last_n", int),
}
_OPTIONS = set(_SAMPLING_OPTIONS) | {"num_predict", "stop", "num_ctx"}
_NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
}
# Fields of a request that ask for nothing at these values (null always does).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "template": ("",), "suffix": ("",), "images": ([],), "context": ([],), "tools": ([],),
    "think": (False,), "logprobs": (False,), "top_logprobs": (0,),
}
_GENERATE_FIELDS = {"model", "prompt", "system", "raw", "stream", "options", "keep_alive", "format"}
_CHAT_FIELDS = {"model", "messages", "stream", "options", "keep_alive", "format", "tools"}
_REFUSALS = {  # fields that deserve more than "remove it"
    "template": "llmlocal renders the model's own chat template and cannot run an Ollama 'template': "
                "remove it, or send the whole prompt with \"raw\": true.",
}


# ---- endpoints -------------------------------------------------------------------------------
def version(handler: Handler, _: Any) -> dict[str, Any]:
    try:
        return {"version": metadata.version("llmlocal")}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "0.0.0"}


def tags(handler: Handler, _: Any) -> dict[str, Any]:
    return {"models": [_summary(handler)]}


def show(handler: Handler, body: dict[str, Any]) -> dict[str, Any]:
    refuse_unknown(body, {"model", "name", "verbose"}, {})
    _check_model(handler, body.get("model") or body.get("name"))
    engine = handler.engine
    spec, arch, d = engine.model.spec, engine.model.spec.architecture, SamplingParams()
    info = {
        "general.architecture": arch,
        "general.parameter_count": spec.n_params,
        f"{arch}.context_length": engine.n_ctx,
        f"{arch}.embedding_length": spec.d_model,
        f"{arch}.block_count": spec.n_layers,
        f"{arch}.feed_forward_length": spec.d_ffn,
        f"{arch}.attention.head_count": spec.n_heads,
        f"{arch}.attention.head_count_kv": spec.n_kv_heads,
    }
    parameters = {"num_ctx": engine.n_ctx, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                  "min_p": d.min_p, "repeat_penalty": d.repeat_penalty, "repeat_last_n": d.repeat_last_n}
    summary = _summary(handler)
    return {
        "modelfile": f"# served by llmlocal ({engine.backend_name} on {engine.device})\nFROM {engine.model.name}\n",
        "parameters": "\n".join(f"{k} {v}" for k, v in parameters.items()),
        "template": spec.chat_template or "",
        "details": summary["details"],
        "model_info": info,
        "capabilities": ["completion", "tools"] if engine.template.knows_tools else ["completion"],  # as Ollama: the template's
        "modified_at": summary["modified_at"],
    }


def generate(handler: Handler, body: dict[str, Any]) -> dict[str, Any] | None:
    _refuse(body, _GENERATE_FIELDS)
    _check_model(handler, body.get("model"))
    prompt, system, raw = body.get("prompt") or "", body.get("system") or "", _flag(body, "raw", False)
    if not isinstance(prompt, str) or not isinstance(system, str):
        raise APIError(400, "'prompt' and 'system' must be strings.")
    reply = OllamaReply(handler.server.model_name, chat=False, t0=handler.t0)
    if not prompt:
        return reply.loaded()
    sampling, num_ctx = _sampling(body.get("options"), handler.engine.n_ctx, body.get("format"))
    if raw and system:
        raise APIError(400, "A raw prompt is sent as is, so 'system' cannot be added to it: remove 'system' or 'raw'.")
    messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
    request = Request(prompt=prompt, sampling=sampling) if raw else Request.chat(messages, sampling)
    return handler.respond(_within(handler, request, num_ctx), reply, stream=_flag(body, "stream", True))


def chat(handler: Handler, body: dict[str, Any]) -> dict[str, Any] | None:
    _refuse(body, _CHAT_FIELDS)
    _check_model(handler, body.get("model"))
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    reply = OllamaReply(handler.server.model_name, chat=True, t0=handler.t0, tools=bool(tools))
    if not messages:
        return reply.loaded()
    sampling, num_ctx = _sampling(body.get("options"), handler.engine.n_ctx, body.get("format"))
    request = tool_request(handler.engine, messages, tools, sampling) if tools else Request.chat(messages, sampling)
    return handler.respond(_within(handler, request, num_ctx), reply, stream=_flag(body, "stream", True))


ROUTES = {
    ("GET", "/api/version"): version,
    ("GET", "/api/tags"): tags,
    ("POST", "/api/show"): show,
    ("POST", "/api/generate"): generate,
    ("POST", "/api/chat"): chat,
}


# ---- the answer ------------------------------------------------------------------------------
@dataclass
class OllamaReply:
    """A generation in Ollama's words: NDJSON objects, the last with ``done: true`` and timings."""

    model: str
    chat: bool
    t0: float  # when the request arrived (perf_counter)
    tools: bool = False  # read tool calls out of the reply
    content_type = "application/x-ndjson"
    _calls: ToolCallStream = dataclasses.field(default_factory=ToolCallStream)  # when streaming with tools

    def opening(self) -> list[Any]:
        return []

    def token(self, event: TokenEvent) -> Any | None:
        if not event.text:
            return None
        if self.tools:
            return [self._piece(p) for p in self._calls.feed(event.text)] or None
        return self._object(event.text, done=False)

    def done(self, event: DoneEvent) -> Any | None:
        final = self._final(event, "")  # the text went out in the tokens before
        return [*(self._piece(p) for p in self._calls.finish()), final] if self.tools else final

    def closing(self, done: list[DoneEvent]) -> list[Any]:
        return []

    def whole(self, done: list[DoneEvent]) -> dict[str, Any]:
        content, calls = parse_tool_calls(done[0].text) if self.tools else (done[0].text, ())
        return self._final(done[0], content or "", calls)

    def loaded(self) -> dict[str, Any]:
        return {**self._object("", done=True), "done_reason": "load"}

    def error(self, message: str) -> Any:
        return {"error": message}

    def frame(self, item: Any) -> bytes:
        if isinstance(item, list):  # several objects for one event (text, then a tool call)
            return b"".join(self.frame(one) for one in item)
        return json.dumps(item, ensure_ascii=False).encode() + b"\n"

    def _object(self, text: str, done: bool, calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
        words = {"message": {"role": "assistant", "content": text}} if self.chat else {"response": text}
        if calls:  # Ollama gives the arguments as an object
            words["message"]["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]
        return {"model": self.model, "created_at": _rfc3339(time.time()), **words, "done": done}

    def _piece(self, piece: str | ToolCall) -> dict[str, Any]:
        return self._object(piece, done=False) if isinstance(piece, str) else self._object("", done=False, calls=(piece,))

    def _final(self, event: DoneEvent, text: str, calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
        return {**self._object(text, done=True, calls=calls), "done_reason": FINISH[event.finish_reason], **self._timings(event.stats)}

    def _timings(self, s: Stats) -> dict[str, int]:
        # The first token comes out of the prompt's forward pass: the prompt is evaluated until
        # it (TTFT), the reply after it.
        prompt_s = s.ttft_s if s.ttft_s is not None else (s.total_s or 0.0)
        return {
            "total_duration": _ns(time.perf_counter() - self.t0),
            "load_duration": 0,
            "prompt_eval_count": s.prompt_tokens,
            "prompt_eval_duration": _ns(prompt_s),
            "eval_count": s.completion_tokens,
            "eval_duration": _ns(max(0.0, (s.total_s or prompt_s) - prompt_s)),
        }


# ---- reading requests ------------------------------------------------------------------------
def _refuse(body: dict[str, Any], known: set[str]) -> None:
    for field, message in _REFUSALS.items():
        if body.get(field) not in (None, ""):
            raise APIError(400, message, "unsupported_parameter", param=field)
    refuse_unknown(body, known, _NEUTRAL)


def _check_model(handler: Handler, name: Any) -> None:
    served = handler.server.model_name
    if name not in (None, "", served, f"{served}:latest"):
        raise APIError(404, f"The model '{name}' is not served here: this server serves '{served}'.", "model_not_found")


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{key}' must be true or false.", param=key)
    return value


def _messages(value: Any) -> list[Message]:
    """Ollama chat messages -> ours (text only)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise APIError(400, "'messages' must be a list of {role, content} objects.")
    out = []
    for m in value:
        refuse_unknown(m, {"role", "content", "tool_calls", "tool_name"}, {"images": ([],), "thinking": ("",)}, what="message field")
        if not isinstance(m.get("content") or "", str):
            raise APIError(400, f"A {m.get('role')} message needs its 'content' as a string.")
        calls = _message_calls(m.get("tool_calls"))
        out.append(Message(role=m.get("role"), content=m.get("content") or "", tool_calls=calls))  # raises on an unknown role
    return out


def _message_calls(value: Any) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` in Ollama's shape: [{function: {name, arguments: {...}}}]."""
    if value is None:
        return ()
    shape = "A message's 'tool_calls' must be a list of {\"function\": {\"name\", \"arguments\"}}."
    if not isinstance(value, list):
        raise APIError(400, shape)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, shape)
        arguments = function.get("arguments") or {}
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=f"call_{i}", name=function["name"], arguments=text))
    return tuple(calls)


def _tools(value: Any) -> list[dict[str, Any]]:
    try:
        return check_tools(value) if value else []
    except LLMLocalError as e:
        raise APIError(400, str(e), param="tools") from None


def _grammar(format_: Any) -> Grammar | None:
    """Ollama's ``format``: "json", or a JSON schema (an object)."""
    if format_ in (None, ""):
        return None
    if format_ == "json":
        return Grammar.json_object()
    if isinstance(format_, dict):
        return Grammar.json_schema(format_)
    raise APIError(400, "'format' must be \"json\" or a JSON schema object.", param="format")


def _sampling(options: Any, n_ctx: int, format_: Any = None) -> tuple[SamplingParams, int | None]:
    """Ollama's ``options`` (and ``format``) -> our sampling parameters, and num_ctx if given."""
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise APIError(400, "'options' must be an object of option names and values.")
    refuse_unknown(options, _OPTIONS, _NEUTRAL_OPTIONS, what="option")
    defaults = SamplingParams()
    values = {field: number(options, name, getattr(defaults, field), kind, f"options.{name}")
              for name, (field, kind) in _SAMPLING_OPTIONS.items()}
    if values["repeat_last_n"] < -1:
        raise APIError(400, "'options.repeat_last_n' must be -1 (the whole context), 0 (off) or more.")
    if values["repeat_last_n"] == -1:
        values["repeat_last_n"] = n_ctx
    predict = number(options, "num_predict", -1, int, "options.num_predict")
    if predict == 0 or predict < -2:
        raise APIError(400, "'options.num_predict' must be at least 1, or -1 for no limit.")
    num_ctx = number(options, "num_ctx", None, int, "options.num_ctx")
    sampling = SamplingParams(**values, max_tokens=predict if predict > 0 else None,
                              stop=stop_strings(options.get("stop"), "options.stop"), grammar=_grammar(format_))
    return sampling, num_ctx


def _within(handler: Handler, request: Request, num_ctx: int | None) -> Request:
    """``request`` kept within a context window of ``num_ctx`` tokens (at most the served one):
    the reply may take the room the prompt leaves."""
    served = handler.engine.n_ctx
    if num_ctx is None or num_ctx == served:
        return request
    if num_ctx > served:
        raise APIError(400, f"'options.num_ctx' is {num_ctx} but this server's context window is {served}: "
                       f"restart llmlocal serve with --ctx {num_ctx}, or lower num_ctx.", param="options.num_ctx")
    if num_ctx < 1:
        raise APIError(400, f"'options.num_ctx' must be at least 1, got {num_ctx}.", param="options.num_ctx")
    prompt = len(handler.engine.prompt_ids(request))
    if prompt >= num_ctx:
        raise ContextOverflowError(f"The prompt is {prompt} tokens but options.num_ctx is {num_ctx}: "
                                   f"raise num_ctx (up to {served}) or shorten the prompt.")
    room = num_ctx - prompt
    limit = min(request.sampling.max_tokens or room, room)
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, max_tokens=limit))


# ---- describing the model --------------------------------------------------------------------
def _summary(handler: Handler) -> dict[str, Any]:
    """The served model as one entry of /api/tags."""
    model = handler.engine.model
    try:
        mtime = os.path.getmtime(model.path)
    except OSError:
        mtime = handler.server.created
    size = model.spec.weight_bytes
    # Not the hash of the file's bytes (hashing gigabytes per listing is too slow), but it
    # changes whenever the file does, which is what clients compare digests for.
    digest = hashlib.sha256(f"{os.path.abspath(model.path)}:{size}:{mtime}".encode()).hexdigest()
    return {
        "name": model.name,
        "model": model.name,
        "modified_at": _rfc3339(mtime),
        "size": size,
        "digest": digest,
        "details": _details(model.spec),
    }


def _details(spec: ModelSpec) -> dict[str, Any]:
    n = spec.n_params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    return {"parent_model": "", "format": spec.format, "family": spec.architecture, "families": [spec.architecture],
            "parameter_size": size, "quantization_level": spec.file_type or ""}


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
