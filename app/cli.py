"""`llmlocal`: the command line entry point.

Each subcommand lives in `llmlocal.app.commands.<name>` and exposes ``register(subparsers)``
and ``run(args) -> int``. Heavy libraries (torch, llama_cpp, textual) are imported inside
``run``, so ``llmlocal --help`` stays fast. Errors the user can fix (`LLMLocalError`) end in
one sentence on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from llmlocal.models.errors import LLMLocalError

COMMANDS = ("chat", "run", "bench", "quantize", "models", "serve", "plan")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("llmlocal")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmlocal",
        description="Run large language models on your own machine, offline.",
        epilog="Run `llmlocal COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"llmlocal {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"llmlocal.app.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LLMLocalError as e:
        print(f"llmlocal: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `llmlocal run ... | head`: the reader went away; not an error worth a traceback.
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
