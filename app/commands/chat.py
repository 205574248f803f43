"""`llmlocal chat`: a streaming chat in the terminal, with saved conversations.

Examples:

    llmlocal chat                                   # reopen the most recent chat
    llmlocal chat "Explain the KV cache in two lines."   # a new chat that starts with this message
    llmlocal chat --system "You are a concise assistant." --temperature 0.3
    llmlocal chat --system-preset terse             # [system_prompts] terse in the config file
    llmlocal chat --model ~/models/qwen2.5-1.5b-instruct-q4_k_m.gguf --ctx 4096
    llmlocal chat --format json "Three primary colours."   # every reply of this chat is a JSON object
    llmlocal chat --json-schema book.schema.json "Describe a book."   # JSON valid against the schema

Chats are saved in $LLMLOCAL_DATA_DIR/chats.db (default: the config file's data_dir, else
$XDG_DATA_HOME/llmlocal, or ~/.local/share/llmlocal). --system (or --system-preset NAME),
the sampling options and --format / --json-schema set the defaults of new chats, over the
config file's; a saved chat keeps its own (F3 changes them). Without --model, the default
model (`llmlocal models default`).

Keys: Enter sends, Shift+Enter or Ctrl+J starts a new line, Esc stops a reply, Ctrl+N new
chat, Ctrl+R regenerate, F2 model, F3 chat settings, F1 or ? all keys, Ctrl+Q quits.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..options import (
    add_format_options,
    add_model_options,
    add_sampling_options,
    grammar_from_args,
    plan_from_args,
    sampling_from_args,
)

if TYPE_CHECKING:
    from llmlocal.engine import Engine, Plan

    from ..history import ChatStore
    from ..tui import ChatApp
    from ..tui.settings import ReplyFormat


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("message", nargs="?", default=None,
                   help="start a new chat with this message (default: reopen the most recent chat)")
    add_model_options(p)
    add_sampling_options(p)
    add_format_options(p, chat=True)
    p.add_argument("--no-prefill-draft", dest="prefill_draft", action="store_false",
                   help="do not prefill the message while it is typed (by default, once the message box is "
                        "still for a moment, the conversation with it is computed ahead, so the reply starts sooner)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmlocal.models import resolve

    from .. import config
    from ..history import ChatStore

    config.apply_paths(config.load())  # the chat database and the model picker's store
    reply_format = reply_format_from_args(args)  # a bad schema is reported before the model loads
    plan = plan_from_args(args)
    if plan.endpoint is None:
        resolve(plan.model)  # a missing or broken model is reported here, before the screen opens
    store = ChatStore.open()  # an unreadable database too
    try:
        make_app(args, store, plan=plan, reply_format=reply_format).run()
    finally:
        store.close()
    return 0


def reply_format_from_args(args: argparse.Namespace) -> ReplyFormat:
    """The reply format --format / --json-schema give new chats, its schema read and compiled
    here (`LLMLocalError` as `run` gives it)."""
    from llmlocal.engine.prompt.grammar import check_grammar

    from ..tui.settings import ReplyFormat

    grammar = grammar_from_args(args)
    if grammar is None:
        return ReplyFormat()
    check_grammar(grammar)
    if args.json_schema is not None:
        return ReplyFormat.typed("json_schema", args.json_schema)
    return ReplyFormat("json")


def make_app(
    args: argparse.Namespace,
    store: ChatStore,
    *,
    plan: Plan | None = None,
    reply_format: ReplyFormat | None = None,
    engine: Engine | None = None,
) -> ChatApp:
    """The chat app the flags describe (``engine``: one already loaded, for tests)."""
    from ..tui import ChatApp

    def plan_for(name: str) -> Plan:
        # A model picked in the chat is planned like one named on the command line, with the
        # same flags pinned (the picker runs this in a worker: the planner reads the file).
        return plan_from_args(args, model=name)

    return ChatApp(
        plan if plan is not None else plan_from_args(args),
        sampling_from_args(args),
        system=args.system,
        engine=engine,
        store=store,
        first_message=args.message,
        plan_for=plan_for,
        reply_format=reply_format if reply_format is not None else reply_format_from_args(args),
        prefill_draft=getattr(args, "prefill_draft", True),
    )
