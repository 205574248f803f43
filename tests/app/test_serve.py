"""`llmlocal serve`: the Engine behind an OpenAI-compatible API, checked with llmlocal's own
remote backend as the client (a round trip), with plain HTTP, with concurrent requests on the
batching paged engine, and with a stream the client abandons."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from llmlocal.engine import (
    ContextOverflowError,
    DoneEvent,
    Engine,
    Plan,
    Request,
    SamplingParams,
)
from llmlocal.engine.serve import OpenAIServer
from llmlocal.models.errors import LLMLocalError

QUESTION = [{"role": "user", "content": "What color is the sky on a clear day?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def served(engine: Engine) -> Iterator[OpenAIServer]:
    """The shared llamacpp engine (n_ctx 2048) on a free loopback port, logging to a buffer."""
    server = OpenAIServer(engine, "127.0.0.1", 0, log=io.StringIO())
    thread = server.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def client(served: OpenAIServer) -> Iterator[Engine]:
    with Engine.load(Plan(endpoint=served.url)) as e:
        yield e


def final(engine: Engine, request: Request) -> DoneEvent:
    events = list(engine.generate(request))
    assert isinstance(events[-1], DoneEvent)
    assert "".join(e.text for e in events[:-1]) == events[-1].text
    return events[-1]


def post(url: str, body: Any, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_round_trip_through_the_remote_backend(client: Engine, engine: Engine) -> None:
    assert (client.model.name, client.backend_name, client.n_ctx) == ("smollm2-135m", "remote", 2048)
    assert client.model.spec.architecture == "llama"
    # The server tokenizes chats for its clients, so counts are exact and equal the local ones.
    assert client.exact_token_counts and client.count_tokens(QUESTION) == engine.count_tokens(QUESTION)
    assert client.render(QUESTION) == engine.render(QUESTION)
    assert client.tokenize("Hello world") == engine.tokenize("Hello world")

    remote = final(client, Request.chat(QUESTION, GREEDY))
    local = final(engine, Request.chat(QUESTION, GREEDY))
    assert remote.text == local.text and remote.finish_reason == local.finish_reason == "length"
    s = remote.stats
    assert (s.backend, s.prompt_tokens, s.completion_tokens) == ("remote", local.stats.prompt_tokens, 12)
    assert s.cached_prompt_tokens is not None  # the server's own figure, passed through
    assert s.ttft_s > 0 and s.decode_tok_s > 0 and s.prefill_tok_s > 0

    prompt = Request(prompt="The capital of France is", sampling=SamplingParams(temperature=0, max_tokens=6))
    assert final(client, prompt).text == final(engine, prompt).text

    word = local.text.split()[3]
    stopped = final(client, Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12, stop=(word,))))
    assert stopped.finish_reason == "stop" and word not in stopped.text


def test_plain_http_clients(served: OpenAIServer, engine: Engine) -> None:
    status, models = _get(served.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "smollm2-135m" and models["data"][0]["max_model_len"] == 2048

    status, out = post(served.url + "/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 12})
    local = final(engine, Request.chat(QUESTION, GREEDY))
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": local.text}
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == local.stats.prompt_tokens and out["usage"]["completion_tokens"] == 12
    assert out["llmlocal"]["backend"] == "llamacpp" and out["llmlocal"]["ttft_s"] > 0

    status, out = post(served.url + "/v1/completions", {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 4, "n": 2})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["text"] == out["choices"][1]["text"] and out["usage"]["completion_tokens"] == 8

    status, out = post(served.url + "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert out["tokens"] == engine.tokenize("Hello world", add_special=False) and out["count"] == len(out["tokens"])
    status, out = post(served.url + "/detokenize", {"tokens": out["tokens"]})
    assert out == {"prompt": "Hello world"}


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "phrase"),
    [
        ("/v1/chat/completions", {"model": "gpt-4", "messages": QUESTION}, 404, "model_not_found", "this server serves 'smollm2-135m'"),
        ("/v1/chat/completions", {"messages": QUESTION, "temperature": -1}, 400, None, "temperature must be >= 0"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, "Unknown chat role 'wizard'"),
        ("/v1/chat/completions", {"messages": []}, 400, None, "'messages' must be a non-empty list"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, None, "'prompt' must be one string"),
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/embeddings", {"input": "x"}, 404, "not_found", "There is no POST /v1/embeddings here"),
        ("/v1/completions", {"prompt": "word " * 2100}, 400, "context_length_exceeded", "context window is 2048"),
    ],
)
def test_bad_requests_get_openai_errors(served: OpenAIServer, path: str, body: Any, status: int, code: str | None, phrase: str) -> None:
    got, out = post(served.url + path, body)
    assert got == status
    assert out["error"]["code"] == code and phrase in out["error"]["message"]


def test_context_overflow_is_caught_before_sending(client: Engine) -> None:
    with pytest.raises(ContextOverflowError, match="server's context window is 2048"):
        client.generate(Request.chat([{"role": "user", "content": "word " * 2100}], GREEDY))


def test_an_abandoned_stream_cancels_the_request_on_the_server(served: OpenAIServer, client: Engine) -> None:
    long = Request.chat([{"role": "user", "content": "Write the numbers from 1 to 300, separated by commas."}],
                        SamplingParams(temperature=0, max_tokens=1500))
    seen = 0
    done = None
    for event in client.generate(long):
        if isinstance(event, DoneEvent):
            done = event
        else:
            seen += 1
            if seen == 3:
                client.cancel(long.id)
    assert done is not None and done.finish_reason == "cancelled"
    # The server noticed the client leave, cancelled its request and logged how it ended.
    line = _wait_for_log(served, "finish cancelled")
    completion = int(line.split(" completion tokens")[0].rsplit(" ", 1)[1])
    assert completion < 1500
    assert final(client, Request.chat(QUESTION, GREEDY)).finish_reason == "length"  # and serves on


def test_api_key(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LLMLOCAL_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    server = OpenAIServer(engine, "127.0.0.1", 0, api_key="s3cret")
    thread = server.start()
    try:
        status, out = post(server.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 401 and out["error"]["code"] == "invalid_api_key"
        with pytest.raises(LLMLocalError, match="needs an API key"):
            Engine.load(Plan(endpoint=server.url))
        with Engine.load(Plan(endpoint=server.url, api_key="s3cret")) as e:
            assert final(e, Request(prompt="Hi", sampling=SamplingParams(temperature=0, max_tokens=2))).stats.completion_tokens == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_concurrent_requests_are_batched_by_the_paged_engine() -> None:
    with Engine.load(Plan(backend="paged", n_ctx=1024, weights="dense", dtype="fp32", max_batch=4)) as paged:
        server = OpenAIServer(paged, "127.0.0.1", 0)
        thread = server.start()
        try:
            with Engine.load(Plan(endpoint=server.url)) as client:
                requests = [
                    Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8)),
                    Request.chat([{"role": "user", "content": "Write the numbers from 1 to 20, separated by commas."}],
                                 SamplingParams(temperature=0, max_tokens=24)),
                ]
                alone = [final(client, r) for r in requests]
                results: list[DoneEvent | None] = [None, None]
                start = threading.Barrier(2)

                def worker(i: int) -> None:
                    start.wait()
                    results[i] = final(client, Request.chat(requests[i].messages, requests[i].sampling))

                threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=300)
                assert [r.text for r in results] == [a.text for a in alone]  # type: ignore[union-attr]
                # The server's KV figures came through, and show the batching: the request that
                # finished first did so while the other still held blocks of the same pool.
                assert all(r.stats.kv_blocks_total == alone[0].stats.kv_blocks_total for r in results)  # type: ignore[union-attr]
                assert any(r.stats.kv_blocks_used > a.stats.kv_blocks_used for r, a in zip(results, alone))  # type: ignore[union-attr]
        finally:
            server.shutdown()
            server.server_close()
            thread.join()


def test_the_serve_command(starter_path: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "LLMLOCAL_SERVE_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmlocal.app", "serve", "--port", str(port), "--ctx", "512"],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        banner = proc.stderr.readline()  # printed once the model is loaded and the port is open
        assert banner.strip() == f"llmlocal serves smollm2-135m (paged on cpu, 512-token context) at http://127.0.0.1:{port}/v1 — Ctrl+C stops."
        status, models = _get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == 512
        status, out = post(f"http://127.0.0.1:{port}/v1/chat/completions", {"messages": QUESTION, "max_tokens": 3})
        assert status == 200 and out["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Stopped." in err and "Traceback" not in err

    result = subprocess.run([sys.executable, "-m", "llmlocal.app", "serve", "--endpoint", "http://x"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "llmlocal: serve runs a model on this machine; --endpoint is for chat and run: drop it."


def _get(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, json.loads(r.read())


def _wait_for_log(server: OpenAIServer, phrase: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.log.getvalue().splitlines():  # type: ignore[union-attr]
            if phrase in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no '{phrase}' in the server log: {server.log.getvalue()!r}")  # type: ignore[union-attr]
