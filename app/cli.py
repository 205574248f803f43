"""`llmlocal`: the command line entry point.

Each subcommand lives in `llmlocal.app.commands.<name>` and exposes ``register(subparsers)``
and ``run(args) -> int``. Heavy libraries (torch, llama_cpp, textual) are imported inside
``run``, so ``llmlocal --help`` stays fast. Errors the user can fix (`LLMLocalError`) end in
one sentence on stderr and exit code 2. Options a flag leaves open are filled from the config
file as the command line is parsed (`Parser`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from llmlocal.models.errors import LLMLocalError

from .options import fill_from_config

COMMANDS = ("chat", "run", "bench", "quantize", "models", "serve", "plan", "config", "doctor", "completion", "chats", "cache")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose results carry the config file's defaults (`fill_from_config`).

    Subcommand parsers are made of the same class, so every parse, the top-level one or a
    test's ``build_parser().parse_args([...])``, returns finished values.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        fill_from_config(parsed)
        return parsed, rest


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("llmlocal")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    if argv is None and "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (`llmlocal completion`)
        import argcomplete

        argcomplete.autocomplete(parser)  # prints them and exits
    try:
        args = parser.parse_args(argv)  # reads the config file: its errors are the user's to fix
        if args.command is None:
            parser.print_help()
            return 2
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
