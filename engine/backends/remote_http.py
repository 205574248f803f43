"""HTTP for the `remote` backend: JSON calls and server-sent-event streams to an
OpenAI-compatible server, with the stdlib's http.client, and one sentence per failure.

A stream owns its connection; `SSEStream.abort()` (from any thread) shuts the socket down,
which wakes a reader blocked on it: that is how a cancel reaches a server that is busy with
a long prefill and sends nothing.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from llmlocal.models.errors import ContextOverflowError, LLMLocalError

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a long prefill on a big model sends nothing for a while


class RemoteError(LLMLocalError):
    """The server could not be reached, or refused a request."""


class RemoteContextError(RemoteError, ContextOverflowError):
    """The server says the prompt does not fit its context window."""


@dataclass(frozen=True)
class Endpoint:
    """Where the server is: ``scheme://host:port`` plus a path prefix (without ``/v1``)."""

    scheme: str
    host: str
    port: int
    prefix: str
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> Endpoint:
        text = url.strip()
        if "://" not in text:
            text = "http://" + text
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"'{url}' is not an http(s) URL: pass --endpoint like http://127.0.0.1:8080.")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise RemoteError(f"'{url}' has an invalid port: pass --endpoint like http://127.0.0.1:8080.") from None
        prefix = parts.path.rstrip("/")
        prefix = prefix.removesuffix("/v1")
        return cls(parts.scheme, parts.hostname, port, prefix, api_key or None)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}"

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    # ---- requests ------------------------------------------------------------------------
    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def _headers(self, body: bytes | None) -> dict[str, str]:
        headers = {"Accept": "application/json, text/event-stream", "User-Agent": "llmlocal"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _send(self, method: str, path: str, payload: Any, timeout: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        body = json.dumps(payload).encode() if payload is not None else None
        conn = self._connect(CONNECT_TIMEOUT_S)
        try:
            conn.request(method, self.prefix + path, body=body, headers=self._headers(body))
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            return conn, conn.getresponse()
        except OSError as e:
            conn.close()
            raise self.unreachable(e) from None
        except http.client.HTTPException as e:
            conn.close()
            raise RemoteError(f"The server at {self.url} broke the connection ({type(e).__name__}): check that it is an OpenAI-compatible server.") from None

    def call(self, method: str, path: str, payload: Any = None, timeout: float = READ_TIMEOUT_S) -> Any:
        """One JSON request; the decoded answer, or `RemoteError` for any failure."""
        status, data = self.try_call(method, path, payload, timeout)
        if status != 200:
            raise self.refused(status, data, path)
        return data

    def try_call(
        self, method: str, path: str, payload: Any = None, timeout: float = READ_TIMEOUT_S, probe: bool = False
    ) -> tuple[int, Any]:
        """(status, decoded JSON or None). An unreachable server raises; so does a refused key,
        unless ``probe`` (looking for an endpoint the server may not have, where a gateway's
        401/403 means "not here")."""
        conn, resp = self._send(method, path, payload, timeout)
        try:
            raw = resp.read()
        except OSError as e:
            raise self.unreachable(e) from None
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if resp.status in (401, 403) and not probe:
            raise self.refused(resp.status, data, path)
        return resp.status, data

    def stream(self, path: str, payload: Any) -> SSEStream:
        conn, resp = self._send("POST", path, payload, READ_TIMEOUT_S)
        if resp.status != 200:
            try:
                raw = resp.read()
                data = json.loads(raw) if raw else None
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                data = None
            finally:
                conn.close()
            raise self.refused(resp.status, data, path)
        return SSEStream(self, conn, resp)

    # ---- errors --------------------------------------------------------------------------
    def unreachable(self, e: BaseException) -> RemoteError:
        if isinstance(e, ConnectionRefusedError):
            return RemoteError(f"Nothing answers at {self.url} (connection refused): start the server, or fix --endpoint.")
        if isinstance(e, socket.gaierror):
            return RemoteError(f"Cannot find the host {self.host}: check the --endpoint URL.")
        if isinstance(e, (socket.timeout, TimeoutError)):
            return RemoteError(f"The server at {self.url} did not answer in time: check that it is running and reachable.")
        reason = getattr(e, "strerror", None) or type(e).__name__
        return RemoteError(f"Cannot talk to {self.url} ({reason}): check the --endpoint URL and the network.")

    def refused(self, status: int, data: Any, path: str) -> RemoteError:
        message = error_message(data)
        if status in (401, 403):
            if self.api_key:
                return RemoteError(
                    f"The server at {self.url} refused the API key (HTTP {status}): pass the right one with --api-key or $LLMLOCAL_API_KEY."
                )
            return RemoteError(f"The server at {self.url} needs an API key (HTTP {status}): pass it with --api-key or set $LLMLOCAL_API_KEY.")
        code = data.get("error", {}).get("code") if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
        if code == "context_length_exceeded" or "context length" in message or "context window" in message:
            window = re.search(r"(?:context length|context window) (?:is |of )?(\d+)", message)
            size = f"{window.group(1)}-token " if window else ""
            return RemoteContextError(f"The prompt does not fit the {size}context window of the server at {self.url}: shorten the conversation.")
        if status == 404 and path.endswith("/models"):
            return RemoteError(f"{self.url} has no OpenAI-compatible API (HTTP 404 for {path}): point --endpoint at the server's base URL, e.g. http://127.0.0.1:8080.")
        if status == 404 and ("model" in message.lower()):
            return RemoteError(f"The server at {self.url} does not serve that model ({message.rstrip('.')}): pick one from its /v1/models with --model.")
        detail = f": {message.rstrip('.')}" if message else ""
        return RemoteError(f"The server at {self.url} answered HTTP {status} to {path}{detail}; check the server's log.")


def error_message(data: Any) -> str:
    """The human part of an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(data.get("detail"), str):
            return data["detail"]
        if isinstance(data.get("message"), str):
            return data["message"]
    return ""


class SSEStream:
    """The ``data:`` payloads of a server-sent-event response, decoded from JSON.

    Ends at ``data: [DONE]`` (``finished`` is then True) or when the server closes the stream.
    """

    def __init__(self, endpoint: Endpoint, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.endpoint = endpoint
        self._conn = conn
        self._resp = resp
        self._lock = threading.Lock()
        self.aborted = False
        self.finished = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        data: list[str] = []
        while True:
            try:
                line = self._resp.readline()
            except (OSError, ValueError, http.client.HTTPException) as e:
                if self.aborted:
                    return
                raise self.endpoint.unreachable(e if isinstance(e, OSError) else OSError(str(e))) from None
            if not line:  # the server closed the stream
                return
            text = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if text.startswith("data:"):
                data.append(text[5:].removeprefix(" "))
                continue
            if text or not data:  # a comment (": ping"), an "event:" line, or a stray blank
                continue
            payload = "\n".join(data)
            data = []
            if payload.strip() == "[DONE]":
                self.finished = True
                return
            try:
                event = json.loads(payload)
            except json.JSONDecodeError:
                continue  # not JSON: nothing an OpenAI-compatible client can use
            if isinstance(event, dict) and "error" in event and "choices" not in event:
                raise self.endpoint.refused(int(event.get("code") or 500), event, "the stream")
            yield event

    def abort(self) -> None:
        """Stop the stream now, from any thread: the server sees the client go away."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
            sock = self._conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self.aborted = True
            self._conn.close()
