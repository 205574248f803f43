"""The `remote` backend against a real OpenAI-compatible server: llama-cpp-python's, started on
127.0.0.1 by the test with the starter model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from llmlocal.engine import (
    ContextOverflowError,
    DoneEvent,
    Engine,
    Plan,
    Request,
    SamplingParams,
    TokenEvent,
)
from llmlocal.models.errors import LLMLocalError

KEY = "test-key-1234"
QUESTION = [{"role": "user", "content": "What color is the sky on a clear day?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(starter_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's server (`python -m llama_cpp.server`): n_ctx 1024, model id 'starter'
    (a name no local model has), an API key."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    args = [
        "--model", starter_path, "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", "1024", "--model_alias", "starter", "--api_key", KEY,
    ]
    # the server loads its model with the CPU workarounds our llamacpp backend applies (AMX)
    launcher = (
        "import runpy, sys\n"
        "from llmlocal.engine.backends.llamacpp import cpu_model_params, llama_model_params\n"
        "sys.argv = ['llama_cpp.server', *sys.argv[1:]]\n"
        "with llama_model_params(**cpu_model_params()):\n"
        "    runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n"
    )
    cmd = [sys.executable, "-c", launcher, *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
            try:
                ask = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
                with urllib.request.urlopen(ask, timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server did not come up: {log_path.read_text()[-3000:]}")
                time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def remote(server: str) -> Iterator[Engine]:
    with Engine.load(Plan(endpoint=server + "/v1", api_key=KEY)) as e:
        yield e


def wait_until(ready: Callable[[], bool], timeout: float = 120) -> bool:
    """Poll `ready` (a state, not a guess of how long something takes) until it holds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def collect(engine: Engine, request: Request) -> tuple[list[TokenEvent], DoneEvent]:
    events = list(engine.generate(request))
    assert isinstance(events[-1], DoneEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def test_connecting_loads_nothing_locally(remote: Engine, server: str) -> None:
    # 'starter' is not a local model name: resolve() would refuse it.
    assert remote.model.name == "starter" and remote.plan.model == "starter"
    assert (remote.backend_name, remote.device) == ("remote", server.removeprefix("http://"))
    assert remote.model.spec.format == "remote" and remote.model.path == server
    # llama-cpp-python's server reports neither its window nor a chat tokenizer.
    assert remote.n_ctx is None and remote.exact_token_counts is False
    assert remote.plan.backend == "remote"


def test_chat_streams_the_same_reply_as_the_local_engine(remote: Engine, engine: Engine) -> None:
    tokens, done = collect(remote, Request.chat(QUESTION, GREEDY))
    local = collect(engine, Request.chat(QUESTION, GREEDY))[1]
    assert "".join(t.text for t in tokens) == done.text
    assert "blue" in done.text
    # Same model, same chat template (the server renders it from the GGUF), greedy. The server
    # evaluates the prompt in one batch where the local engine splits off its last token, so
    # near-ties in the logits may part the replies after a while; their start is the same.
    assert done.text.split()[:6] == local.text.split()[:6]
    s = done.stats
    assert (s.backend, s.device, done.finish_reason) == ("remote", remote.device, "length")
    assert s.completion_tokens == 24  # counted by the server's tokenizer after the stream
    assert s.prompt_tokens > 0 and s.prefill_tok_s is None  # an estimate: no speed derived from it
    assert s.ttft_s is not None and s.ttft_s > 0
    assert s.decode_tok_s is not None and s.decode_tok_s > 0
    assert s.itl_ms_p50 is not None and 0 < s.itl_ms_p50 <= s.itl_ms_p95


def test_raw_prompts_use_completions_with_exact_counts(remote: Engine, engine: Engine) -> None:
    prompt = "The capital of France is"
    request = Request(prompt=prompt, sampling=SamplingParams(temperature=0, max_tokens=6))
    _, done = collect(remote, request)
    assert "Paris" in done.text
    assert remote.tokenize(prompt) == engine.tokenize(prompt)  # the server's tokenizer is the model's
    assert done.stats.prompt_tokens == len(engine.tokenize(prompt))
    assert done.stats.prefill_tok_s is not None
    counted = remote.backend.prompt(request)
    assert counted.exact is True and counted.ids == engine.tokenize(prompt)


def test_token_counts_are_estimates_for_chats_on_this_server(remote: Engine, engine: Engine) -> None:
    estimate = remote.count_tokens(QUESTION)
    exact = engine.count_tokens(QUESTION)
    assert 0 < estimate <= exact  # ChatML without the model's default system prompt
    assert "<|im_start|>user" in remote.render(QUESTION)


def test_stop_strings_and_seeded_samples(remote: Engine) -> None:
    _, free = collect(remote, Request.chat(QUESTION, GREEDY))
    word = free.text.split()[3]
    _, done = collect(remote, Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12, stop=(word,))))
    assert done.finish_reason == "stop" and word not in done.text and free.text.startswith(done.text)

    sampling = SamplingParams(temperature=1.0, seed=7, max_tokens=8, n=2)
    events = list(remote.generate(Request.chat(QUESTION, sampling)))
    dones = [e for e in events if isinstance(e, DoneEvent)]
    assert [d.index for d in dones] == [0, 1]
    for d in dones:
        assert d.text == "".join(e.text for e in events if isinstance(e, TokenEvent) and e.index == d.index)
    again = [e for e in remote.generate(Request.chat(QUESTION, sampling)) if isinstance(e, DoneEvent)]
    assert [d.text for d in again] == [d.text for d in dones]


def test_cancel_mid_stream_and_during_prefill(remote: Engine) -> None:
    long = Request.chat([{"role": "user", "content": "Write the numbers from 1 to 300, separated by commas."}],
                        SamplingParams(temperature=0, max_tokens=600))
    seen = 0
    done = None
    for event in remote.generate(long):
        if isinstance(event, DoneEvent):
            done = event
        else:
            seen += 1
            if seen == 3:
                remote.cancel(long.id)
    assert done is not None and done.finish_reason == "cancelled"
    assert done.stats.completion_tokens < 600

    # Cancelled while the server prefills a long prompt: as soon as the request's stream is open
    # (its watcher thread runs; an event, where a timer guessed how long prefill takes) the
    # stream's socket is shut, and what was produced, if anything, is the reply's text.
    slow = Request.chat([{"role": "user", "content": "word " * 600}], SamplingParams(temperature=0, max_tokens=600))
    result: list[tuple[list[TokenEvent], DoneEvent]] = []
    consumer = threading.Thread(target=lambda: result.append(collect(remote, slow)))
    before = set(threading.enumerate())
    consumer.start()
    assert wait_until(lambda: any("_abort_on_cancel" in t.name for t in set(threading.enumerate()) - before)
                      or not consumer.is_alive()), "the request's stream never opened"
    remote.cancel(slow.id)
    consumer.join()
    tokens, done = result[0]
    assert done.finish_reason == "cancelled" and done.text == "".join(t.text for t in tokens)
    assert done.stats.completion_tokens < 600

    # A consumer that stops reading closes the stream; the server serves the next request.
    stream = remote.generate(long)
    next(stream)
    stream.close()
    assert collect(remote, Request.chat(QUESTION, GREEDY))[1].finish_reason == "length"


def test_context_overflow_is_one_sentence_and_teaches_the_window(server: str) -> None:
    with Engine.load(Plan(endpoint=server, api_key=KEY)) as e:
        assert e.n_ctx is None
        with pytest.raises(ContextOverflowError) as err:
            list(e.generate(Request.chat([{"role": "user", "content": "word " * 1100}], GREEDY)))
        assert str(err.value) == f"The prompt does not fit the 1024-token context window of the server at {server}: shorten the conversation."
        assert e.n_ctx == 1024
        # Raw prompts are counted exactly, so now the overflow is caught before any request.
        with pytest.raises(ContextOverflowError, match="server's context window is 1024"):
            e.generate(Request(prompt="word " * 1100, sampling=GREEDY))
    with Engine.load(Plan(endpoint=server, api_key=KEY, n_ctx=1024)) as e:
        assert e.n_ctx == 1024  # --ctx tells a window the server does not report


def test_api_key_from_the_environment(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("LLMLOCAL_API_KEY", KEY)
    with Engine.load(Plan(endpoint=server)) as e:
        assert e.model.name == "starter"


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"api_key": None}, "The server at {url} needs an API key (HTTP 401): pass it with --api-key or set $LLMLOCAL_API_KEY."),
        ({"api_key": "wrong"}, "The server at {url} refused the API key (HTTP 401): pass the right one with --api-key or $LLMLOCAL_API_KEY."),
        ({"model": "llama-70b"}, "The server at {url} does not serve 'llama-70b': pick one of starter with --model."),
        ({"endpoint": "{url}/api"}, "{url}/api has no OpenAI-compatible API (HTTP 404 for /v1/models): point --endpoint at the server's base URL, e.g. http://127.0.0.1:8080."),
        ({"backend": "llamacpp"}, "--endpoint runs the model on the server, so --backend llamacpp does not apply: drop it."),
    ],
)
def test_refusals_are_one_sentence(server: str, monkeypatch: pytest.MonkeyPatch, plan: dict, message: str) -> None:
    for var in ("LLMLOCAL_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    values = {"endpoint": server, "api_key": KEY, **plan}
    values["endpoint"] = values["endpoint"].format(url=server)
    with pytest.raises(LLMLocalError) as err:
        Engine.load(Plan(**values))
    assert str(err.value) == message.format(url=server)


def test_connection_refused() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LLMLocalError) as err:
        Engine.load(Plan(endpoint=url))
    assert str(err.value) == f"Nothing answers at {url} (connection refused): start the server, or fix --endpoint."


def test_scoring_needs_a_local_model(remote: Engine) -> None:
    with pytest.raises(LLMLocalError, match="use a local model"):
        remote.score([1, 2, 3])


def test_run_command_talks_to_the_server(server: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LLMLOCAL_API_KEY", "OPENAI_API_KEY")}
    result = subprocess.run(
        [sys.executable, "-m", "llmlocal.app", "run", "What color is the sky on a clear day?", "--endpoint", server,
         "--api-key", KEY, "--temperature", "0", "--max-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["model"], out["backend"], out["completion_tokens"]) == ("starter", "remote", 8)
    assert out["text"] and out["ttft_s"] > 0
    # And the same without the key: one sentence, exit code 2.
    result = subprocess.run(
        [sys.executable, "-m", "llmlocal.app", "run", "Hi", "--endpoint", server],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert result.returncode == 2 and result.stderr.strip().startswith("llmlocal: The server at") and "Traceback" not in result.stderr
    assert Path(sys.executable).exists()
