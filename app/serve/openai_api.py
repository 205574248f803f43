"""OpenAI's API on `llmlocal serve` (the routes `serve.Handler` dispatches to):

    GET  /v1/models              the one model served (with max_model_len = the context window)
    POST /v1/chat/completions    chat messages, rendered with the model's template
    POST /v1/completions         a raw prompt
    POST /tokenize, /detokenize  the model's tokenizer (vLLM's request and answer shapes)
    POST /apply-template         the prompt text of chat messages (llama.cpp's shapes)

Both completion endpoints stream server-sent events with ``"stream": true``, and report
``usage`` (with ``stream_options.include_usage`` when streaming) plus the engine's own
`Stats` under the ``llmlocal`` key. ``response_format`` (json_object, json_schema) and
``logprobs`` / ``top_logprobs`` go through the engine. A request field llmlocal does not
implement gets a 400 naming it, unless its value asks for nothing (``"logprobs": false``,
``"tools": []``).

Chat completions take ``tools`` and ``tool_choice`` (`tool_calls`): the tools are rendered by
the model's template (or described in the system message), the calls the model writes come
back as ``message.tool_calls`` with ``finish_reason: "tool_calls"`` (streamed as OpenAI
streams them: a call's id and name, then its arguments, once the call is complete), and
``tool_choice`` "required" or a named function forces a valid call through the engine's
grammar (one call; with ``"parallel_tool_calls": true`` "required" allows several).
Assistant messages with ``tool_calls`` and ``role: "tool"`` results go back into the prompt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmlocal.engine.prompt.tool_calls import (
    ToolCallStream,
    call_grammar,
    check_tools,
    parse_tool_calls,
    tag_ids,
    tool_request,
)
from llmlocal.engine.types import (
    DoneEvent,
    Grammar,
    Message,
    Request,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    ToolCall,
)
from llmlocal.models.errors import LLMLocalError

from .protocol import FINISH, APIError, number, refuse_unknown, stop_strings

if TYPE_CHECKING:
    from llmlocal.engine.engine import Engine

    from .server import Handler

# OpenAI request fields, by endpoint: what llmlocal honours, and the fields it does not
# implement that a client may still send at a value asking for nothing (null always is).
_SAMPLING_FIELDS = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
                    "repeat_penalty", "repetition_penalty", "seed", "max_tokens", "stop", "n", "user", "response_format"}
_FIELDS = {True: _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                                      "parallel_tool_calls"},
           False: _SAMPLING_FIELDS | {"prompt", "logprobs"}}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,), "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (True, False), "store": (False,),
}


# ---- endpoints -------------------------------------------------------------------------------
def models(handler: Handler, _: Any) -> dict[str, Any]:
    entry = {
        "id": handler.server.model_name,
        "object": "model",
        "created": handler.server.created,
        "owned_by": "llmlocal",
        "max_model_len": handler.engine.n_ctx,
        "architecture": handler.engine.model.spec.architecture,
        "backend": handler.engine.backend_name,
        "device": handler.engine.device,
    }
    return {"object": "list", "data": [entry]}


def tokenize(handler: Handler, body: dict[str, Any]) -> dict[str, Any]:
    _check_model(handler, body)
    if "messages" in body:
        # NOTE: the generation prompt is always appended (Engine.render's contract).
        tokens = handler.engine.prompt_ids(Request.chat(_messages(body["messages"])))
    elif isinstance(body.get("prompt"), str):
        tokens = handler.engine.tokenize(body["prompt"], add_special=bool(body.get("add_special_tokens", True)))
    else:
        raise APIError(400, "Pass 'prompt' (a string) or 'messages' to tokenize.")
    return {"count": len(tokens), "max_model_len": handler.engine.n_ctx, "tokens": tokens}


def detokenize(handler: Handler, body: dict[str, Any]) -> dict[str, Any]:
    _check_model(handler, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise APIError(400, "Pass 'tokens', a list of token ids.")
    return {"prompt": handler.engine.backend.detokenize(tokens)}


def apply_template(handler: Handler, body: dict[str, Any]) -> dict[str, Any]:
    tools, _ = _tools(body, handler.engine)
    return {"prompt": handler.engine.render(_messages(body.get("messages")), tools)}


def complete(handler: Handler, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    refuse_unknown(body, _FIELDS[chat], _NEUTRAL)
    options = body.get("stream_options") or {}
    refuse_unknown({f"stream_options.{k}": v for k, v in options.items()}, {"stream_options.include_usage"}, {})
    _check_model(handler, body)
    tools, forced = _tools(body, handler.engine) if chat else ([], None)
    request = _request(body, chat, handler.engine, tools, forced)
    reply = OpenAIReply(handler.server.model_name, request, chat, include_usage=bool(options.get("include_usage")),
                        token_bytes=handler.engine.token_bytes, tools=bool(tools))
    return handler.respond(request, reply, stream=bool(body.get("stream")))


ROUTES: dict[tuple[str, str], Callable[[Handler, Any], Any]] = {
    ("GET", "/v1/models"): models,
    ("POST", "/v1/chat/completions"): lambda handler, body: complete(handler, body, chat=True),
    ("POST", "/v1/completions"): lambda handler, body: complete(handler, body, chat=False),
    ("POST", "/tokenize"): tokenize,
    ("POST", "/detokenize"): detokenize,
    ("POST", "/apply-template"): apply_template,
}


def _check_model(handler: Handler, body: dict[str, Any]) -> None:
    model, served = body.get("model"), handler.server.model_name
    if model not in (None, "", served):
        raise APIError(404, f"The model '{model}' is not served here: this server serves '{served}'.", "model_not_found")


# ---- the answer ------------------------------------------------------------------------------
@dataclass
class OpenAIReply:
    """A generation in OpenAI's words: SSE chunks of deltas, or a (chat) completion object."""

    model: str
    request: Request
    chat: bool
    include_usage: bool
    token_bytes: Callable[[int], bytes]
    tools: bool = False  # read tool calls out of the replies
    content_type = "text/event-stream; charset=utf-8"
    _offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset, per sample
    _calls: dict[int, ToolCallStream] = field(default_factory=dict)  # per sample, when streaming with tools

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
        if self.tools:
            return self._tool_chunks(event.index, self._calls_of(event.index).feed(event.text), event.logprobs) or None
        piece: dict[str, Any] = {"index": event.index, "finish_reason": None, "logprobs": self._logprobs(event.index, event.logprobs)}
        piece["delta" if self.chat else "text"] = {"content": event.text} if self.chat else event.text
        return self._chunk(piece)

    def done(self, event: DoneEvent) -> Any | None:
        held, finish = [], FINISH[event.finish_reason]
        if self.tools:  # what the sample's tool-call reader still held, then the end
            calls = self._calls_of(event.index)
            held = self._tool_chunks(event.index, calls.finish(), ())
            finish = "tool_calls" if calls.calls and event.finish_reason == "stop" else finish
        end: dict[str, Any] = {"index": event.index, "finish_reason": finish, "logprobs": None}
        end["delta" if self.chat else "text"] = {} if self.chat else ""
        last = {**self._chunk(end), "llmlocal": {**event.stats.to_dict(), "finish_reason": event.finish_reason}}
        return [*held, last] if held else last

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
                content, calls = parse_tool_calls(d.text) if self.tools else (d.text, ())
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": [_call_json(c) for c in calls]}
                    choice["finish_reason"] = "tool_calls" if d.finish_reason == "stop" else choice["finish_reason"]
            else:
                choice["text"] = d.text
            choices.append(choice)
        return {**self.envelope(chunk=False), "choices": choices, **_usage(done)}

    def error(self, message: str) -> Any:
        return APIError(400, message).body()

    def frame(self, item: Any) -> bytes:
        if isinstance(item, list):  # several chunks for one event (a tool call)
            return b"".join(self.frame(one) for one in item)
        data = item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)
        return b"data: " + data.encode() + b"\n\n"

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.envelope(chunk=True), "choices": [choice]}

    def _calls_of(self, index: int) -> ToolCallStream:
        return self._calls.setdefault(index, ToolCallStream())

    def _tool_chunks(self, index: int, pieces: list[str | ToolCall], logprobs: tuple[TokenLogprob, ...]) -> list[Any]:
        """Chunks for what a sample's `ToolCallStream` let out: text as content deltas; a call as
        OpenAI streams one, its id and name first, then its arguments. The event's logprobs go
        with the first chunk (an empty content delta when everything is held back)."""
        deltas: list[dict[str, Any]] = []
        calls = self._calls_of(index).calls - sum(isinstance(p, ToolCall) for p in pieces)  # calls sent before these
        for piece in pieces:
            if isinstance(piece, str):
                deltas.append({"content": piece})
                continue
            head = {"index": calls, "id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
            deltas += [{"tool_calls": [head]}, {"tool_calls": [{"index": calls, "function": {"arguments": piece.arguments}}]}]
            calls += 1
        if not deltas and logprobs and self.request.sampling.logprobs is not None:
            deltas.append({"content": ""})
        return [self._chunk({"index": index, "delta": delta, "finish_reason": None,
                             "logprobs": self._logprobs(index, logprobs) if i == 0 else None})
                for i, delta in enumerate(deltas)]

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



# ---- reading requests ------------------------------------------------------------------------
def _messages(value: Any) -> list[Message]:
    """OpenAI chat messages -> ours; content may be a string or a list of text parts, and is
    null in an assistant message that calls tools."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.")
    out = []
    for m in value:
        if not isinstance(m, dict):
            raise APIError(400, "Each message must be an object with 'role' and 'content'.")
        refuse_unknown(m, {"role", "content", "tool_calls", "tool_call_id"}, {"annotations": ([],)}, what="message field")
        role = "system" if m.get("role") == "developer" else m.get("role")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise APIError(400, "Only text message parts are supported: send {'type': 'text', 'text': ...} parts.")
            content = "".join(str(p.get("text", "")) for p in content)
        calls = _message_calls(m.get("tool_calls"))
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"A {role} message needs its 'content' as a string.")
        tool_call_id = m.get("tool_call_id")
        if tool_call_id is not None and (role != "tool" or not isinstance(tool_call_id, str)):
            raise APIError(400, "'tool_call_id' belongs to a tool message, as a string: the id of the call it answers.")
        out.append(Message(role=role, content=content, tool_calls=calls, tool_call_id=tool_call_id))  # raises on an unknown role
    return out


def _message_calls(value: Any) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: [{id, type: "function", function: {name, arguments}}]."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise APIError(400, "A message's 'tool_calls' must be a list of calls.", param="tool_calls")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, "Each of a message's 'tool_calls' must be {\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}.", param="tool_calls")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=str(call.get("id") or ""), name=function["name"], arguments=arguments))
    return tuple(calls)


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tools(body: dict[str, Any], engine: Engine) -> tuple[list[dict[str, Any]], Grammar | None]:
    """The tools the prompt shows (none with ``tool_choice: "none"``), and the grammar that
    forces a call ("required", or a named function)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools': send the functions the model may call.", param="tool_choice")
        return [], None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be true or false.", param="parallel_tool_calls")
    try:
        check_tools(tools)
        if choice in (None, "auto"):
            return tools, None
        if choice == "none":
            return [], None
        if choice == "required":
            # One call unless several are asked for: a model free to go on calling tends to
            # repeat its call until max_tokens cuts the last one.
            return tools, call_grammar(tools, parallel=parallel is True, tag_ids=tag_ids(engine))
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
        return tools, call_grammar(tools, name, tag_ids=tag_ids(engine))
    except LLMLocalError as e:
        raise APIError(400, str(e), param="tool_choice" if "tool named" in str(e) else "tools") from None



def _request(body: dict[str, Any], chat: bool, engine: Engine, tools: list[dict[str, Any]], forced: Grammar | None) -> Request:
    """The request a body asks for; with ``tools``, its prompt rendered here (a `Request`
    carries no tools), and ``forced`` (a grammar of tool calls) in place of response_format."""
    grammar = response_format(body.get("response_format"))
    if forced is not None and grammar is not None:
        raise APIError(400, "A forced tool call ('tool_choice' required or a named function) and a 'response_format' "
                       "cannot both shape the reply: drop one.", param="response_format")
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
        grammar=forced or grammar,
        logprobs=_logprobs(body, chat),
    )
    if chat and tools:
        return tool_request(engine, _messages(body.get("messages")), tools, sampling)
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
