"""The conversation store: chats and their messages in SQLite, in the user's data directory.

    store = ChatStore.open()                   # $LLMLOCAL_DATA_DIR/chats.db, or the XDG data dir
    chat = store.create_chat(system_prompt="Be brief.", sampling={"temperature": 0.3})
    question = store.add_message(chat.id, None, "user", "Hi")
    reply = store.add_message(chat.id, question.id, "assistant", "", status="partial")
    store.update_message(reply.id, "Hello", status="complete")
    store.conversation(chat.id).messages       # root -> active leaf

Messages form a tree: each has a parent (None for the first of a chat). Editing an earlier
user message or regenerating a reply adds a sibling, so every older branch stays reachable;
the chat remembers which leaf is shown (``active_leaf``). Every call commits before it
returns, and the database runs in WAL mode, so a process killed mid-reply leaves everything
committed so far: a reply still being written is stored with ``status='partial'``.

One connection is shared by the app's threads (the UI and the worker streaming a reply),
serialised by a lock. Nothing here imports Textual or the engine.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmlocal.models.errors import LLMLocalError

Role = Literal["user", "assistant"]
Status = Literal["complete", "partial", "stopped"]
# complete  the message is whole (a reply that ended: stop, length or context)
# partial   a reply still being written, or one whose writer died (shown as interrupted)
# stopped   a reply the user stopped; the text so far is kept

TITLE_CHARS = 48  # a title taken from the first message is cut to this many characters

# Each entry upgrades the schema by one version (PRAGMA user_version counts them). Never edit
# a released entry: append a new one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE chats (
        id            INTEGER PRIMARY KEY,
        title         TEXT,                        -- NULL until the first user message names it
        created_at    REAL NOT NULL,               -- Unix seconds
        updated_at    REAL NOT NULL,
        system_prompt TEXT,
        sampling      TEXT NOT NULL DEFAULT '{}',  -- JSON object of sampling parameters
        model         TEXT,                        -- model name the chat last used
        active_leaf   INTEGER                      -- messages.id of the branch shown; NULL: empty
    );
    CREATE TABLE messages (
        id            INTEGER PRIMARY KEY,
        chat_id       INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        parent_id     INTEGER REFERENCES messages(id) ON DELETE CASCADE,
        role          TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
        content       TEXT NOT NULL,
        status        TEXT NOT NULL CHECK (status IN ('complete', 'partial', 'stopped')),
        finish_reason TEXT,
        model         TEXT,
        stats         TEXT,                        -- JSON object: the reply's engine figures
        created_at    REAL NOT NULL,
        updated_at    REAL NOT NULL
    );
    CREATE INDEX messages_by_chat ON messages(chat_id, id);
    CREATE INDEX messages_by_parent ON messages(parent_id);
    """,
)


def data_dir() -> Path:
    """Where llmlocal keeps user data: $LLMLOCAL_DATA_DIR, else the platform's data directory."""
    override = os.environ.get("LLMLOCAL_DATA_DIR")
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "llmlocal"
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "llmlocal"


def default_db_path() -> Path:
    return data_dir() / "chats.db"


@dataclass(frozen=True)
class Chat:
    id: int
    title: str | None
    created_at: float
    updated_at: float
    system_prompt: str | None
    sampling: dict[str, Any]
    model: str | None
    active_leaf: int | None

    @property
    def display_title(self) -> str:
        return self.title or "New chat"


@dataclass(frozen=True)
class StoredMessage:
    id: int
    chat_id: int
    parent_id: int | None
    role: Role
    content: str
    status: Status
    finish_reason: str | None
    model: str | None
    stats: dict[str, Any] | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Conversation:
    """A chat's shown branch: its messages root -> active leaf, and where each sits among
    its siblings (``branches[id] == (position, count)``, position counted from 1)."""

    chat: Chat
    messages: list[StoredMessage]
    branches: dict[int, tuple[int, int]]


class ChatStore:
    def __init__(self, path: str | os.PathLike[str], clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # isolation_level=None: autocommit; multi-statement changes open their own
            # transaction (`_tx`). check_same_thread=False: the lock serialises the threads.
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a killed process
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise LLMLocalError(
                f"{self.path} is not a readable chat database ({e}): move it aside, or set "
                "LLMLOCAL_DATA_DIR to another directory."
            ) from None

    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None) -> ChatStore:
        return cls(path if path is not None else default_db_path())

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _migrate(self) -> None:
        # BEGIN IMMEDIATE takes the write lock before the version is read, so two processes
        # opening a new database at once cannot both run a step.
        with self._tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise LLMLocalError(
                    f"{self.path} was written by a newer llmlocal (schema {version}): upgrade "
                    "llmlocal, or set LLMLOCAL_DATA_DIR to another directory."
                )
            for number in range(version, len(MIGRATIONS)):
                for statement in _statements(MIGRATIONS[number]):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {number + 1}")

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- chats ---------------------------------------------------------------------------
    def create_chat(
        self,
        title: str | None = None,
        system_prompt: str | None = None,
        sampling: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> Chat:
        now = self._clock()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO chats (title, created_at, updated_at, system_prompt, sampling, model) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (title, now, now, system_prompt, json.dumps(sampling or {}), model),
            )
            chat_id = int(cur.lastrowid or 0)
        return self.get_chat(chat_id)

    def get_chat(self, chat_id: int) -> Chat:
        with self._lock:
            row = self._db.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise KeyError(f"no chat {chat_id}")
        return _chat(row)

    def list_chats(self, query: str = "") -> list[Chat]:
        """All chats, most recently updated first; with ``query``, those whose title or any
        message (in any branch) contains it, ignoring case."""
        with self._lock:
            if not query.strip():
                rows = self._db.execute("SELECT * FROM chats ORDER BY updated_at DESC, id DESC").fetchall()
            else:
                pattern = "%" + query.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                rows = self._db.execute(
                    "SELECT * FROM chats WHERE title LIKE ?1 ESCAPE '\\' OR id IN "
                    "(SELECT chat_id FROM messages WHERE content LIKE ?1 ESCAPE '\\') "
                    "ORDER BY updated_at DESC, id DESC",
                    (pattern,),
                ).fetchall()
        return [_chat(r) for r in rows]

    def rename_chat(self, chat_id: int, title: str) -> Chat:
        title = title.strip()
        if not title:
            raise LLMLocalError("A chat title cannot be empty: type at least one character.")
        with self._tx() as db:
            db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))
        return self.get_chat(chat_id)

    def update_chat(
        self,
        chat_id: int,
        *,
        system_prompt: str | None = None,
        sampling: dict[str, Any] | None = None,
        model: str | None = None,
        clear_system_prompt: bool = False,
    ) -> Chat:
        """Change a chat's settings; arguments left as None keep their value."""
        with self._tx() as db:
            if system_prompt is not None or clear_system_prompt:
                db.execute("UPDATE chats SET system_prompt = ? WHERE id = ?", (system_prompt or None, chat_id))
            if sampling is not None:
                db.execute("UPDATE chats SET sampling = ? WHERE id = ?", (json.dumps(sampling), chat_id))
            if model is not None:
                db.execute("UPDATE chats SET model = ? WHERE id = ?", (model, chat_id))
        return self.get_chat(chat_id)

    def delete_chat(self, chat_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
            db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def delete_chats(self, chat_ids: list[int]) -> None:
        """Delete several chats, all or none: an unknown id deletes nothing."""
        with self._tx() as db:
            for chat_id in chat_ids:
                if db.execute("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is None:
                    raise KeyError(f"no chat {chat_id}")
            for chat_id in chat_ids:
                db.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
                db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def message_count(self, chat_id: int) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM messages WHERE chat_id = ?", (chat_id,)).fetchone()[0])

    # ---- messages ------------------------------------------------------------------------
    def add_message(
        self,
        chat_id: int,
        parent_id: int | None,
        role: Role,
        content: str,
        status: Status = "complete",
        model: str | None = None,
    ) -> StoredMessage:
        """Append a message under ``parent_id`` and show its branch. The first user message of
        an unnamed chat names it."""
        now = self._clock()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (chat_id, parent_id, role, content, status, model, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, parent_id, role, content, status, model, now, now),
            )
            message_id = int(cur.lastrowid or 0)
            db.execute("UPDATE chats SET active_leaf = ?, updated_at = ? WHERE id = ?", (message_id, now, chat_id))
            if role == "user":
                db.execute("UPDATE chats SET title = ? WHERE id = ? AND title IS NULL", (_title_from(content), chat_id))
            if model is not None:
                db.execute("UPDATE chats SET model = ? WHERE id = ?", (model, chat_id))
        return self.get_message(message_id)

    def update_message(
        self,
        message_id: int,
        content: str,
        status: Status,
        finish_reason: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> StoredMessage:
        now = self._clock()
        with self._tx() as db:
            db.execute(
                "UPDATE messages SET content = ?, status = ?, finish_reason = ?, stats = ?, updated_at = ? WHERE id = ?",
                (content, status, finish_reason, json.dumps(stats) if stats is not None else None, now, message_id),
            )
            db.execute(
                "UPDATE chats SET updated_at = ? WHERE id = (SELECT chat_id FROM messages WHERE id = ?)",
                (now, message_id),
            )
        return self.get_message(message_id)

    def get_message(self, message_id: int) -> StoredMessage:
        with self._lock:
            row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message(row)

    def delete_message(self, message_id: int) -> None:
        """Delete a message and everything under it. If the chat was showing it, the chat
        shows the newest remaining sibling's branch, or else the parent."""
        with self._tx() as db:
            row = db.execute("SELECT chat_id, parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                return
            chat_id, parent_id = row["chat_id"], row["parent_id"]
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))  # children cascade
            leaf = db.execute("SELECT active_leaf FROM chats WHERE id = ?", (chat_id,)).fetchone()[0]
            if leaf is not None and db.execute("SELECT 1 FROM messages WHERE id = ?", (leaf,)).fetchone():
                return
            sibling = db.execute(
                "SELECT id FROM messages WHERE chat_id = ? AND parent_id IS ? ORDER BY id DESC LIMIT 1",
                (chat_id, parent_id),
            ).fetchone()
            shown = self.newest_leaf(sibling["id"]) if sibling else parent_id
            db.execute("UPDATE chats SET active_leaf = ? WHERE id = ?", (shown, chat_id))

    def chat_messages(self, chat_id: int) -> list[StoredMessage]:
        """Every message of a chat, in all its branches, oldest first (a parent before its
        children: a child is always added after its parent)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)).fetchall()
        return [_message(r) for r in rows]

    # ---- restoring -----------------------------------------------------------------------
    def restore_chats(self, chats: list[tuple[Chat, list[StoredMessage]]]) -> list[int]:
        """Store chats read back from an export as new chats (new ids), all or none, keeping
        their titles, settings, timestamps, every branch and the branch shown. Message ids
        and parent ids are the export's own, each message after its parent."""
        with self._tx() as db:
            return [self._restore_chat(db, chat, messages) for chat, messages in chats]

    def _restore_chat(self, db: sqlite3.Connection, chat: Chat, messages: list[StoredMessage]) -> int:
        cur = db.execute(
            "INSERT INTO chats (title, created_at, updated_at, system_prompt, sampling, model) VALUES (?, ?, ?, ?, ?, ?)",
            (chat.title, chat.created_at, chat.updated_at, chat.system_prompt, json.dumps(chat.sampling), chat.model),
        )
        chat_id = int(cur.lastrowid or 0)
        new_ids: dict[int, int] = {}  # the export's message id -> the stored one
        for m in messages:
            if m.parent_id is not None and m.parent_id not in new_ids:
                raise LLMLocalError(f"Message {m.id} comes before its parent {m.parent_id}: export the chat again.")
            cur = db.execute(
                "INSERT INTO messages (chat_id, parent_id, role, content, status, finish_reason, model, stats, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, new_ids.get(m.parent_id) if m.parent_id is not None else None, m.role, m.content,
                 m.status, m.finish_reason, m.model, json.dumps(m.stats) if m.stats is not None else None,
                 m.created_at, m.updated_at),
            )
            new_ids[m.id] = int(cur.lastrowid or 0)
        leaf = new_ids.get(chat.active_leaf) if chat.active_leaf is not None else None
        db.execute("UPDATE chats SET active_leaf = ? WHERE id = ?", (leaf, chat_id))
        return chat_id

    # ---- branches ------------------------------------------------------------------------
    def conversation(self, chat_id: int) -> Conversation:
        """The shown branch of a chat, root first."""
        chat = self.get_chat(chat_id)
        with self._lock:
            rows = self._db.execute(
                "WITH RECURSIVE up(id, depth) AS ("
                " SELECT id, 0 FROM messages WHERE id = ?"
                " UNION ALL SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id"
                "  WHERE m.parent_id IS NOT NULL) "
                "SELECT messages.* FROM messages JOIN up USING (id) ORDER BY up.depth DESC",
                (chat.active_leaf,),
            ).fetchall()
            pairs = self._db.execute(
                "SELECT id, parent_id FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)
            ).fetchall()
        children: dict[int | None, list[int]] = {}
        for r in pairs:
            children.setdefault(r["parent_id"], []).append(r["id"])
        messages = [_message(r) for r in rows]
        branches = {}
        for m in messages:
            siblings = children.get(m.parent_id, [m.id])
            branches[m.id] = (siblings.index(m.id) + 1, len(siblings))
        return Conversation(chat, messages, branches)

    def siblings(self, message_id: int) -> list[StoredMessage]:
        """The message and the others under the same parent, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT s.* FROM messages s JOIN messages m ON s.chat_id = m.chat_id AND s.parent_id IS m.parent_id "
                "WHERE m.id = ? ORDER BY s.id",
                (message_id,),
            ).fetchall()
        return [_message(r) for r in rows]

    def newest_leaf(self, message_id: int) -> int:
        """The leaf reached from ``message_id`` by always taking the newest child."""
        with self._lock:
            current = message_id
            while True:
                row = self._db.execute(
                    "SELECT id FROM messages WHERE parent_id = ? ORDER BY id DESC LIMIT 1", (current,)
                ).fetchone()
                if row is None:
                    return current
                current = int(row["id"])

    def show_branch(self, message_id: int) -> Chat:
        """Show the branch through ``message_id`` (down to its newest leaf)."""
        message = self.get_message(message_id)
        leaf = self.newest_leaf(message_id)
        with self._tx() as db:
            db.execute("UPDATE chats SET active_leaf = ? WHERE id = ?", (leaf, message.chat_id))
        return self.get_chat(message.chat_id)

    def switch_branch(self, message_id: int, step: int) -> Chat:
        """Show the sibling ``step`` places after (or, negative, before) ``message_id``;
        past either end the choice stays where it is."""
        siblings = self.siblings(message_id)
        ids = [s.id for s in siblings]
        index = max(0, min(len(ids) - 1, ids.index(message_id) + step))
        return self.show_branch(ids[index])


def _statements(script: str) -> list[str]:
    """Split a migration into single statements (``execute`` runs one at a time)."""
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    if pending.strip():
        statements.append(pending.strip())
    return statements


def _title_from(content: str) -> str:
    line = next((ln.strip() for ln in content.splitlines() if ln.strip()), "New chat")
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(
        id=row["id"],
        title=row["title"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        system_prompt=row["system_prompt"],
        sampling=json.loads(row["sampling"] or "{}"),
        model=row["model"],
        active_leaf=row["active_leaf"],
    )


def _message(row: sqlite3.Row) -> StoredMessage:
    return StoredMessage(
        id=row["id"],
        chat_id=row["chat_id"],
        parent_id=row["parent_id"],
        role=row["role"],
        content=row["content"],
        status=row["status"],
        finish_reason=row["finish_reason"],
        model=row["model"],
        stats=json.loads(row["stats"]) if row["stats"] else None,
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
