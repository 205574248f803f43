"""Ollama's API on `llmlocal serve`: real HTTP requests in Ollama's wire format against the
starter model on loopback, checked against the same requests through the OpenAI routes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime
from importlib import metadata
from typing import Any

import pytest
from test_serve import QUESTION, get, post, served  # noqa: F401 - `served` is a fixture
from llmlocal.app.serve.server import OpenAIServer
from llmlocal.engine import Engine

PROMPT = "Why is the sky blue?"
TIMINGS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")


def ndjson(url: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """POST ``body`` and read the answer as Ollama streams it: one JSON object a line."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return r.headers["Content-Type"], [json.loads(line) for line in r.read().decode().splitlines()]


def openai_text(served: OpenAIServer, body: dict[str, Any], chat: bool) -> tuple[str, dict[str, Any]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, out = post(served.url + path, body)
    assert status == 200, out
    choice = out["choices"][0]
    return (choice["message"]["content"] if chat else choice["text"]), out["usage"]


def check_final(final: dict[str, Any], reason: str, prompt_tokens: int, completion_tokens: int) -> None:
    assert final["done"] is True and final["done_reason"] == reason and final["model"] == "smollm2-135m"
    assert all(isinstance(final[k], int) for k in TIMINGS)
    assert (final["prompt_eval_count"], final["eval_count"], final["load_duration"]) == (prompt_tokens, completion_tokens, 0)
    assert final["prompt_eval_duration"] > 0 and final["eval_duration"] > 0
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    assert final["created_at"].endswith("Z") and datetime.fromisoformat(final["created_at"]).tzinfo is not None


def test_version_tags_and_show(served: OpenAIServer, engine: Engine) -> None:
    assert get(served.url + "/api/version") == (200, {"version": metadata.version("llmlocal")})

    status, tags = get(served.url + "/api/tags")
    assert status == 200 and len(tags["models"]) == 1
    model = tags["models"][0]
    assert model["name"] == model["model"] == "smollm2-135m"
    assert model["size"] == engine.model.spec.weight_bytes and len(model["digest"]) == 64
    assert model["details"] == {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                                "parameter_size": "134.52M", "quantization_level": "Q4_1"}
    assert datetime.fromisoformat(model["modified_at"]).tzinfo is not None

    status, shown = post(served.url + "/api/show", {"model": "smollm2-135m:latest"})
    assert status == 200 and shown["details"] == model["details"] and shown["capabilities"] == ["completion"]
    info = shown["model_info"]
    assert (info["general.architecture"], info["llama.context_length"], info["llama.block_count"]) == ("llama", 2048, 30)
    assert "num_ctx 2048" in shown["parameters"].splitlines()
    assert shown["template"] == engine.model.spec.chat_template

    assert post(served.url + "/api/show", {"model": "llama3"}) == (
        404, {"error": "The model 'llama3' is not served here: this server serves 'smollm2-135m'."})


def test_generate_and_chat_whole_equal_the_openai_routes_when_greedy(served: OpenAIServer) -> None:
    options = {"temperature": 0, "num_predict": 8}
    cases = [  # (Ollama path, Ollama body, the same request through the OpenAI API)
        ("/api/generate", {"prompt": PROMPT}, {"messages": [{"role": "user", "content": PROMPT}]}, True),
        ("/api/generate", {"prompt": PROMPT, "system": "Answer like a pirate."},
         {"messages": [{"role": "system", "content": "Answer like a pirate."}, {"role": "user", "content": PROMPT}]}, True),
        ("/api/generate", {"prompt": "The capital of France is", "raw": True}, {"prompt": "The capital of France is"}, False),
        ("/api/chat", {"messages": QUESTION}, {"messages": QUESTION}, True),
    ]
    for path, body, same, chat in cases:
        status, out = post(served.url + path, {"model": "smollm2-135m", **body, "stream": False, "options": options, "keep_alive": "5m"})
        assert status == 200, out
        text, usage = openai_text(served, {**same, "temperature": 0, "max_tokens": 8}, chat=chat)
        got = out["message"] if path == "/api/chat" else out["response"]
        assert got == ({"role": "assistant", "content": text} if path == "/api/chat" else text), (path, body)
        check_final(out, "length", usage["prompt_tokens"], 8)


def test_streams_are_ndjson_by_default(served: OpenAIServer) -> None:
    for path, body, key in [("/api/generate", {"prompt": PROMPT}, "response"), ("/api/chat", {"messages": QUESTION}, "message")]:
        options = {"temperature": 0, "num_predict": 10}
        content_type, lines = ndjson(served.url + path, {"model": "smollm2-135m", **body, "options": options})
        assert content_type == "application/x-ndjson"
        *pieces, final = lines
        assert len(pieces) >= 2 and all(p["done"] is False and set(p) == {"model", "created_at", key, "done"} for p in pieces)
        if key == "message":
            assert all(p["message"]["role"] == "assistant" for p in pieces) and final["message"]["content"] == ""
            streamed = "".join(p["message"]["content"] for p in pieces)
        else:
            assert final["response"] == ""
            streamed = "".join(p["response"] for p in pieces)
        status, whole = post(served.url + path, {"model": "smollm2-135m", **body, "options": options, "stream": False})
        assert streamed == (whole["message"]["content"] if key == "message" else whole["response"])
        check_final(final, "length", whole["prompt_eval_count"], 10)


def test_options_map_onto_the_engine(served: OpenAIServer, engine: Engine) -> None:
    # Sampling at temperature 1: the same seed and filters give the same text on both routes,
    # and another seed another text, so the options reach the sampler.
    def sampled(seed: int) -> str:
        options = {"temperature": 1.0, "seed": seed, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "repeat_penalty": 1.1,
                   "num_predict": 16}
        status, out = post(served.url + "/api/chat", {"messages": QUESTION, "options": options, "stream": False})
        assert status == 200, out
        text, _ = openai_text(served, {"messages": QUESTION, "temperature": 1.0, "seed": seed, "top_k": 20, "top_p": 0.9,
                                       "min_p": 0.02, "repeat_penalty": 1.1, "max_tokens": 16}, chat=True)
        assert out["message"]["content"] == text
        return text

    assert len({sampled(seed) for seed in (1, 2, 3)}) > 1

    # stop: the reply ends before the stop string, as through the OpenAI route.
    greedy, usage = openai_text(served, {"messages": QUESTION, "temperature": 0, "max_tokens": 12}, chat=True)
    word = greedy.split()[3]
    status, out = post(served.url + "/api/chat", {"messages": QUESTION, "stream": False,
                                                  "options": {"temperature": 0, "num_predict": 12, "stop": [word]}})
    assert out["done_reason"] == "stop" and word not in out["message"]["content"] and greedy.startswith(out["message"]["content"])

    # num_ctx below the served window: prompt and reply stay within it.
    status, out = post(served.url + "/api/chat", {"messages": QUESTION, "stream": False,
                                                  "options": {"temperature": 0, "num_ctx": usage["prompt_tokens"] + 3}})
    assert status == 200 and out["eval_count"] == 3 and out["done_reason"] == "length"
    assert greedy.startswith(out["message"]["content"])
    status, out = post(served.url + "/api/chat", {"messages": QUESTION, "options": {"num_ctx": usage["prompt_tokens"] - 1}})
    assert status == 400 and f"The prompt is {usage['prompt_tokens']} tokens but options.num_ctx is" in out["error"]

    # -1 is Ollama's "no limit" for num_predict and "the whole context" for repeat_last_n; null
    # options and options at values that ask for nothing are accepted.
    status, out = post(served.url + "/api/generate", {"prompt": PROMPT, "stream": False, "options": {
        "temperature": 0, "num_predict": -1, "repeat_last_n": -1, "num_ctx": 60, "mirostat": 0, "typical_p": None}})
    assert status == 200 and 0 < out["eval_count"] and out["prompt_eval_count"] + out["eval_count"] <= 60


def test_a_request_without_a_prompt_only_loads(served: OpenAIServer) -> None:
    for path, body in [("/api/generate", {"prompt": ""}), ("/api/chat", {"messages": []}), ("/api/generate", {"keep_alive": 0})]:
        status, out = post(served.url + path, {"model": "smollm2-135m", **body})
        assert status == 200 and out["done"] is True and out["done_reason"] == "load" and "eval_count" not in out


@pytest.mark.parametrize(
    ("path", "body", "status", "phrase"),
    [
        ("/api/chat", {"options": {"mirostat": 2}}, 400, "does not implement the option 'mirostat'"),
        ("/api/chat", {"options": {"temperature": 0, "num_gpu": 1, "flux": 2}}, 400, "the options 'flux', 'num_gpu'"),
        ("/api/chat", {"options": {"temperature": "hot"}}, 400, "'options.temperature' must be a number"),
        ("/api/chat", {"options": {"num_ctx": 4096}}, 400, "'options.num_ctx' is 4096 but this server's context window is 2048"),
        ("/api/chat", {"options": {"num_predict": 0}}, 400, "'options.num_predict' must be at least 1"),
        ("/api/chat", {"options": {"stop": 3}}, 400, "'options.stop' must be a string or a list of strings"),
        ("/api/chat", {"format": "yaml"}, 400, "'format' must be \"json\" or a JSON schema"),
        ("/api/chat", {"format": {"type": "objec"}}, 400, "grammar does not compile"),
        ("/api/generate", {"template": "{{ .Prompt }}"}, 400, "cannot run an Ollama 'template'"),
        ("/api/generate", {"system": "Be brief.", "raw": True}, 400, "remove 'system' or 'raw'"),
        ("/api/generate", {"images": ["aGk="]}, 400, "the field 'images'"),
        ("/api/generate", {"suffix": "return x"}, 400, "the field 'suffix'"),
        ("/api/generate", {"context": [1, 2, 3]}, 400, "the field 'context'"),
        ("/api/generate", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "the field 'tools'"),  # chat only
        ("/api/chat", {"tools": [{"type": "retrieval"}]}, 400, "llmlocal calls functions only"),
        ("/api/chat", {"think": True}, 400, "the field 'think'"),
        ("/api/chat", {"verbosity": 3}, 400, "the field 'verbosity'"),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "message field 'images'"),
        ("/api/chat", {"messages": [{"role": "wizard", "content": "42"}]}, 400, "Unknown chat role 'wizard'"),
        ("/api/chat", {"stream": "yes"}, 400, "'stream' must be true or false"),
        ("/api/chat", {"model": "llama3:8b"}, 404, "this server serves 'smollm2-135m'"),
        ("/api/pull", {"model": "llama3"}, 404, "There is no POST /api/pull here"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(served: OpenAIServer, path: str, body: dict[str, Any], status: int, phrase: str) -> None:
    base = {"model": "smollm2-135m", "prompt": PROMPT} if path == "/api/generate" else {"model": "smollm2-135m", "messages": QUESTION}
    got, out = post(served.url + path, {**base, **body})
    assert got == status and set(out) == {"error"} and phrase in out["error"], out


def test_a_prompt_over_the_window_is_a_400_before_the_stream_starts(served: OpenAIServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        ndjson(served.url + "/api/chat", {"messages": [{"role": "user", "content": "word " * 2100}]})
    assert caught.value.code == 400 and "context window is 2048" in json.loads(caught.value.read())["error"]


TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"], "additionalProperties": False}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone.", "parameters": TIME}}


def test_chat_tools_come_back_as_tool_calls_with_object_arguments(served: OpenAIServer) -> None:
    # Ollama has no tool_choice: `format` holds the starter to a Llama-style call, which the
    # server reads back as a tool call, whole and streamed.
    call = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": TIME},
            "required": ["name", "parameters"], "additionalProperties": False}
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "What time is it in Tokyo?"}], "tools": [TIME_TOOL],
            "format": call, "options": {"temperature": 0, "num_predict": 64}}
    status, out = post(served.url + "/api/chat", {**body, "stream": False})
    assert status == 200 and out["done"] and out["message"]["content"] == "", out
    [whole] = out["message"]["tool_calls"]
    assert whole["function"]["name"] == "get_time" and isinstance(whole["function"]["arguments"]["zone"], str)
    _, lines = ndjson(served.url + "/api/chat", body)
    streamed = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert streamed == [whole] and "".join(line["message"]["content"] for line in lines) == "" and lines[-1]["done"]

    # The call and its result go back in (test_tools checks how they are rendered).
    history = [*body["messages"], {"role": "assistant", "content": "", "tool_calls": [whole]},
               {"role": "tool", "content": "09:30", "tool_name": "get_time"}]
    status, out = post(served.url + "/api/chat", {"model": "smollm2-135m", "messages": history, "tools": [TIME_TOOL],
                                                  "stream": False, "options": {"temperature": 0, "num_predict": 8}})
    assert status == 200 and out["done"], out
