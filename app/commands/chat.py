"""`llmlocal chat`: a streaming chat in the terminal.

Examples:

    llmlocal chat
    llmlocal chat --system "You are a concise assistant." --temperature 0.3
    llmlocal chat --model ~/models/qwen2.5-1.5b-instruct-q4_k_m.gguf --ctx 4096

Keys: Enter sends, Shift+Enter or Ctrl+J starts a new line, Esc stops a reply,
Ctrl+N starts a new chat, Ctrl+Q quits.
"""

from __future__ import annotations

import argparse

from ..options import add_model_options, add_sampling_options, plan_from_args, sampling_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmlocal.models import resolve

    from ..tui import ChatApp

    plan = plan_from_args(args)
    resolve(plan.model)  # a missing or broken model is reported here, before the screen opens
    ChatApp(plan, sampling_from_args(args), system=args.system).run()
    return 0
