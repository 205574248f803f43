"""A stand-in for the Hugging Face Hub on 127.0.0.1: the few HTTP endpoints huggingface_hub
calls to list a model repo and download files from it (with Range requests, which is how an
interrupted download resumes). Enough for `llmlocal models pull` to run end to end offline."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]]  # repo id -> {path: bytes}
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)
    # Cut the connection after this many bytes of the first file body sent (a dropped download).
    drop_after: int | None = None

    def commit(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def start(self) -> tuple[ThreadingHTTPServer, str]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?$", path)
                if m:
                    return self._repo_info(m[1])
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/[^/]+$", path)
                if m:
                    return self._tree(m[1])
                m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
                if m:
                    return self._file(m[1], m[2], head)
                self._json(404, {"error": "Not found"})

            def _repo_info(self, repo: str) -> None:
                if repo not in hub.repos:
                    self.send_response(401)  # the Hub's answer to a missing (or private) repo
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.send_header("Content-Type", "application/json")
                    body = b'{"error": "Repository not found"}'
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                files = hub.repos[repo]
                self._json(200, {"id": repo, "modelId": repo, "sha": hub.commit(repo), "private": False,
                                 "siblings": [{"rfilename": f} for f in sorted(files)]})

            def _tree(self, repo: str) -> None:
                entries = []
                for name, data in sorted(hub.repos[repo].items()):
                    sha256 = hashlib.sha256(data).hexdigest()
                    entries.append({"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                                    "lfs": {"oid": sha256, "size": len(data), "pointerSize": 134}})
                self._json(200, entries)

            def _file(self, repo: str, name: str, head: bool) -> None:
                data = hub.repos.get(repo, {}).get(name)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and (m := re.match(r"bytes=(\d+)-$", rng)):
                    start = int(m[1])
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", hub.commit(repo))
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(body)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                if hub.drop_after is not None and not start:
                    cut, hub.drop_after = hub.drop_after, None
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _json(self, status: int, payload: object) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}"
