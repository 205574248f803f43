"""`llmlocal config path|list|get|set|unset`: the settings file.

The file ($LLMLOCAL_CONFIG, else $XDG_CONFIG_HOME/llmlocal/config.toml, i.e.
~/.config/llmlocal/config.toml) holds the defaults of options the command line leaves open.
A setting comes from the first of: a flag, an environment variable (LLMLOCAL_MODELS_DIR,
LLMLOCAL_DATA_DIR), the file, the built-in default. `set` checks the key and the value before
it writes (a temporary file, then a rename), and keeps the other keys; comments are not kept.

Keys: model, backend, ctx, threads, temperature, top_p, top_k, min_p, repeat_penalty,
max_tokens, seed, models_dir, data_dir, and system_prompts.NAME (a system prompt preset, used
with --system-preset NAME).

Examples:

    llmlocal config list
    llmlocal config set temperature 0.3
    llmlocal config set ctx 4096
    llmlocal config set system_prompts.terse "Answer in one sentence."
    llmlocal run "Why is the sky blue?" --system-preset terse
    llmlocal config get model
    llmlocal config unset ctx
    $EDITOR "$(llmlocal config path)"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="show and change the settings file (default model, sampling, paths...)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="config_command", metavar="ACTION")
    actions.add_parser("path", help="print where the settings file is (it may not exist yet)")
    ls = actions.add_parser("list", aliases=["ls"], help="every setting, its value, and where the value comes from")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    get = actions.add_parser("get", help="print the value a setting has now")
    get.add_argument("key", metavar="KEY", help="a key from `llmlocal config list`, or system_prompts.NAME")
    put = actions.add_parser("set", help="check a value and save it in the file")
    put.add_argument("key", metavar="KEY", help="a key from `llmlocal config list`, or system_prompts.NAME")
    put.add_argument("value", metavar="VALUE")
    unset = actions.add_parser("unset", help="remove a setting from the file: the built-in default applies again")
    unset.add_argument("key", metavar="KEY")
    p.set_defaults(func=run, config_parser=p)


def run(args: argparse.Namespace) -> int:
    command = {"ls": "list"}.get(args.config_command, args.config_command)
    if command is None:
        args.config_parser.print_help()
        return 2
    return {"path": _path, "list": _list, "get": _get, "set": _set, "unset": _unset}[command](args)


def _path(args: argparse.Namespace) -> int:
    from ..config import config_path

    print(config_path())
    return 0


def _list(args: argparse.Namespace) -> int:
    from ..config import KEYS, effective, load

    cfg = load()
    settings = [effective(cfg, name) for name in KEYS]
    if args.json:
        out = {
            "path": str(cfg.path),
            "exists": cfg.path.is_file(),
            "settings": {s.key: {"value": _json_value(s.value), "source": s.source} for s in settings},
            "system_prompts": dict(cfg.system_prompts),
        }
        print(json.dumps(out, ensure_ascii=False))
        return 0
    rows = [("KEY", "VALUE", "FROM")]
    for s in settings:
        if s.value is None:
            rows.append((s.key, "-", f"built-in: {KEYS[s.key].builtin}"))
        else:
            rows.append((s.key, format_value(s.value), s.source))
    for name, text in cfg.system_prompts.items():
        rows.append((f"system_prompts.{name}", _preview(text), "config file"))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}")
    where = "" if cfg.path.is_file() else " (not created yet: `llmlocal config set KEY VALUE` writes it)"
    print(f"\nfile: {cfg.path}{where}")
    return 0


def _get(args: argparse.Namespace) -> int:
    from ..config import KEYS, PRESETS, ConfigError, effective, load

    cfg = load()
    if args.key.startswith(f"{PRESETS}."):
        print(cfg.system_prompt(args.key.split(".", 1)[1]))
        return 0
    if args.key not in KEYS:
        raise ConfigError(f"Unknown key '{args.key}': use one of {', '.join(KEYS)}, or {PRESETS}.NAME.")
    setting = effective(cfg, args.key)
    if setting.value is None:
        print(f"{args.key} is not set: the built-in default applies ({KEYS[args.key].builtin}).", file=sys.stderr)
        return 1
    if setting.source.startswith("$") and args.key in cfg.values:
        print(f"({setting.source} overrides the file's {format_value(cfg.values[args.key])})", file=sys.stderr)
    print(format_value(setting.value))
    return 0


def _set(args: argparse.Namespace) -> int:
    from ..config import KEYS, PRESETS, effective, set_value

    cfg = set_value(args.key, args.value)
    if args.key.startswith(f"{PRESETS}."):
        name = args.key.split(".", 1)[1]
        print(f"Saved the system prompt preset '{name}' in {cfg.path}: use it with --system-preset {name}.")
        return 0
    print(f"Set {args.key} = {format_value(cfg.values[args.key])} in {cfg.path}.")
    setting = effective(cfg, args.key)
    if KEYS[args.key].env and setting.source != "config file":
        print(f"Note: {setting.source} is set, and overrides the file while it is.", file=sys.stderr)
    return 0


def _unset(args: argparse.Namespace) -> int:
    from ..config import config_path, unset_value

    if unset_value(args.key):
        print(f"Removed {args.key} from {config_path()}.")
    else:
        print(f"{args.key} was not set in {config_path()}; nothing changed.")
    return 0


def format_value(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _json_value(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _preview(text: str, width: int = 60) -> str:
    """A preset's text on one line, cut to ``width`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"
