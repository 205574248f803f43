"""The conversation store: SQLite on disk, branches, search, and what survives a crash."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from llmlocal.app.history import MIGRATIONS, ChatStore, data_dir, default_db_path
from llmlocal.models.errors import LLMLocalError


class Clock:
    """A clock the test moves by hand: timestamps are exact and ordered."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> ChatStore:
    s = ChatStore(tmp_path / "chats.db", clock=Clock())
    yield s
    s.close()


def test_data_dir_follows_the_override_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "mine" / "chats.db"
    monkeypatch.delenv("LLMLOCAL_DATA_DIR")
    assert data_dir() == tmp_path / "xdg" / "llmlocal"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home" / ".local" / "share" / "llmlocal"


def test_a_new_database_is_in_wal_mode_at_the_current_schema(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "chats.db"
    ChatStore(path).close()  # creates the directories too
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) >= 1
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"chats", "messages"} <= tables
    db.close()
    reopened = ChatStore(path)  # opening again migrates nothing and keeps the version
    assert reopened.schema_version == len(MIGRATIONS)
    reopened.close()


def test_a_newer_schema_or_a_foreign_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(LLMLocalError, match="newer llmlocal.*LLMLOCAL_DATA_DIR"):
        ChatStore(newer)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(LLMLocalError, match="not a readable chat database"):
        ChatStore(junk)


def test_chat_settings_title_and_order(store: ChatStore) -> None:
    first = store.create_chat(system_prompt="Be brief.", sampling={"temperature": 0.2}, model="smollm2-135m")
    second = store.create_chat()
    assert first.display_title == "New chat" and first.title is None
    assert (first.system_prompt, first.sampling, first.model) == ("Be brief.", {"temperature": 0.2}, "smollm2-135m")
    # The first user message names the chat (first non-empty line, cut to length).
    store.add_message(first.id, None, "user", "\n  How do tides work on a planet with two moons and a long day?\nmore")
    named = store.get_chat(first.id)
    assert named.title == "How do tides work on a planet with two moons an…"
    assert len(named.title) == 48
    # A later message does not rename it, and an explicit rename sticks.
    store.add_message(first.id, None, "user", "Another")
    assert store.get_chat(first.id).title == named.title
    store.rename_chat(second.id, "  Plans  ")
    assert store.get_chat(second.id).title == "Plans"
    with pytest.raises(LLMLocalError, match="cannot be empty"):
        store.rename_chat(second.id, "   ")
    # Most recently written first.
    assert [c.id for c in store.list_chats()] == [first.id, second.id]
    store.update_chat(second.id, system_prompt="Speak French.", sampling={"temperature": 0.0, "max_tokens": 9})
    changed = store.get_chat(second.id)
    assert (changed.system_prompt, changed.sampling) == ("Speak French.", {"temperature": 0.0, "max_tokens": 9})
    store.update_chat(second.id, clear_system_prompt=True)
    assert store.get_chat(second.id).system_prompt is None


def test_search_matches_titles_and_any_branch_ignoring_case(store: ChatStore) -> None:
    a = store.create_chat(title="Rust lifetimes")
    b = store.create_chat()
    q = store.add_message(b.id, None, "user", "What is 100% of nothing?")
    store.add_message(b.id, q.id, "assistant", "It is Zero.")
    store.add_message(b.id, None, "user", "an edited first message")  # b now shows this branch
    c = store.create_chat(title="under_score")
    assert [x.id for x in store.list_chats("rust")] == [a.id]
    assert [x.id for x in store.list_chats("zero")] == [b.id]  # found in a branch not shown
    assert [x.id for x in store.list_chats("100%")] == [b.id]  # % is literal, not a wildcard
    assert [x.id for x in store.list_chats("u_d")] == []  # so is _ (a wildcard would match "und")
    assert [x.id for x in store.list_chats("under_")] == [c.id]
    assert store.list_chats("no such words") == []


def test_messages_form_a_tree_and_every_branch_stays_reachable(store: ChatStore) -> None:
    chat = store.create_chat()
    q1 = store.add_message(chat.id, None, "user", "Q1")
    a1 = store.add_message(chat.id, q1.id, "assistant", "A1")
    q2 = store.add_message(chat.id, a1.id, "user", "Q2")
    a2 = store.add_message(chat.id, q2.id, "assistant", "A2")
    conv = store.conversation(chat.id)
    assert [m.content for m in conv.messages] == ["Q1", "A1", "Q2", "A2"]
    assert all(conv.branches[m.id] == (1, 1) for m in conv.messages)

    # Regenerate A2: a sibling under Q2, shown at once.
    a2b = store.add_message(chat.id, q2.id, "assistant", "A2 again")
    conv = store.conversation(chat.id)
    assert [m.content for m in conv.messages] == ["Q1", "A1", "Q2", "A2 again"]
    assert conv.branches[a2b.id] == (2, 2)

    # Edit Q1: a new root; the old tree is one step to the left.
    q1b = store.add_message(chat.id, None, "user", "Q1 edited")
    a1b = store.add_message(chat.id, q1b.id, "assistant", "A1 edited")
    conv = store.conversation(chat.id)
    assert [m.content for m in conv.messages] == ["Q1 edited", "A1 edited"]
    assert conv.branches[q1b.id] == (2, 2)
    assert [s.id for s in store.siblings(q1b.id)] == [q1.id, q1b.id]

    store.switch_branch(q1b.id, -1)  # back to the old branch, down to its newest leaf
    assert [m.content for m in store.conversation(chat.id).messages] == ["Q1", "A1", "Q2", "A2 again"]
    store.switch_branch(a2b.id, -1)
    assert [m.content for m in store.conversation(chat.id).messages] == ["Q1", "A1", "Q2", "A2"]
    store.switch_branch(a2.id, -5)  # past the end: stays on the first
    assert store.get_chat(chat.id).active_leaf == a2.id
    store.switch_branch(q1.id, +1)
    assert store.get_chat(chat.id).active_leaf == a1b.id
    assert store.message_count(chat.id) == 7


def test_deleting_the_shown_message_shows_a_sibling_or_the_parent(store: ChatStore) -> None:
    chat = store.create_chat()
    q = store.add_message(chat.id, None, "user", "Q")
    a = store.add_message(chat.id, q.id, "assistant", "A")
    q2 = store.add_message(chat.id, a.id, "user", "unanswered")
    store.delete_message(q2.id)
    assert store.get_chat(chat.id).active_leaf == a.id
    edit = store.add_message(chat.id, None, "user", "edited")
    store.delete_message(edit.id)  # back to the other root's newest leaf
    assert store.get_chat(chat.id).active_leaf == a.id
    store.delete_message(q.id)  # the subtree goes with it
    assert store.message_count(chat.id) == 0
    assert store.get_chat(chat.id).active_leaf is None
    assert store.conversation(chat.id).messages == []


def test_a_partial_reply_is_on_disk_at_each_update(tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    store = ChatStore(path)
    chat = store.create_chat()
    q = store.add_message(chat.id, None, "user", "Tell me a story")
    reply = store.add_message(chat.id, q.id, "assistant", "", status="partial", model="smollm2-135m")
    store.update_message(reply.id, "Once upon", "partial")
    # Another connection (another process) sees it at once: every call has committed.
    other = ChatStore(path)
    seen = other.conversation(chat.id).messages
    assert [(m.role, m.content, m.status) for m in seen] == [
        ("user", "Tell me a story", "complete"),
        ("assistant", "Once upon", "partial"),
    ]
    store.update_message(reply.id, "Once upon a time.", "complete", "stop", {"completion_tokens": 5, "ttft_s": 0.1})
    final = other.get_message(reply.id)
    assert (final.status, final.finish_reason, final.stats, final.model) == (
        "complete", "stop", {"completion_tokens": 5, "ttft_s": 0.1}, "smollm2-135m",
    )
    other.close()
    store.close()


def test_deleting_a_chat_removes_its_messages(store: ChatStore) -> None:
    keep = store.create_chat()
    store.add_message(keep.id, None, "user", "stay")
    gone = store.create_chat()
    q = store.add_message(gone.id, None, "user", "go")
    store.add_message(gone.id, q.id, "assistant", "went")
    store.delete_chat(gone.id)
    assert [c.id for c in store.list_chats()] == [keep.id]
    with pytest.raises(KeyError):
        store.get_message(q.id)
    assert store.message_count(keep.id) == 1
