"""`llmlocal completion SHELL`: the shell's tab-completion script for llmlocal.

Commands, options and their choices complete from the same argument parser the command line
uses (argcomplete drives it: the script calls llmlocal back with the line typed so far).

Examples:

    llmlocal completion bash >> ~/.bashrc
    llmlocal completion zsh >> ~/.zshrc
    llmlocal completion fish > ~/.config/fish/completions/llmlocal.fish
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "fish")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "completion",
        help="print the tab-completion script for bash, zsh or fish",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import argcomplete

    print(argcomplete.shellcode(["llmlocal"], shell=args.shell), end="")
    return 0
