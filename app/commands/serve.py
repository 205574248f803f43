"""`llmlocal serve`: the local engine behind OpenAI- and Ollama-compatible APIs (loopback by default).

Any OpenAI client can then use the model (`llmlocal chat --endpoint URL` on another machine,
editors, scripts), and so can Ollama clients pointed at the same address. Every backend is
served the same way. Endpoints: /v1/models, /v1/chat/completions, /v1/completions (streaming
with "stream": true), /tokenize, /detokenize; Ollama's /api/version, /api/tags, /api/show,
/api/generate, /api/chat (NDJSON streaming by default); /metrics (Prometheus), /health.
Request fields llmlocal does not implement get a 400 that names them.

Each request is logged on stderr in one line (method, path, status, time, tokens; the
prompt only with --log-prompts).

Only local clients get in: a request addressed to another Host name (a web page's DNS
rebinding) or sent by a web page from another origin gets a 403 (--allow-host and
--cors-origin add names and origins). Listening beyond this machine needs --api-key.

Examples:

    llmlocal serve                                   # the starter model on http://127.0.0.1:8080/v1
    llmlocal serve --model org/repo:Q4_K_M --port 9000
    llmlocal serve --backend paged --parallel 8      # decode up to 8 requests together
    llmlocal serve --host 0.0.0.0 --api-key SECRET   # reachable from the network: require a key
    llmlocal serve --cors-origin https://app.example.com   # let a web app call it from a browser
    llmlocal serve --allow-host mybox.lan              # answer requests addressed to that name too
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    curl http://127.0.0.1:8080/api/chat -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..options import FromConfig, add_model_options, plan_from_args

_NO_PARALLEL = ("llama.cpp serves one request at a time (the others wait their turn): drop --parallel, "
                "or serve with --backend paged to decode requests together.")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI- and Ollama-compatible HTTP APIs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --api-key and --endpoint below replace the model options' client-side ones
    )
    add_model_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", metavar="H", help="address to listen on (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8080, metavar="P", help="port (default: 8080; 0 picks a free one)")
    g.add_argument("--api-key", default=None, metavar="K",
                   help="require clients to send 'Authorization: Bearer K'; needed when --host reaches beyond this "
                        "machine (default: $LLMLOCAL_SERVE_API_KEY, else none)")
    g.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="paged and sparse backends: requests decoded together in one step (default: 16; the KV "
                        "pool holds min(N, 4) full contexts unless --kv-blocks); llamacpp serves one request at "
                        "a time and queues the rest, so it refuses --parallel above 1")
    g.add_argument("--cors-origin", action=_Repeated, default=FromConfig("cors_origin", ""), metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example.com, or * for any) call the API from a "
                        "browser, besides local pages (http://localhost:PORT, 127.0.0.1, [::1]); repeatable "
                        "(default: the config file's cors_origin, else none)")
    g.add_argument("--allow-host", action=_Repeated, default=FromConfig("allow_host", ""), metavar="NAME",
                   help="answer requests addressed to the host NAME too, besides localhost, 127.0.0.1 and [::1] "
                        "(and this machine's own names beyond loopback); repeatable (default: the config file's "
                        "allow_host, else none)")
    g.add_argument("--max-connections", type=int, default=FromConfig("max_connections", 64), metavar="N",
                   help="connections held open at once; past N the longest-idle one is closed, and when all are "
                        "busy a new one gets 503 (default: 64)")
    g.add_argument("--insecure-no-key", action="store_true",
                   help="serve beyond loopback without --api-key: anyone who can reach the port can use the model")
    g.add_argument("--log-prompts", action="store_true",
                   help="add each request's prompt to its log line (default: method, path, status, time, tokens only)")
    g.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)  # a client option: refused in run()
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmlocal.app.serve.access import checked_hosts, checked_origins, is_loopback, require_key
    from llmlocal.app.serve.server import OpenAIServer
    from llmlocal.engine import Engine
    from llmlocal.models.errors import LLMLocalError

    if args.endpoint is not None:
        raise LLMLocalError("serve runs a model on this machine; --endpoint is for chat and run: drop it.")
    if not 0 <= args.port <= 65535:
        raise LLMLocalError(f"--port must be between 0 and 65535, got {args.port}.")
    if args.parallel is not None and args.parallel < 1:
        raise LLMLocalError(f"--parallel must be at least 1, got {args.parallel}.")
    if args.parallel is not None and args.parallel > 1 and args.backend == "llamacpp":
        raise LLMLocalError(_NO_PARALLEL)
    cors_origins, allow_hosts = _listed(args.cors_origin), _listed(args.allow_host)
    checked_origins(cors_origins)  # refused before the model loads
    checked_hosts(allow_hosts)
    if args.max_connections < 1:
        raise LLMLocalError(f"--max-connections must be at least 1, got {args.max_connections}.")
    api_key = args.api_key or os.environ.get("LLMLOCAL_SERVE_API_KEY") or None
    require_key(args.host, api_key, args.insecure_no_key)
    if args.backend == "auto" and _batches_here(args.model):
        # concurrent clients decode together in our engine; llama.cpp serves one at a time
        args.backend = "paged"
    plan = plan_from_args(args).replace(api_key=None)
    if args.parallel is not None:
        plan = plan.replace(max_batch=args.parallel)

    engine = Engine.load(plan)
    if engine.template_notice:
        print(f"llmlocal: {engine.template_notice}", file=sys.stderr)
    try:
        if args.parallel is not None and args.parallel > 1 and engine.backend_name == "llamacpp":
            raise LLMLocalError(_NO_PARALLEL)  # `auto` chose llama.cpp for this model
        server = OpenAIServer(engine, args.host, args.port, api_key=api_key, log=sys.stderr, log_prompts=args.log_prompts,
                              cors_origin=cors_origins, allow_hosts=allow_hosts, insecure_no_key=args.insecure_no_key,
                              max_connections=args.max_connections)
        n_ctx = f"{engine.n_ctx:,}-token context" if engine.n_ctx else "context unknown"
        print(
            f"llmlocal serves {engine.model.name} ({engine.backend_name} on {engine.device}, {n_ctx}) "
            f"at {server.url}/v1 — Ctrl+C stops.",
            file=sys.stderr,
            flush=True,
        )
        if api_key is None and not is_loopback(args.host):  # only with --insecure-no-key
            print("Warning: listening beyond this machine without an API key (--insecure-no-key): anyone who can "
                  "reach it can use the model.", file=sys.stderr)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("Stopped.", file=sys.stderr)
        finally:
            server.server_close()
    finally:
        engine.close()
    return 0


class _Repeated(argparse.Action):
    """A repeatable option whose default may come from the config file: the first use on the
    command line replaces that default instead of adding to it (flag > config file)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*given, values] if isinstance(given, list) else [values])


def _listed(value: str | Sequence[str]) -> list[str]:
    """The values of a repeatable option or of its config key (one string, comma-separated)."""
    items = [value] if isinstance(value, str) else list(value)
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def _batches_here(model: str | None) -> bool:
    """Whether `auto` should serve ``model`` with the paged engine: a GGUF that the engine runs
    entirely in its native CPU kernels, not calibrated for the sparse backend (which the
    planner picks itself). (On a CUDA device the planner prefers the paged engine anyway.)"""
    from llmlocal.engine.planning.native_support import runs_natively
    from llmlocal.models import resolve

    spec = resolve(model).spec
    return spec.sparsity is None and runs_natively(spec)
