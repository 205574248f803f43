"""`llmlocal chats list|show|rm|export|import`: the saved conversations of `llmlocal chat`.

A JSON export holds everything needed to restore a chat as it was: every branch of its
message tree, the branch shown, its system prompt, sampling parameters and reply format
(under ``sampling``), its model and timestamps. Importing one adds new chats (with new ids) and changes nothing else; a file that
is not an export changes nothing at all. A Markdown export is for reading: the title, model
and settings, then the turns of the branch shown.

Examples:

    llmlocal chats list
    llmlocal chats show 3
    llmlocal chats export 3 --format md -o penguins.md
    llmlocal chats export --all --format json -o chats.json
    llmlocal chats import chats.json
    llmlocal chats rm 3 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmlocal.models.errors import LLMLocalError

from ..history import Chat, ChatStore, Conversation, StoredMessage
from . import chosen_action

FORMAT = "llmlocal-chats"
FORMAT_VERSION = 1  # raise it when a change to the format would lose data in an older llmlocal
ROLE_TITLES = {"user": "You", "assistant": "Assistant"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chats",
        help="list, show, export, import and remove saved chats",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="chats_command", metavar="ACTION")
    ls = actions.add_parser("list", aliases=["ls"], help="saved chats: id, title, model, last update, messages")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    show = actions.add_parser("show", help="print the branch a chat shows")
    show.add_argument("id", type=int, metavar="ID", help="a chat id from `llmlocal chats list`")
    rm = actions.add_parser("rm", aliases=["remove"], help="delete chats")
    rm.add_argument("ids", type=int, nargs="+", metavar="ID", help="chat ids from `llmlocal chats list`")
    export = actions.add_parser("export", help="write chats as JSON (restorable) or Markdown (readable)")
    export.add_argument("ids", type=int, nargs="*", metavar="ID", help="chat ids from `llmlocal chats list`")
    export.add_argument("--all", action="store_true", help="export every chat")
    export.add_argument("--format", choices=("json", "md"), default="json", help="json (default) or md")
    export.add_argument("-o", "--output", default=None, metavar="FILE", help="write to FILE (default: stdout)")
    imp = actions.add_parser("import", help="add the chats of a JSON export as new chats")
    imp.add_argument("file", metavar="FILE", help="a file from `llmlocal chats export --format json`, or - for stdin")
    p.set_defaults(func=run, chats_parser=p)


def run(args: argparse.Namespace) -> int:
    from .. import config

    command = chosen_action(args, "chats_command", args.chats_parser)
    if command is None:
        return 2
    config.apply_paths(config.load())  # the config file's data_dir, unless LLMLOCAL_DATA_DIR is set
    store = ChatStore.open()
    try:
        return {"list": _list, "show": _show, "rm": _rm, "export": _export, "import": _import}[command](store, args)
    finally:
        store.close()


# ---- list, show, rm ---------------------------------------------------------------------
def _list(store: ChatStore, args: argparse.Namespace) -> int:
    chats = store.list_chats()
    if args.json:
        rows = [{"id": c.id, "title": c.display_title, "model": c.model, "created_at": c.created_at,
                 "updated_at": c.updated_at, "messages": store.message_count(c.id)} for c in chats]
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    if not chats:
        print("No saved chats: `llmlocal chat` starts one.", file=sys.stderr)
        return 0
    table = [("ID", "TITLE", "MODEL", "UPDATED", "MESSAGES")]
    table += [(str(c.id), c.display_title, c.model or "-", _local_time(c.updated_at), str(store.message_count(c.id)))
              for c in chats]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1])
    return 0


def _show(store: ChatStore, args: argparse.Namespace) -> int:
    conv = store.conversation(_known(store, [args.id])[0])
    print(conversation_text(conv), end="")
    return 0


def _rm(store: ChatStore, args: argparse.Namespace) -> int:
    ids = list(dict.fromkeys(_known(store, args.ids)))
    store.delete_chats(ids)
    print(f"Removed {len(ids)} chat{'s' if len(ids) != 1 else ''}: {', '.join(map(str, ids))}.")
    return 0


def _known(store: ChatStore, ids: list[int]) -> list[int]:
    """``ids`` if every one names a chat; else the error that says where to find them."""
    for chat_id in ids:
        try:
            store.get_chat(chat_id)
        except KeyError:
            raise LLMLocalError(f"There is no chat {chat_id}: `llmlocal chats list` shows the ids.") from None
    return ids


# ---- export -----------------------------------------------------------------------------
def _export(store: ChatStore, args: argparse.Namespace) -> int:
    if args.all == bool(args.ids):
        raise LLMLocalError("Name the chats to export by id (`llmlocal chats list`), or pass --all for every one.")
    ids = [c.id for c in reversed(store.list_chats())] if args.all else _known(store, args.ids)
    if args.format == "json":
        text = json.dumps(export_chats(store, ids), ensure_ascii=False, indent=2) + "\n"
    else:
        text = "\n---\n\n".join(conversation_markdown(store.conversation(i)) for i in ids)
    if args.output is None:
        sys.stdout.write(text)
    else:
        write_atomic(Path(args.output), text)
        print(f"Exported {len(ids)} chat{'s' if len(ids) != 1 else ''} to {args.output}.", file=sys.stderr)
    return 0


def export_chats(store: ChatStore, chat_ids: list[int]) -> dict[str, Any]:
    """The JSON export of ``chat_ids``: a format name and version, and each chat whole."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "exported_at": time.time(),
            "chats": [chat_record(store, i) for i in chat_ids]}


def chat_record(store: ChatStore, chat_id: int) -> dict[str, Any]:
    """One chat with all its branches. Message ids are numbered 1, 2, ... within the chat, so
    exporting an imported chat gives the same record (only the chat's own id differs)."""
    chat = store.get_chat(chat_id)
    messages = store.chat_messages(chat_id)
    local = {m.id: n for n, m in enumerate(messages, start=1)}
    return {
        "id": chat.id, "title": chat.title, "created_at": chat.created_at, "updated_at": chat.updated_at,
        "system_prompt": chat.system_prompt, "sampling": chat.sampling, "model": chat.model,
        "active_leaf": local.get(chat.active_leaf) if chat.active_leaf is not None else None,
        "messages": [
            {"id": local[m.id], "parent_id": local[m.parent_id] if m.parent_id is not None else None,
             "role": m.role, "content": m.content, "status": m.status, "finish_reason": m.finish_reason,
             "model": m.model, "stats": m.stats, "created_at": m.created_at, "updated_at": m.updated_at}
            for m in messages
        ],
    }


def conversation_markdown(conv: Conversation) -> str:
    """A chat's shown branch for reading: title, model and settings, then the turns."""
    chat = conv.chat
    lines = [f"# {chat.display_title}", "", f"- Model: {chat.model or 'not recorded'}",
             f"- Created: {_utc(chat.created_at)}", f"- Updated: {_utc(chat.updated_at)}"]
    sampling = {k: v for k, v in chat.sampling.items() if k != "reply_format"}
    if sampling:
        lines.append("- Sampling: " + ", ".join(f"{k} {_value(v)}" for k, v in sampling.items()))
    reply_format = chat.sampling.get("reply_format")
    if isinstance(reply_format, dict):
        lines.append(f"- Reply format: {_reply_format(reply_format)}")
    if chat.system_prompt:
        lines += ["", "## System prompt", "", chat.system_prompt]
    for m in conv.messages:
        lines += ["", f"## {ROLE_TITLES[m.role]}{_message_note(m, conv.branches)}", "", m.content]
    return "\n".join(lines) + "\n"


def conversation_text(conv: Conversation) -> str:
    """A chat's shown branch as plain text, for the terminal."""
    chat = conv.chat
    lines = [f"{chat.display_title} (chat {chat.id}, {chat.model or 'model not recorded'})"]
    if chat.system_prompt:
        lines += ["", f"[system] {chat.system_prompt}"]
    for m in conv.messages:
        lines += ["", f"[{m.role}{_message_note(m, conv.branches)}]", m.content]
    return "\n".join(lines) + "\n"


def _message_note(m: StoredMessage, branches: dict[int, tuple[int, int]]) -> str:
    notes = []
    position, count = branches.get(m.id, (1, 1))
    if count > 1:
        notes.append(f"branch {position} of {count}")
    if m.status != "complete":
        notes.append("stopped" if m.status == "stopped" else "interrupted")
    return f" ({', '.join(notes)})" if notes else ""


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    path = path.expanduser()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise LLMLocalError(f"Cannot write in {path.parent} ({e.strerror}): choose another -o path.") from None
    try:
        # mkstemp makes the file private (0600): give it the mode of the file it replaces, or
        # the usual one of a new file.
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- import -----------------------------------------------------------------------------
def _import(store: ChatStore, args: argparse.Namespace) -> int:
    chats = read_export(args.file)
    ids = store.restore_chats(chats)
    print(f"Imported {len(ids)} chat{'s' if len(ids) != 1 else ''}: {', '.join(map(str, ids)) or 'none'}.")
    return 0


def read_export(file: str) -> list[tuple[Chat, list[StoredMessage]]]:
    """The chats of a JSON export (``-``: stdin), checked whole before anything is stored."""
    try:
        text = sys.stdin.read() if file == "-" else Path(file).expanduser().read_text(encoding="utf-8")
        data = json.loads(text)
    except FileNotFoundError:
        raise LLMLocalError(f"There is no file {file}: give the path of a JSON chats export.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise _not_an_export(file) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("version"), int):
        raise _not_an_export(file)
    if data["version"] > FORMAT_VERSION:
        raise LLMLocalError(
            f"{file} was exported by a newer llmlocal (format version {data['version']}): upgrade llmlocal to import it."
        )
    if not isinstance(data.get("chats"), list):
        raise _not_an_export(file)
    try:
        return [_chat_from(record) for record in data["chats"]]
    except KeyError as e:
        raise LLMLocalError(f"{file} is a damaged chats export (no {e.args[0]!r} field): export the chats again.") from None
    except (TypeError, ValueError) as e:
        raise LLMLocalError(f"{file} is a damaged chats export ({e}): export the chats again.") from None


def _not_an_export(file: str) -> LLMLocalError:
    where = "stdin" if file == "-" else file
    return LLMLocalError(f"{where} is not a chats export: import a file from `llmlocal chats export --format json`.")


def _chat_from(record: dict[str, Any]) -> tuple[Chat, list[StoredMessage]]:
    messages = [_message_from(m) for m in record["messages"]]
    seen: set[int] = set()
    for m in messages:
        if m.id in seen or (m.parent_id is not None and m.parent_id not in seen):
            raise ValueError(f"message {m.id} is repeated or comes before its parent")
        seen.add(m.id)
    leaf = _optional(record, "active_leaf", int)
    if leaf is not None and leaf not in seen:
        raise ValueError(f"the branch shown ends at a missing message {leaf}")
    sampling = record["sampling"]
    if not isinstance(sampling, dict):
        raise TypeError("sampling is not an object")
    chat = Chat(id=0, title=_optional(record, "title", str), created_at=_number(record["created_at"]),
                updated_at=_number(record["updated_at"]), system_prompt=_optional(record, "system_prompt", str),
                sampling=sampling, model=_optional(record, "model", str), active_leaf=leaf)
    return chat, messages


def _message_from(m: dict[str, Any]) -> StoredMessage:
    if m["role"] not in ROLE_TITLES or m["status"] not in ("complete", "partial", "stopped"):
        raise ValueError(f"message {m.get('id')} has an unknown role or status")
    stats = m.get("stats")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"message {m.get('id')} has stats that are not an object")
    content = m["content"]
    if not isinstance(content, str) or not isinstance(m["id"], int):
        raise TypeError(f"message {m.get('id')} has no text or no integer id")
    return StoredMessage(id=m["id"], chat_id=0, parent_id=_optional(m, "parent_id", int), role=m["role"],
                         content=content, status=m["status"], finish_reason=_optional(m, "finish_reason", str),
                         model=_optional(m, "model", str), stats=stats, created_at=_number(m["created_at"]),
                         updated_at=_number(m["updated_at"]))


def _optional(record: dict[str, Any], key: str, kind: type) -> Any:
    value = record.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise TypeError(f"{key} is not a {kind.__name__}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a time in seconds")
    return value


# ---- formatting -------------------------------------------------------------------------
def _local_time(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def _utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(timestamp))


def _reply_format(stored: dict[str, Any]) -> str:
    """A chat's stored reply format (`llmlocal.app.tui.settings.ReplyFormat`), for reading."""
    if stored.get("type") == "json":
        return "JSON object"
    if "file" in stored:
        return f"JSON schema in {stored['file']}"
    if isinstance(stored.get("schema"), str):
        try:
            return f"JSON schema `{json.dumps(json.loads(stored['schema']), ensure_ascii=False)}`"  # on one line
        except json.JSONDecodeError:
            return f"JSON schema {_value(stored['schema'])}"
    return _value(stored)


def _value(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict, str)) or v is None else str(v)
