"""`llmlocal models list|pull|default|rm|info`: the models on this machine.

Names: the built-in starter (`smollm2-135m`), paths to .gguf files, and Hugging Face repos
(`org/repo:Q4_K_M` picks that GGUF of the repo; `org/repo` a safetensors checkpoint, or the
repo's only GGUF). Downloads go into Hugging Face's own cache (HF_HOME, HF_HUB_CACHE; tokens
from HF_TOKEN or `hf auth login`), resumable. With HF_HUB_OFFLINE=1 nothing is fetched.

A .gguf file you already have runs as it is (`--model path/to/file.gguf`); put it (or a
symlink to it) in the models directory ($LLMLOCAL_MODELS_DIR, else the config file's
models_dir, else $XDG_DATA_HOME/llmlocal/models) and `models list` shows it too.
`models default NAME` makes a model the one every command loads without --model.

Examples:

    llmlocal models list
    llmlocal models pull bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
    llmlocal models default bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
    llmlocal models default ~/Downloads/mistral-7b-instruct-q4_k_m.gguf
    llmlocal models info bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
    llmlocal chat --model bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
    llmlocal models rm bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from llmlocal.models.sizes import format_size

from . import chosen_action


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list, download, inspect and remove models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="models_command", metavar="ACTION")
    ls = actions.add_parser("list", aliases=["ls"], help="models on this machine: name, size, quant, architecture, context, location")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    pull = actions.add_parser("pull", help="download a Hugging Face model into the local cache")
    pull.add_argument("name", metavar="NAME", help="org/repo:QUANT (a GGUF) or org/repo (a safetensors checkpoint)")
    pull.add_argument("--token", default=None, metavar="T", help="Hugging Face token (default: HF_TOKEN or `hf auth login`)")
    pull.add_argument("--json", action="store_true", help="print the stored model as JSON")
    rm = actions.add_parser("rm", aliases=["remove"], help="delete a model and free its space")
    rm.add_argument("name", metavar="NAME", help="a name from `llmlocal models list`")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    info = actions.add_parser("info", help="what a model is (its ModelSpec) and how it would run here")
    info.add_argument("name", metavar="NAME", help="a name, a path or an org/repo:QUANT in the cache")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    default = actions.add_parser("default", help="the model commands load without --model: show it, or set it")
    default.add_argument("name", metavar="NAME", nargs="?", default=None,
                         help="a name from `llmlocal models list`, or a path to a .gguf file (default: print the current one)")
    p.set_defaults(func=run, models_parser=p)


def run(args: argparse.Namespace) -> int:
    from .. import config

    command = chosen_action(args, "models_command", args.models_parser)
    if command is None:
        return 2
    config.apply_paths(config.load())  # the config file's models_dir, unless LLMLOCAL_MODELS_DIR is set
    return {"list": _list, "pull": _pull, "rm": _rm, "info": _info, "default": _default}[command](args)


# ---- the default model ------------------------------------------------------------------
def default_model() -> tuple[str, str]:
    """(the model commands load without --model, "config file" or "built-in")."""
    from ..config import effective, load

    setting = effective(load(), "model")
    return setting.value, setting.source


def _is_default(m: Any, default: str) -> bool:
    return default in (m.name, str(m.path))


def _default(args: argparse.Namespace) -> int:
    from ..config import set_value

    if args.name is None:
        name, source = default_model()
        print(name)
        if source == "built-in":
            print("(built-in: set another with `llmlocal models default NAME`)", file=sys.stderr)
        return 0
    cfg = set_value("model", args.name)
    print(f"Default model: {cfg.values['model']} (saved in {cfg.path}).")
    return 0


# ---- list -------------------------------------------------------------------------------
def _list(args: argparse.Namespace) -> int:
    from llmlocal.models.store import list_models

    models = list_models()
    default, source = default_model()
    if args.json:
        print(json.dumps([{**_model_dict(m), "default": _is_default(m, default)} for m in models], ensure_ascii=False))
        return 0
    rows = [("NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", "SOURCE", "WHERE")]
    for m in models:
        rows.append((
            m.name,
            format_size(m.size_bytes),
            m.quant or "-",
            m.arch or "-",
            f"{m.context_length:,}" if m.context_length else "-",
            m.source,
            str(m.path),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    # On stderr: the table on stdout stays one row per model for scripts.
    print(_default_note(default, source, any(_is_default(m, default) for m in models)), file=sys.stderr)
    return 0


def _default_note(default: str, source: str, listed: bool) -> str:
    where = "built-in" if source == "built-in" else "set in the config file"
    note = f"Default model: {default} ({where})"
    if not listed:
        note += ", not in this list: a file outside the models directory, or one that is gone"
    return note + ". Change it with `llmlocal models default NAME`."


def _model_dict(m: Any) -> dict[str, Any]:
    d = {k: v for k, v in m.__dict__.items()}
    d["path"] = str(m.path)
    return d


# ---- pull -------------------------------------------------------------------------------
def _pull(args: argparse.Namespace) -> int:
    from llmlocal.models.store import pull

    got = pull(args.name, token=args.token)
    m = got.model
    if args.json:
        print(json.dumps({**_model_dict(m), "kind": got.kind, "from_cache": got.from_cache}, ensure_ascii=False))
        return 0
    verb = "Already downloaded" if got.from_cache else "Downloaded"
    print(f"{verb}: {m.name} ({format_size(m.size_bytes)}) in {m.path}.")
    if got.kind == "checkpoint":
        print(
            f"{m.name} is a safetensors checkpoint: make a GGUF with `llmlocal quantize {m.repo_id}` "
            f"(or run it as is with `--model {m.name} --backend paged`)."
        )
        if sys.stdin.isatty() and sys.stdout.isatty() and _ask(f"Run `llmlocal quantize {m.repo_id}` now?"):
            from llmlocal.app.cli import main

            return main(["quantize", str(m.repo_id)])
    else:
        print(f"Chat with it: llmlocal chat --model {m.name}")
    return _offer_default(m.name, ask=got.kind == "gguf")


def _offer_default(name: str, ask: bool) -> int:
    """Say how to make ``name`` the default; ask when a person is at the terminal."""
    from ..config import set_value

    if default_model()[0] == name:
        print(f"{name} is the default model.")
        return 0
    if ask and sys.stdin.isatty() and sys.stdout.isatty() and _ask(f"Make {name} the default model?"):
        cfg = set_value("model", name)
        print(f"Default model: {name} (saved in {cfg.path}).")
        return 0
    print(f"Make it the default: llmlocal models default {name}")
    return 0


def _ask(question: str) -> bool:
    try:
        return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


# ---- rm ---------------------------------------------------------------------------------
def _rm(args: argparse.Namespace) -> int:
    from llmlocal.models.errors import LLMLocalError
    from llmlocal.models.store import plan_removal

    stored, strategy = plan_removal(args.name)
    size = format_size(strategy.expected_freed_size)
    if not args.yes:
        if not sys.stdin.isatty():
            raise LLMLocalError(f"Removing {stored.name} frees {size}: pass --yes to remove it without a question.")
        if not _ask(f"Remove {stored.name} ({size}, {stored.path})?"):
            print("Nothing removed.")
            return 1
    strategy.execute()
    print(f"Removed {stored.name}: freed {size}.")
    if _is_default(stored, default_model()[0]):
        from ..config import unset_value

        unset_value("model")
        print(f"It was the default model: the default is the built-in {default_model()[0]} again.")
    return 0


# ---- info -------------------------------------------------------------------------------
def _info(args: argparse.Namespace) -> int:
    from llmlocal.models import resolve
    from llmlocal.models.store import find

    model = resolve(args.name)
    stored = find(args.name)
    summary = model.spec.summary()
    verdict = planner_verdict(model.spec)
    if args.json:
        out = {"name": model.name, **summary}
        if stored is not None:
            out.update(source=stored.source, size_bytes=stored.size_bytes, quant=stored.quant)
        out["plan"] = verdict
        print(json.dumps(out, ensure_ascii=False, default=str))
        return 0
    print(f"{model.name}")
    if stored is not None:
        print(f"  {'source':<18}{stored.source}, {format_size(stored.size_bytes)} on disk")
    for key, value in summary.items():
        if key == "tensor_types":
            value = ", ".join(f"{t} {format_size(n)}" for t, n in value.items())
        elif key in ("params", "weight_bytes"):
            value = f"{value:,}"
        print(f"  {key:<18}{value}")
    print(f"  {'plan':<18}{verdict['verdict']}")
    for reason in verdict["reasons"]:
        print(f"  {'':<18}- {reason}")
    return 0


def planner_verdict(spec: Any) -> dict[str, Any]:
    """What the memory planner chooses for ``spec`` on this machine, and why.

    PLANNER HOOK: the one place `models info` calls `llmlocal.engine.planning.planner`. A model that
    fits nowhere gives the planner's one-sentence refusal as the verdict.
    """
    from llmlocal.engine.planning.hardware import probe
    from llmlocal.engine.planning.planner import choose
    from llmlocal.models.errors import LLMLocalError

    if spec.format not in ("gguf", "hf"):
        return {"verdict": "the server decides: a remote model is not planned here", "reasons": []}
    from llmlocal.engine import Plan
    from llmlocal.engine.core.kv_disk import default_dir

    try:  # as chat and run plan it: the prefix cache's disk tier on, as they keep it by default
        choice = choose([spec], probe(), base=Plan(kv_cache_dir=str(default_dir())))
    except LLMLocalError as e:
        return {"verdict": str(e), "reasons": []}
    return {"verdict": choice.chosen.describe(), "reasons": list(choice.reasons)}
