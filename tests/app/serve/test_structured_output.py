"""Structured output through `llmlocal serve`: OpenAI's `response_format` with the real
`openai` client, and Ollama's `format`, on the starter model over loopback."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from test_serve import post, served  # noqa: F401 - `served` is a fixture
from llmlocal.app.serve.server import OpenAIServer

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genre": {"enum": ["novel", "poetry", "history", "science"]},
        "authors": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}},
                      "required": ["name"], "additionalProperties": False},
        },
    },
    "required": ["title", "year", "genre", "authors"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a famous book as JSON."}]


@pytest.fixture(scope="module")
def client(served: OpenAIServer) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "book", "schema": schema, "strict": True}}


def test_json_schema_replies_validate_with_the_openai_client(client: openai.OpenAI) -> None:
    for seed in range(5):
        out = client.chat.completions.create(model="smollm2-135m", messages=ASK, temperature=1.0, seed=seed,  # type: ignore[arg-type]
                                             max_tokens=200, response_format=schema_format(BOOK))  # type: ignore[arg-type]
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), BOOK)


def test_json_object_streamed_and_on_completions(client: openai.OpenAI) -> None:
    short = [{"role": "user", "content": "Answer in JSON with one key, answer: is water wet?"}]
    chunks = client.chat.completions.create(model="smollm2-135m", messages=short, temperature=0, max_tokens=64,  # type: ignore[arg-type]
                                            stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    cat = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
           "required": ["name", "age"], "additionalProperties": False}
    out = client.completions.create(model="smollm2-135m", prompt="A JSON object describing a cat:", temperature=0,
                                    max_tokens=64, extra_body={"response_format": schema_format(cat)})
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    jsonschema.validate(json.loads(out.choices[0].text), cat)


def test_a_schema_that_does_not_compile_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="grammar does not compile"):
        client.chat.completions.create(model="smollm2-135m", messages=ASK,  # type: ignore[arg-type]
                                       response_format=schema_format({"type": "objec"}))  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="'type' is text, json_object or json_schema"):
        client.chat.completions.create(model="smollm2-135m", messages=ASK, response_format={"type": "yaml"})  # type: ignore[arg-type]


def test_ollama_format_schema_and_json(served: OpenAIServer) -> None:  # noqa: F811
    for seed in range(3):
        status, out = post(served.url + "/api/chat", {"model": "smollm2-135m", "messages": ASK, "stream": False, "format": BOOK,
                                                      "options": {"temperature": 1.0, "seed": seed, "num_predict": 200}})
        assert status == 200 and out["done_reason"] == "stop", out
        jsonschema.validate(json.loads(out["message"]["content"]), BOOK)
    status, out = post(served.url + "/api/generate", {"model": "smollm2-135m", "prompt": "Answer in JSON: is water wet?",
                                                      "stream": False, "format": "json", "options": {"temperature": 0}})
    assert status == 200 and isinstance(json.loads(out["response"]), dict), out
