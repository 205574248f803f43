"""Tool calls: OpenAI's ``tools`` described to a model, and the calls it writes read back out.

A model calls a function by writing it in the format its chat template taught it. Two are read:

* Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of
  them, with text around them.
* Llama 3.x: the whole reply is ``{"name": ..., "parameters": {...}}`` (several joined by
  ``;``), optionally after ``<|python_tag|>``.

A chat template that knows no tools (the starter's) gets them described in a system message
in the Hermes format (`describe_tools`), and tool calls and results written back as text
(`plain_messages`). `call_grammar` forces the reply to be a call of one of the functions
with arguments valid against its ``parameters`` schema (``tool_choice`` "required", or a
named function).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmlocal.models.errors import LLMLocalError

from ..types import Grammar, Message, Request, SamplingParams, ToolCall

if TYPE_CHECKING:
    from ..engine import Engine

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x opens a call with it


# ---- the tools ---------------------------------------------------------------------------------
def check_tools(value: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools``, checked: a list of {"type": "function", "function": {name, description,
    parameters}}. `LLMLocalError` names what is wrong."""
    if not isinstance(value, list):
        raise LLMLocalError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects.")
    names = set()
    for tool in value:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise LLMLocalError("Each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}: "
                                "llmlocal calls functions only.")
        name, parameters = function.get("name"), function.get("parameters", {})
        if not isinstance(name, str) or not name:
            raise LLMLocalError("Each tool's function needs a 'name' (a non-empty string).")
        if name in names:
            raise LLMLocalError(f"Two tools are named '{name}': give each function its own name.")
        if not isinstance(parameters, dict):
            raise LLMLocalError(f"The 'parameters' of the function '{name}' must be a JSON schema object.")
        names.add(name)
    return value


def function_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def describe_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools as a system prompt tells them to a model whose template cannot (Hermes format)."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to answer the user. Their signatures are "
        f"within <tools></tools> tags:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments within "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def tool_request(engine: Engine, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], sampling: SamplingParams) -> Request:
    """A chat with tools, as a request (a `Request` carries no tools, so the prompt is rendered
    here and sent raw). A BOS the template wrote is left to the tokenizer when the model adds
    one itself, so that it is not there twice."""
    text = engine.render(messages, tools)
    special = engine.model.spec.special
    if special.bos and special.add_bos and text.startswith(special.bos):
        text = text[len(special.bos):]
    return Request(prompt=text, sampling=sampling)


def call_text(call: ToolCall) -> str:
    """One call as the model would have written it (Hermes format)."""
    body = json.dumps({"name": call.name, "arguments": _arguments_value(call.arguments)}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


# ---- messages for a chat template ---------------------------------------------------------------
def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates take them: an assistant's ``tool_calls`` with their
    ``arguments`` as objects, a tool result's ``tool_call_id``."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _arguments_value(c.arguments)}}
                                   for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def plain_messages(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tools described in the system message,
    calls written into the assistant's text, tool results as user turns in
    ``<tool_response>`` tags (consecutive results in one turn)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            response = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        elif m.tool_calls:
            text = "\n".join([m.content] * bool(m.content) + [call_text(c) for c in m.tool_calls])
            out.append({"role": m.role, "content": text})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{describe_tools(tools)}"
        else:
            out.insert(0, {"role": "system", "content": describe_tools(tools)})
    return [{"role": m["role"], "content": m["content"]} for m in out]


# ---- forcing a call ----------------------------------------------------------------------------
def call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None, parallel: bool = False,
                 tag_ids: tuple[int | None, int | None] = (None, None)) -> Grammar:
    """A Lark grammar (llguidance's dialect) whose sentences are Hermes-format calls of the
    function ``name`` (None: any of ``tools``), the arguments valid against its ``parameters``;
    one call, or with ``parallel`` one or more, a line apart. ``tag_ids``: the tokens that are
    ``<tool_call>`` and ``</tool_call>`` in the model's vocabulary, if it has them (`tag_ids`)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise LLMLocalError(f"There is no tool named '{name}' among the request's tools: name one of "
                            f"{', '.join(function_names(tools))}.")
    # A tag that is one special token (Qwen2.5's) is named by its id: as text it would be
    # spelled in other tokens than the one the model writes.
    open_, close = (f"<[{i}]>" if i is not None else json.dumps(tag) for i, tag in zip(tag_ids, (OPEN, CLOSE)))
    more = ' ("\\n" call)*' if parallel else ""
    rules = [f"start: call{more}",
             f'call: {open_} "\\n" function "\\n" {close}',
             "function: " + " | ".join(f"function_{i}" for i in range(len(chosen)))]
    for i, function in enumerate(chosen):
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        schema = function.get("parameters") or {"type": "object"}
        rules.append(f"function_{i}: {json.dumps(head)} arguments_{i} \"}}\"")
        rules.append(f"arguments_{i}: %json {json.dumps(schema)}")
    return Grammar.lark("\n".join(rules) + "\n")


def tag_ids(engine: Engine) -> tuple[int | None, int | None]:
    """The token ids of ``<tool_call>`` and ``</tool_call>`` where the vocabulary has each as
    one token, else None."""
    def one(tag: str) -> int | None:
        ids = engine.tokenize(tag, add_special=False)
        return ids[0] if len(ids) == 1 else None

    return one(OPEN), one(CLOSE)


# ---- reading calls back ------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """The calls in a reply, and the text outside them (None when there is none). A reply with
    no readable call is all text: ``(text, ())``; a tag around something that is not a call
    stays in the text."""
    calls = _llama_calls(text)
    if calls:
        return None, calls
    outside, calls = [], []
    rest = text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        body, closed, after = after.partition(CLOSE)
        call = _call(body)
        if call is None:
            outside.append(before + OPEN + body + closed)
        else:
            outside.append(before)
            calls.append(call)
        rest = after
    if not calls:
        return text, ()
    content = "".join([*outside, rest]).strip()
    return content or None, tuple(calls)


class ToolCallStream:
    """Reads calls out of a reply as it streams: `feed` each piece of text, then `finish`; both
    give what may be sent now, text (str) and whole calls (`ToolCall`), in order.

    Text that may open a call (a ``<`` that could begin ``<tool_call>``) is held until it is
    clear, and a call is given once it closes. A reply that opens with ``{`` or
    ``<|python_tag|>`` may be a Llama-style call and is held to its end. Whitespace is held
    until more text follows, so that the text around calls comes out as `parse_tool_calls`
    gives it."""

    def __init__(self) -> None:
        self._held = ""
        self._space = ""  # whitespace waiting for more text
        self._started = False  # some text went out
        self._whole: bool | None = None  # held to the end (Llama form)? None: not known yet
        self._in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        if self._whole is None:
            start = self._held.lstrip()
            if not start or PYTHON_TAG.startswith(start[:len(PYTHON_TAG)]) and len(start) < len(PYTHON_TAG):
                return []  # not known yet
            self._whole = start.startswith(("{", PYTHON_TAG))
        return [] if self._whole else self._scan()

    def finish(self) -> list[str | ToolCall]:
        if self._whole:
            content, calls = parse_tool_calls(self._held)
            self.calls += len(calls)
            return ([content] if content else []) + list(calls)
        out = self._scan()
        if self._in_call:
            call = _call(self._held)
            if call is None:
                out += self._text(OPEN + self._held)
            else:
                self.calls += 1
                out.append(call)
        else:
            out += self._text(self._held)
        if not self.calls and self._space:
            out.append(self._space)
        self._held = self._space = ""
        return out

    def _scan(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                body, closed, rest = self._held.partition(CLOSE)
                if not closed:
                    return out
                call = _call(body)
                if call is None:
                    out += self._text(OPEN + body + CLOSE)
                else:
                    self.calls += 1
                    out.append(call)
                self._held, self._in_call = rest, False
            else:
                before, opened, rest = self._held.partition(OPEN)
                if not opened:
                    keep = _partial_suffix(self._held, OPEN)
                    out += self._text(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    return out
                out += self._text(before)
                self._held, self._in_call = rest, True

    def _text(self, text: str) -> list[str | ToolCall]:
        """``text`` to send, its trailing whitespace held (leading whitespace too, before any)."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if not self._started and self.calls:
            body = body.lstrip()
        if not body:
            return []
        self._started = True
        return [body]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(body: str) -> ToolCall | None:
    """One Hermes call body, ``{"name": ..., "arguments": {...}}``, or None if it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _as_call(value, "arguments")


def _as_call(value: Any, key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def _llama_calls(text: str) -> tuple[ToolCall, ...]:
    """Calls when the whole reply is Llama's JSON form, else ()."""
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    if not rest.startswith("{"):
        return ()
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return ()
        call = _as_call(value, "parameters")
        if call is None:
            return ()
        calls.append(call)
        rest = rest[end:].strip().removeprefix(";").strip()
    return tuple(calls)


def _arguments_value(arguments: str) -> Any:
    """A call's arguments (JSON text) as the object templates write with ``tojson``."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (it may be opening)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
