"""`llmlocal serve`: the Engine behind an OpenAI-compatible API, checked with llmlocal's own
remote backend as the client (a round trip), with plain HTTP, with concurrent requests on the
batching paged engine, and with a stream the client abandons."""

from __future__ import annotations

import io
import json
import os
import re
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
from llmlocal.app.serve.server import OpenAIServer
from llmlocal.engine import (
    ContextOverflowError,
    DoneEvent,
    Engine,
    Plan,
    Request,
    SamplingParams,
)
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
    status, models = get(served.url + "/v1/models")
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


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),  # chat only
        ("/v1/completions", "tool_choice", "auto"),
        ("/v1/chat/completions", "logit_bias", {"42": 5}),
        ("/v1/chat/completions", "frequency_penalty", 0.5),
        ("/v1/chat/completions", "presence_penalty", 1),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "reasoning_effort", "low"),
        ("/v1/completions", "echo", True),
        ("/v1/completions", "suffix", "return x"),
        ("/v1/completions", "best_of", 3),
        ("/v1/completions", "max_completion_tokens", 4),  # a chat field
    ],
)
def test_fields_llmlocal_does_not_implement_get_a_400_naming_them(served: OpenAIServer, path: str, field: str, value: Any) -> None:
    base = {"messages": QUESTION} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    got, out = post(served.url + path, {**base, "max_tokens": 2, field: value})
    assert got == 400 and out["error"]["param"] == field and out["error"]["code"] == "unsupported_parameter"
    assert out["error"]["message"] == f"llmlocal does not implement the field '{field}': remove it from the request."


def test_unimplemented_fields_are_named_together_and_defaults_pass(served: OpenAIServer) -> None:
    got, out = post(served.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi", "name": "ann"}], "stream": True, "stream_options": {"include_usage": True}})
    assert got == 400 and "the message field 'name'" in out["error"]["message"]
    got, out = post(served.url + "/v1/chat/completions", {"messages": QUESTION, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert got == 400 and "'stream_options.continuous_usage_stats'" in out["error"]["message"]
    got, out = post(served.url + "/v1/chat/completions", {"messages": QUESTION, "modalities": ["audio"], "logit_bias": {"5": 1}, "seed": 1})
    assert got == 400 and "the fields 'logit_bias', 'modalities': remove them" in out["error"]["message"]
    # Values that ask for nothing (what many clients send by default) are not refused.
    got, out = post(served.url + "/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 2, "tools": [], "tool_choice": "none", "logprobs": False, "frequency_penalty": 0,
        "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "user": "ann", "top_logprobs": None})
    assert got == 200 and out["usage"]["completion_tokens"] == 2


def test_max_completion_tokens_and_seed(served: OpenAIServer) -> None:
    got, out = post(served.url + "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 9, "max_completion_tokens": 3})
    assert got == 200 and out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"

    def sample(seed: int, path: str = "/v1/chat/completions") -> str:
        body = {"messages": QUESTION} if path == "/v1/chat/completions" else {"prompt": "Once upon a time"}
        got, out = post(served.url + path, {**body, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0, "seed": seed, "max_tokens": 16})
        assert got == 200
        choice = out["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    for path in ("/v1/chat/completions", "/v1/completions"):
        texts = [sample(seed, path) for seed in (5, 6, 7)]
        assert [sample(seed, path) for seed in (5, 6, 7)] == texts  # the same seed, the same sample
        assert len(set(texts)) > 1  # and the seed is what chose it


def test_cors_preflight_and_origin(engine: Engine) -> None:
    origin = "http://localhost:3000"
    server = OpenAIServer(engine, "127.0.0.1", 0, cors_origin=origin)
    plain = OpenAIServer(engine, "127.0.0.1", 0)
    threads = [server.start(), plain.start()]
    try:
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = call(server.url + "/v1/chat/completions", "OPTIONS", preflight)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        status, headers, body = call(server.url + "/v1/chat/completions", "POST", {"Origin": origin},
                                     {"messages": QUESTION, "max_tokens": 1})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin and headers["Vary"] == "Origin"
        status, headers, body = call(server.url + "/api/tags", "GET", {"Origin": origin})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin

        # Another origin, or a web app's on a server started without --cors-origin: no preflight,
        # no header, and its requests are refused (test_serve_access has the rest of the rules).
        for url, other in [(server.url, "http://evil.example"), (plain.url, "https://app.example.com")]:
            status, headers, body = call(url + "/v1/chat/completions", "OPTIONS", {**preflight, "Origin": other})
            assert status == 403 and "Access-Control-Allow-Origin" not in headers
            assert f"start the server with --cors-origin {other}" in body["error"]["message"]
            status, headers, _ = call(url + "/v1/models", "GET", {"Origin": other})
            assert status == 403 and "Access-Control-Allow-Origin" not in headers
    finally:
        for s in (server, plain):
            s.shutdown()
            s.server_close()
        for t in threads:
            t.join()


def test_metrics_count_requests_tokens_and_latencies(served: OpenAIServer) -> None:
    before = metrics(served.url)
    got, out = post(served.url + "/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 6})
    assert got == 200
    post(served.url + "/v1/chat/completions", {"messages": QUESTION, "tools": [{}]})  # a 400
    ok, refused = (f'llmlocal_requests_total{{path="/v1/chat/completions",status="{s}"}}' for s in (200, 400))

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    deadline = time.monotonic() + 60
    after = metrics(served.url)
    while not (delta(ok) and delta(refused)) and time.monotonic() < deadline:  # counted once answered
        time.sleep(0.05)
        after = metrics(served.url)
    assert delta(ok) == 1 and delta(refused) == 1
    assert delta('llmlocal_requests_total{path="/metrics",status="200"}') >= 1  # the scrapes count too
    assert delta("llmlocal_prompt_tokens_total") == out["usage"]["prompt_tokens"]
    assert delta("llmlocal_completion_tokens_total") == 6
    assert delta("llmlocal_time_to_first_token_seconds_count") == 1 and delta("llmlocal_time_to_first_token_seconds_sum") > 0
    assert delta("llmlocal_inter_token_latency_seconds_count") == 5  # 6 tokens, 5 gaps
    assert "llmlocal_kv_blocks_used" not in after  # llama.cpp keeps no block pool


def test_one_log_line_per_request_without_the_prompt(served: OpenAIServer, engine: Engine) -> None:
    secret = "Tell me about the aardvark named Quillby."
    got, out = post(served.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": secret}], "temperature": 0, "max_tokens": 4})
    request_id = out["id"].removeprefix("chatcmpl-")
    line = wait_for_log(served, f"id {request_id}")
    pattern = (r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d 127\.0\.0\.1 POST /v1/chat/completions 200 \d+\.\d{3} s  "
               r"(\d+) prompt \+ (\d+) completion tokens  whole  finish length  TTFT \d+ ms  [\d.]+ tok/s  id [0-9a-f]{32}")
    match = re.fullmatch(pattern, line)
    assert match and (int(match[1]), int(match[2])) == (out["usage"]["prompt_tokens"], 4), line
    assert "Quillby" not in served.log.getvalue()  # type: ignore[union-attr]
    post(served.url + "/v1/nothing", {})
    assert wait_for_log(served, "POST /v1/nothing 404").endswith(" s")  # every request, not just completions

    with_prompts = OpenAIServer(engine, "127.0.0.1", 0, log=io.StringIO(), log_prompts=True)
    thread = with_prompts.start()
    try:
        post(with_prompts.url + "/api/generate", {"prompt": secret, "stream": False, "options": {"num_predict": 2}})
        line = wait_for_log(with_prompts, "POST /api/generate 200")
        assert line.endswith('prompt [{"role": "user", "content": "Tell me about the aardvark named Quillby."}]')
    finally:
        with_prompts.shutdown()
        with_prompts.server_close()
        thread.join()


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
    line = wait_for_log(served, "finish cancelled")
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
            # /metrics reads the pool as it is now: all of it, and none held once the requests are done.
            figures = metrics(server.url)
            assert figures["llmlocal_kv_blocks_total"] == alone[0].stats.kv_blocks_total
            assert figures["llmlocal_kv_blocks_used"] == 0
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
        status, models = get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == 512
        status, out = post(f"http://127.0.0.1:{port}/v1/chat/completions", {"messages": QUESTION, "max_tokens": 3})
        assert status == 200 and out["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Stopped." in err and "Traceback" not in err
    # One line per request on stderr, without the prompt.
    assert re.search(r" 127\.0\.0\.1 GET /v1/models 200 [\d.]+ s\n", err)
    assert re.search(r" 127\.0\.0\.1 POST /v1/chat/completions 200 [\d.]+ s  \d+ prompt \+ 3 completion tokens  whole", err)
    assert QUESTION[0]["content"] not in err

    for flags, message in [
        (["--endpoint", "http://x"], "serve runs a model on this machine; --endpoint is for chat and run: drop it."),
        (["--backend", "llamacpp", "--parallel", "4"], "llama.cpp serves one request at a time (the others wait their turn): "
                                                       "drop --parallel, or serve with --backend paged to decode requests together."),
        (["--cors-origin", "http://localhost:3000/"], "--cors-origin takes an origin like http://localhost:3000 (scheme, host, "
                                                      "port; no path), or *: got 'http://localhost:3000/'."),
    ]:
        result = subprocess.run([sys.executable, "-m", "llmlocal.app", "serve", *flags],
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 2 and result.stderr.strip() == f"llmlocal: {message}"


def call(url: str, method: str, headers: dict[str, str], body: Any = None) -> tuple[int, dict[str, str], Any]:
    """Any request; the answer's status, headers and JSON body (None when empty)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **headers}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            status, head, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, dict(e.headers), e.read()
    return status, head, json.loads(raw) if raw else None


def metrics(url: str) -> dict[str, float]:
    """GET /metrics, checked line by line against Prometheus' text format: sample -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif not line.startswith("# HELP "):
            match = re.fullmatch(r'([a-z_]+)(\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})? (\S+)', line)
            assert match, line
            assert re.sub(r"_(bucket|sum|count)$", "", match[1]) in typed or match[1] in typed, line
            samples[match[1] + (match[2] or "")] = float(match[3])
    for name in ("llmlocal_time_to_first_token_seconds", "llmlocal_inter_token_latency_seconds"):
        buckets = [v for k, v in samples.items() if k.startswith(name + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == samples[name + "_count"]  # cumulative, +Inf last
    return samples


def get(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, json.loads(r.read())


def wait_for_log(server: OpenAIServer, phrase: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.log.getvalue().splitlines():  # type: ignore[union-attr]
            if phrase in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no '{phrase}' in the server log: {server.log.getvalue()!r}")  # type: ignore[union-attr]


def test_a_client_that_resets_its_connection_leaves_no_traceback(served: OpenAIServer, capfd: pytest.CaptureFixture[str]) -> None:
    import struct

    host, port = served.server_address[:2]
    handlers: list[threading.Thread] = []
    for _ in range(3):
        before = set(threading.enumerate())
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200" in s.recv(4096)  # answered: the connection's handler thread runs
            handlers += [t for t in set(threading.enumerate()) - before if "process_request" in t.name]
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    assert len(handlers) == 3
    for t in handlers:  # each handler reads the reset and ends (an event: no guess of how long that takes)
        t.join(60)
        assert not t.is_alive()
    assert "Traceback" not in capfd.readouterr().err
