"""Who `llmlocal serve` answers (`app/serve/access.py`): real HTTP requests on loopback, as a
web page would send them (another Host: DNS rebinding; another Origin: a cross-site request)
and as local clients do (the real `openai` client, an Ollama-style client, curl-like requests)."""

from __future__ import annotations

import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_serve import QUESTION, metrics, served  # noqa: F401 - `served` is a fixture
from llmlocal.app.serve.access import Access, host_name, is_loopback, origin_host
from llmlocal.app.serve.server import OpenAIServer
from llmlocal.engine import Engine
from llmlocal.models.errors import LLMLocalError

CHAT = {"messages": QUESTION, "max_tokens": 2, "temperature": 0}
GENERATE = {"model": "smollm2-135m", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}


def send(server: OpenAIServer, method: str, path: str, headers: dict[str, str], body: Any = None,
         content_type: str = "application/json") -> tuple[int, dict[str, str], Any]:
    """One request with exactly these headers (http.client sends no Host of its own when one is given)."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": content_type, **headers} if data is not None else headers)
        r = conn.getresponse()
        raw = r.read()
        return r.status, dict(r.headers), json.loads(raw) if raw else None
    finally:
        conn.close()


def status(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[OpenAIServer]:
    """A server with one more host name and one more origin than the defaults."""
    s = OpenAIServer(engine, "127.0.0.1", 0, log=io.StringIO(), allow_hosts=["mybox.lan"],
                     cors_origin=["https://app.example.com", "https://two.example.com"])
    thread = s.start()
    yield s
    s.shutdown()
    s.server_close()
    thread.join()


def generations(url: str) -> tuple[float, ...]:
    """What a generation moves on /metrics: answered completions of both APIs, tokens, first tokens."""
    m = metrics(url)
    ok = [k for k in m if k.startswith("llmlocal_requests_total") and 'status="200"' in k and "/metrics" not in k]
    return (sum(m[k] for k in ok), m["llmlocal_completion_tokens_total"], m["llmlocal_time_to_first_token_seconds_count"])


def test_host_names_are_read_like_browsers_send_them() -> None:
    assert [host_name(h) for h in ("LocalHost.:8080", "[::1]:80", "127.0.0.1", "localhost:", "[0:0::1]")] == [
        "localhost", "::1", "127.0.0.1", "localhost", "::1"]
    assert [host_name(h) for h in ("localhost:80@evil.com", "[::1", "a b", "localhost:8o", "")] == [None] * 5
    assert [origin_host(o) for o in ("http://[::1]:3000", "https://LOCALHOST", "null", "file://", "app://x")] == [
        "::1", "localhost", None, None, None]
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:{port}", "localhost.evil.com:{port}",
                                  "127.0.0.1.nip.io:{port}", "0.0.0.0:{port}", "10.0.0.1:{port}", "localhost:80@evil"])
def test_a_foreign_host_is_refused_before_anything_runs(served: OpenAIServer, host: str) -> None:  # noqa: F811
    host = host.format(port=served.server_address[1])
    before = generations(served.url)
    status, _, out = send(served, "POST", "/v1/chat/completions", {"Host": host}, CHAT)
    assert status == 403 and out["error"]["code"] == "host_not_allowed"
    name = host_name(host)
    fix = f"start the server with --allow-host {name}." if name else "send the server's address, like localhost:PORT."
    assert out["error"]["message"].endswith(fix)
    status, _, out = send(served, "POST", "/api/generate", {"Host": host}, GENERATE)
    assert status == 403 and set(out) == {"error"} and out["error"].endswith(fix)  # Ollama's error shape
    status, _, out = send(served, "GET", "/api/tags", {"Host": host})
    assert status == 403 and out["error"].endswith(fix)
    assert generations(served.url) == before


def test_local_host_names_are_served(served: OpenAIServer) -> None:  # noqa: F811
    port = served.server_address[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"LOCALHOST.:{port}", "localhost"):
        status, _, out = send(served, "GET", "/api/tags", {"Host": host})
        assert status == 200 and out["models"][0]["name"] == "smollm2-135m", host
    status, _, out = send(served, "POST", "/v1/chat/completions", {"Host": f"localhost:{port}"}, CHAT)
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    # A health check passes whatever the name (a proxy's, a container's): it tells nothing.
    assert send(served, "GET", "/health", {"Host": "anything"})[0] == 200


def test_allow_host_adds_names(server: OpenAIServer) -> None:
    assert send(server, "GET", "/v1/models", {"Host": f"MyBox.lan:{server.server_address[1]}"})[0] == 200
    assert send(server, "GET", "/v1/models", {"Host": "otherbox.lan"})[0] == 403


def test_ipv6_loopback(engine: Engine) -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    server = OpenAIServer(engine, "::1", 0)
    thread = server.start()
    try:
        assert server.url.startswith("http://[::1]:")
        assert status(server.url + "/v1/models", {}) == 200  # Host: [::1]:PORT
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("origin", ["http://evil.example", "https://localhost.evil.example", "null", "http://127.0.0.1.nip.io"])
def test_a_foreign_origin_is_refused_even_for_a_simple_request(served: OpenAIServer, origin: str) -> None:  # noqa: F811
    before = generations(served.url)
    # text/plain: what a page sends cross-site without asking first (no preflight).
    for path, body in [("/v1/chat/completions", CHAT), ("/api/generate", GENERATE)]:
        status, headers, out = send(served, "POST", path, {"Origin": origin}, body, content_type="text/plain")
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        message = out["error"] if path.startswith("/api/") else out["error"]["message"]
        assert message.startswith(f"Cross-origin requests from {origin} are not allowed: start the server with --cors-origin")
    status, headers, _ = send(served, "GET", "/v1/models", {"Origin": origin})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = send(served, "OPTIONS", "/v1/chat/completions", {"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert generations(served.url) == before  # no generation started


def test_local_and_named_origins_get_cors_headers(served: OpenAIServer, server: OpenAIServer) -> None:  # noqa: F811
    cases = [(served, "http://localhost:5173"), (served, "http://127.0.0.1:8000"), (served, "https://[::1]"),
             (server, "https://app.example.com"), (server, "https://two.example.com"), (server, "http://localhost:3000")]
    for s, origin in cases:
        status, headers, out = send(s, "POST", "/v1/chat/completions", {"Origin": origin}, CHAT)
        assert status == 200 and out["usage"]["completion_tokens"] == 2, origin
        assert headers["Access-Control-Allow-Origin"] == origin and headers["Vary"] == "Origin"
        status, headers, _ = send(s, "OPTIONS", "/v1/chat/completions", {
            "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Access-Control-Allow-Headers"] == "content-type"
    # A named origin is for its own server only.
    assert send(served, "GET", "/v1/models", {"Origin": "https://app.example.com"})[0] == 403


def test_the_openai_client_and_an_ollama_client_are_unaffected(served: OpenAIServer) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]
    reply = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    streamed = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=3, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content

    # An Ollama client: its headers, one keep-alive connection, NDJSON read line by line as it streams.
    host, port = served.server_address[:2]
    ollama = http.client.HTTPConnection(host, port, timeout=120)
    headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": "ollama-python/0.4.7"}
    try:
        ollama.request("GET", "/api/tags", headers=headers)
        assert json.loads(ollama.getresponse().read())["models"][0]["name"] == "smollm2-135m"
        body = {"model": "smollm2-135m", "messages": QUESTION, "options": {"temperature": 0, "num_predict": 3}}
        ollama.request("POST", "/api/chat", json.dumps(body).encode(), headers)
        r = ollama.getresponse()
        lines = [json.loads(line) for line in iter(r.readline, b"") if line.strip()]
    finally:
        ollama.close()
    assert r.status == 200 and lines[-1]["done"] and lines[-1]["eval_count"] == 3
    assert "".join(line["message"]["content"] for line in lines) == reply.choices[0].message.content


def test_beyond_loopback_an_api_key_is_required(engine: Engine) -> None:
    with pytest.raises(LLMLocalError, match=r"^Listening on 0\.0\.0\.0 lets other machines in, so it needs an API key: "
                                            r"pass --api-key KEY .* or --insecure-no-key to serve without one\.$"):
        OpenAIServer(engine, "0.0.0.0", 0)
    server = OpenAIServer(engine, "0.0.0.0", 0, api_key="s3cret")
    thread = server.start()
    try:
        port, key = server.server_address[1], {"Authorization": "Bearer s3cret"}
        for host in (f"127.0.0.1:{port}", f"{socket.gethostname()}:{port}", "localhost"):
            assert send(server, "GET", "/v1/models", {**key, "Host": host})[0] == 200, host
        assert send(server, "GET", "/v1/models", {**key, "Host": "evil.example.com"})[0] == 403
        assert send(server, "GET", "/v1/models", {"Host": f"127.0.0.1:{port}"})[0] == 401
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    insecure = OpenAIServer(engine, "0.0.0.0", 0, insecure_no_key=True)  # the user said so
    insecure.server_close()
    assert Access.for_bind("0.0.0.0").host_allowed("127.0.0.1") and not Access.for_bind("127.0.0.1").host_allowed("0.0.0.0")


def test_the_serve_command_takes_hosts_and_origins_from_flags_and_config(isolated_config: Any) -> None:
    isolated_config.write_text('allow_host = "cfg.lan"\ncors_origin = "https://app.example.com, https://b.example.com"\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "LLMLOCAL_SERVE_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "llmlocal.app", "serve", "--port", str(port), "--backend", "llamacpp",
                             "--ctx", "256", "--allow-host", "flag.lan", "--allow-host", "two.lan", "--max-connections", "8"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert "llmlocal serves" in proc.stderr.readline()  # the port is open

        url = f"http://127.0.0.1:{port}/v1/models"
        assert [status(url, {"Host": h}) for h in ("flag.lan", "two.lan:1", "cfg.lan")] == [200, 200, 403]  # the flag wins
        assert [status(url, {"Origin": o}) for o in ("https://b.example.com", "https://c.example.com")] == [200, 403]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--host", "0.0.0.0"], "Listening on 0.0.0.0 lets other machines in, so it needs an API key: pass --api-key KEY "
                            "(or set LLMLOCAL_SERVE_API_KEY), or --insecure-no-key to serve without one."),
    (["--allow-host", "http://mybox.lan"], "--allow-host takes a host name or address without a scheme or port, like "
                                           "mybox.lan or 192.168.1.5: got 'http://mybox.lan'."),
    (["--allow-host", "mybox.lan:8080"], "--allow-host takes a host name or address without a scheme or port, like "
                                         "mybox.lan or 192.168.1.5: got 'mybox.lan:8080'."),
    (["--cors-origin", "http://localhost:3000", "--cors-origin", "evil.example"],
     "--cors-origin takes an origin like http://localhost:3000 (scheme, host, port; no path), or *: got 'evil.example'."),
    (["--max-connections", "0"], "--max-connections must be at least 1, got 0."),
])
def test_the_serve_command_refuses_to_start_in_one_sentence(flags: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLMLOCAL_SERVE_API_KEY"}
    result = subprocess.run([sys.executable, "-m", "llmlocal.app", "serve", *flags],
                            capture_output=True, text=True, timeout=120, check=False, env=env)
    assert result.returncode == 2 and result.stderr.strip() == f"llmlocal: {message}"


def test_a_bad_config_value_names_the_key(isolated_config: Any) -> None:
    isolated_config.write_text('cors_origin = "http://localhost:3000/app"\n')
    result = subprocess.run([sys.executable, "-m", "llmlocal.app", "serve"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and result.stderr.startswith(f"llmlocal: cors_origin in {isolated_config} must be origins like")
