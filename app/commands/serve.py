"""`llmlocal serve`: the local engine behind an OpenAI-compatible API (loopback by default).

Any OpenAI client can then use the model: `llmlocal chat --endpoint URL` on another machine,
editors, scripts. Every backend is served the same way; the paged backend decodes concurrent
requests together. Endpoints: /v1/models, /v1/chat/completions, /v1/completions (streaming
with "stream": true), /tokenize, /detokenize, /health.

Examples:

    llmlocal serve                                   # the starter model on http://127.0.0.1:8080/v1
    llmlocal serve --model org/repo:Q4_K_M --port 9000
    llmlocal serve --backend paged --kv-blocks 2048  # batch concurrent requests
    llmlocal serve --host 0.0.0.0 --api-key SECRET   # reachable from the network: require a key
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os
import sys

from ..options import add_model_options, plan_from_args

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
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
                   help="paged backend: sequences decoded together (default: 16)")
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
    api_key = args.api_key or os.environ.get("LLMLOCAL_SERVE_API_KEY") or None
    if args.backend == "auto" and _batches_here(args.model):
        # concurrent clients decode together in our engine; llama.cpp serves one at a time
        args.backend = "paged"
    plan = plan_from_args(args).replace(api_key=None)
    if args.parallel is not None:
        plan = plan.replace(max_batch=args.parallel)

    engine = Engine.load(plan)
    try:
        server = OpenAIServer(engine, args.host, args.port, api_key=api_key)
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
