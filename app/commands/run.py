"""`llmlocal run PROMPT`: one completion, streamed to stdout, or one JSON object with --json.

Examples:

    llmlocal run "Name three rivers in Africa."
    llmlocal run "Write a haiku about rain." --temperature 0 --max-tokens 40
    llmlocal run "Summarise this:" --system "You are terse." --json
    cat notes.txt | llmlocal run - --max-tokens 200
    llmlocal run "Why is the sky blue?" --system-preset terse   # [system_prompts] in the config file
    llmlocal run "Three primary colours, as JSON." --format json
    llmlocal run "Describe a book." --json-schema book.schema.json   # a reply valid against the schema
    llmlocal run "Is 17 prime?" --choice yes --choice no

Without --model it loads the default model (`llmlocal models default`); the sampling options
default to the config file's settings where it has them (`llmlocal config list`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ..options import (
    add_format_options,
    add_model_options,
    add_sampling_options,
    grammar_from_args,
    plan_from_args,
    sampling_from_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="one completion, streamed to stdout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", metavar="PROMPT", nargs="?", default=None,
                   help="the user message; '-', or nothing with a pipe on stdin, reads it from stdin (UTF-8)")
    add_model_options(p)
    add_sampling_options(p)
    add_format_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and stats")
    p.add_argument("--verbose", "-v", action="store_true", help="print stats to stderr after the reply")
    p.set_defaults(func=run)


def _read_stdin() -> str:
    """The whole of stdin as UTF-8 text; anything else is the user's to convert."""
    from llmlocal.models.errors import LLMLocalError

    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LLMLocalError(
            f"The prompt on stdin is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}): "
            "convert it first, e.g. with iconv -f latin1 -t utf-8."
        ) from None


def run(args: argparse.Namespace) -> int:
    from llmlocal.engine import DoneEvent, Engine, Request
    from llmlocal.models.errors import LLMLocalError

    prompt = args.prompt
    if prompt is None and sys.stdin.isatty():
        raise LLMLocalError("No prompt: pass the text to send, or pipe it in (e.g. echo hi | llmlocal run).")
    if prompt is None or prompt == "-":
        prompt = _read_stdin()
    if not prompt.strip():
        raise LLMLocalError("The prompt is empty: pass the text to send, or '-' to read it from stdin.")
    sampling = dataclasses.replace(sampling_from_args(args), grammar=grammar_from_args(args))
    if sampling.grammar is not None:  # before the model loads: a typo should not cost a load
        from llmlocal.engine.prompt.grammar import check_grammar

        check_grammar(sampling.grammar)
    plan = plan_from_args(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}
    ]

    with Engine.load(plan) as engine:
        if engine.template_notice:
            print(f"llmlocal: {engine.template_notice}", file=sys.stderr)
        request = Request.chat(messages, sampling)
        stream = engine.generate(request)
        done: DoneEvent | None = None
        try:
            for event in stream:
                if isinstance(event, DoneEvent):
                    done = event
                elif not args.json and event.text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            # Stop the backend, then drain: the stream ends with a 'cancelled' DoneEvent.
            engine.cancel(request.id)
            for event in stream:
                if isinstance(event, DoneEvent):
                    done = event
        assert done is not None, "a stream always ends with a DoneEvent"

        if args.json:
            print(json.dumps(_result(done, engine.model.name), ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            if args.verbose:
                _print_stats(done)
        return 130 if done.finish_reason == "cancelled" else 0


def _result(done: Any, model: str) -> dict[str, Any]:
    stats = done.stats.to_dict()
    out: dict[str, Any] = {
        "text": done.text,
        "model": model,
        "backend": stats.pop("backend"),
        "device": stats.pop("device"),
        "finish_reason": done.finish_reason,
        "prompt_tokens": stats.pop("prompt_tokens"),
        "completion_tokens": stats.pop("completion_tokens"),
        "ttft_s": stats.pop("ttft_s", None),
        "decode_tok_s": stats.pop("decode_tok_s", None),
    }
    out.update(stats)
    return out


def _print_stats(done: Any) -> None:
    s = done.stats
    parts = [f"{s.backend} on {s.device}", f"prompt {s.prompt_tokens} tok", f"reply {s.completion_tokens} tok"]
    if s.ttft_s is not None:
        parts.append(f"TTFT {s.ttft_s * 1000:.0f} ms")
    if s.decode_tok_s is not None:
        parts.append(f"{s.decode_tok_s:.1f} tok/s")
    if s.itl_ms_p50 is not None:
        parts.append(f"ITL p50 {s.itl_ms_p50:.1f} ms, p95 {s.itl_ms_p95:.1f} ms")
    parts.append(f"finish: {done.finish_reason}")
    print("  ".join(parts), file=sys.stderr)
