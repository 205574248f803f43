"""Tool calls through `llmlocal serve`: OpenAI's ``tools`` and ``tool_choice`` with the real
`openai` client on the starter model over loopback (its template knows no tools, so they are
described in the system message), the formats calls are read from, and a slow check that the
real Qwen2.5 model, whose template renders tools itself, calls one when asked about the weather."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from test_serve import post, served  # noqa: F401 - `served` is a fixture
from llmlocal.app.serve.server import OpenAIServer
from llmlocal.engine import Engine, Plan
from llmlocal.engine.prompt.tool_calls import ToolCallStream, parse_tool_calls
from llmlocal.engine.types import Message, ToolCall

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client(served: OpenAIServer) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def check_call(name: str, arguments: str) -> None:
    """A call of one of TOOLS with arguments valid against its schema."""
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- reading calls ---------------------------------------------------------------------------
def test_hermes_calls_are_read_with_the_text_around_them() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # Arguments written as a JSON string, and a call the model did not close before it stopped.
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]


def test_llama_json_calls_are_read() -> None:
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    _, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": "a;b"}}; {"name": "get_time", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "a;b"}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild.",
    '{"city": "Paris"}',  # JSON, but not a call
    "<tool_call>not json</tool_call> and text",
    'Use {"name": "get_time", "parameters": {}} to ask.',  # a call in prose is prose
    "a < b, and <tool_ is not a tag",
])
def test_text_without_calls_stays_text(text: str) -> None:
    assert parse_tool_calls(text) == (text, ())


@pytest.mark.parametrize("text", [
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>\nOne moment.',
    '{"name": "get_time", "parameters": {"zone": "PST"}}',
    "Plain text, < and all.",
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',
    '<tool_call>not a call</tool_call> then <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
])
def test_streamed_reading_gives_what_reading_the_whole_gives(text: str) -> None:
    content, calls = parse_tool_calls(text)
    for size in (1, 2, 5, len(text)):
        stream, out = ToolCallStream(), []
        for i in range(0, len(text), size):
            out += stream.feed(text[i:i + size])
        out += stream.finish()
        streamed = "".join(p for p in out if isinstance(p, str)) or None
        assert (streamed, [(c.name, c.arguments) for c in out if isinstance(c, ToolCall)]) == (
            content, [(c.name, c.arguments) for c in calls])


# ---- rendering -------------------------------------------------------------------------------
def test_tools_calls_and_results_reach_the_prompt(engine: Engine) -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')
    messages = [Message("user", ASK[0]["content"]), Message("assistant", "", (call,)),
                Message("tool", "18 degrees and sunny", tool_call_id="call_1")]
    prompt = engine.render(messages, TOOLS)
    # The starter's template knows no tools: they are described in a system message, the
    # call and its result written into the turns.
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response><|im_end|>" in prompt
    assert "# Tools" not in engine.render(messages)  # no tools: none described, the turns still there
    assert "18 degrees and sunny" in engine.render(messages)


# ---- through the server ----------------------------------------------------------------------
def test_required_gives_a_valid_call_every_time(client: openai.OpenAI) -> None:
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                             temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls or []) == 1
        for call in choice.message.tool_calls or []:
            check_call(call.function.name, call.function.arguments)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,  # type: ignore[arg-type]
                                             max_tokens=200, tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = out.choices[0].message.tool_calls or []
        assert out.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
        check_call("get_time", calls[0].function.arguments)


def test_a_streamed_call_reassembles_to_the_same_call(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 3,
           "max_tokens": 200}
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls or []  # type: ignore[call-overload]
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for part in choice.delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = part.id or entry["id"]
                entry["name"] += part.function.name or "" if part.function else ""
                entry["arguments"] += part.function.arguments or "" if part.function else ""
    assert finish == "tool_calls" and sorted(calls) == list(range(len(whole))) and whole
    for i, call in enumerate(whole):
        streamed = calls[i]
        assert streamed["id"].startswith("call_")
        assert (streamed["name"], json.loads(streamed["arguments"])) == (call.function.name, json.loads(call.function.arguments))
        check_call(streamed["name"], streamed["arguments"])


def test_a_tool_result_round_trip(client: openai.OpenAI, served: OpenAIServer) -> None:  # noqa: F811
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                           temperature=0, max_tokens=200)
    assistant = first.choices[0].message
    assert assistant.tool_calls
    call = assistant.tool_calls[0]
    result = "It is 18 degrees and sunny in Paris."
    history = [*ASK, assistant.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": result}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The server renders the call and its result into the prompt the model saw.
    status, rendered = post(served.url + "/apply-template", {"messages": history, "tools": TOOLS})
    assert status == 200
    prompt = rendered["prompt"]
    assert f'"name": "{call.function.name}", "arguments": {json.dumps(json.loads(call.function.arguments))}' in prompt
    assert f"<tool_response>\n{result}\n</tool_response>" in prompt
    assert prompt.index(call.function.name + '", "arguments"') < prompt.index(result)


def test_tool_choice_none_is_plain_text(client: openai.OpenAI, engine: Engine) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                         temperature=0, max_tokens=24)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.content == plain.choices[0].message.content  # the tools were not in the prompt


@pytest.mark.parametrize(("body", "param", "phrase"), [
    ({"tool_choice": "required"}, "tool_choice", "'tool_choice' needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice", "no tool named 'launch'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'tool_choice' must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "llmlocal calls functions only"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "drop one"),
])
def test_bad_tool_requests_are_400s_that_say_why(served: OpenAIServer, body: dict[str, Any], param: str, phrase: str) -> None:  # noqa: F811
    status, out = post(served.url + "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and out["error"]["param"] == param and phrase in out["error"]["message"], out


# ---- a real model that knows tools -----------------------------------------------------------
QWEN = Path(os.environ.get("LLMLOCAL_DEV_MODELS", Path.home() / ".cache" / "llmlocal-dev")) / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LLMLOCAL_REAL_MODELS") != "1", reason="set LLMLOCAL_REAL_MODELS=1 to run")
@pytest.mark.skipif(not QWEN.is_file(), reason="run ../shared/models/fetch-real-models.sh")
def test_qwen_calls_tools_on_its_own_and_when_forced() -> None:
    with Engine.load(Plan(model=str(QWEN), backend="llamacpp", n_ctx=2048)) as qwen:
        assert qwen.template.knows_tools  # Qwen2.5's template renders the tools itself
        server = OpenAIServer(qwen, "127.0.0.1", 0)
        thread = server.start()
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            out = client.chat.completions.create(model=qwen.model.name, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                                 temperature=0, max_tokens=128)
            calls = out.choices[0].message.tool_calls or []
            assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message.content
            assert calls[0].function.name == "get_weather" and "paris" in json.loads(calls[0].function.arguments)["city"].lower()
            # Forced: its <tool_call> is one special token, which the grammar names by id.
            for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                out = client.chat.completions.create(model=qwen.model.name, messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                                     temperature=1.0, seed=1, max_tokens=128)
                calls = out.choices[0].message.tool_calls or []
                assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
                check_call(calls[0].function.name, calls[0].function.arguments)
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
