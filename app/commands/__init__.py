"""One module per `llmlocal` subcommand: each adds its parser and calls library functions."""

from __future__ import annotations

import argparse


def chosen_action(args: argparse.Namespace, dest: str, parser: argparse.ArgumentParser) -> str | None:
    """The action of a command that has several (`models list`, `chats rm`), its aliases
    (`ls`, `remove`) resolved; with none given, the command's help is printed and None returned."""
    action = {"ls": "list", "remove": "rm"}.get(getattr(args, dest), getattr(args, dest))
    if action is None:
        parser.print_help()
    return action
