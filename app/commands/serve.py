"""`llmlocal serve`: the local engine behind OpenAI- and Ollama-compatible APIs (loopback by default).

Any OpenAI client can then use the model (`llmlocal chat --endpoint URL` on another machine,
editors, scripts), and so can Ollama clients pointed at the same address. Every backend is
served the same way. Endpoints: /v1/models, /v1/chat/completions, /v1/completions (streaming
with "stream": true), /tokenize, /detokenize; Ollama's /api/version, /api/tags, /api/show,
/api/generate, /api/chat (NDJSON streaming by default); /metrics (Prometheus), /health.
Request fields llmlocal does not implement get a 400 that names them.

Each request is logged on stderr in one line (method, path, status, time, tokens; the
prompt only with --log-prompts).

Examples:

    llmlocal serve                                   # the starter model on http://127.0.0.1:8080/v1
    llmlocal serve --model org/repo:Q4_K_M --port 9000
    llmlocal serve --backend paged --parallel 8      # decode up to 8 requests together
    llmlocal serve --host 0.0.0.0 --api-key SECRET   # reachable from the network: require a key
    llmlocal serve --cors-origin http://localhost:3000   # let one web app call it from a browser
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    curl http://127.0.0.1:8080/api/chat -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from ..options import add_model_options, plan_from_args

LOOPBACK = ("127.0.0.1", "localhost", "::1")
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
                   help="require clients to send 'Authorization: Bearer K' (default: $LLMLOCAL_SERVE_API_KEY, else none)")
    g.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="paged and sparse backends: requests decoded together in one step (default: 16; the KV "
                        "pool holds min(N, 4) full contexts unless --kv-blocks); llamacpp serves one request at "
                        "a time and queues the rest, so it refuses --parallel above 1")
    g.add_argument("--cors-origin", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. http://localhost:3000, or * for any) call the API from a "
                        "browser: answers CORS preflights and allows that origin only (default: none)")
    g.add_argument("--log-prompts", action="store_true",
                   help="add each request's prompt to its log line (default: method, path, status, time, tokens only)")
    g.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)  # a client option: refused in run()
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmlocal.engine import Engine
    from llmlocal.engine.serve import OpenAIServer
    from llmlocal.models.errors import LLMLocalError

    if args.endpoint is not None:
        raise LLMLocalError("serve runs a model on this machine; --endpoint is for chat and run: drop it.")
    if not 0 <= args.port <= 65535:
        raise LLMLocalError(f"--port must be between 0 and 65535, got {args.port}.")
    if args.parallel is not None and args.parallel < 1:
        raise LLMLocalError(f"--parallel must be at least 1, got {args.parallel}.")
    if args.parallel is not None and args.parallel > 1 and args.backend == "llamacpp":
        raise LLMLocalError(_NO_PARALLEL)
    if args.cors_origin is not None and not (args.cors_origin == "*" or re.fullmatch(r"https?://[^/\s]+", args.cors_origin)):
        raise LLMLocalError(f"--cors-origin takes an origin like http://localhost:3000 (scheme, host, port; no path), "
                            f"or *: got '{args.cors_origin}'.")
    api_key = args.api_key or os.environ.get("LLMLOCAL_SERVE_API_KEY") or None
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
        server = OpenAIServer(engine, args.host, args.port, api_key=api_key, log=sys.stderr,
                              log_prompts=args.log_prompts, cors_origin=args.cors_origin)
        n_ctx = f"{engine.n_ctx:,}-token context" if engine.n_ctx else "context unknown"
        print(
            f"llmlocal serves {engine.model.name} ({engine.backend_name} on {engine.device}, {n_ctx}) "
            f"at {server.url}/v1 — Ctrl+C stops.",
            file=sys.stderr,
            flush=True,
        )
        if args.host not in LOOPBACK and api_key is None:
            print("Warning: listening beyond this machine without --api-key: anyone who can reach it can use it.", file=sys.stderr)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("Stopped.", file=sys.stderr)
        finally:
            server.server_close()
    finally:
        engine.close()
    return 0


def _batches_here(model: str | None) -> bool:
    """Whether `auto` should serve ``model`` with the paged engine: a GGUF that the engine runs
    entirely in its native CPU kernels, not calibrated for the sparse backend (which the
    planner picks itself). (On a CUDA device the planner prefers the paged engine anyway.)"""
    from llmlocal.engine.native_support import runs_natively
    from llmlocal.models import resolve

    spec = resolve(model).spec
    return spec.sparsity is None and runs_natively(spec)
