"""`llmlocal chats`: list, show, rm, export to JSON and Markdown, and import back, on chats
built through the store's own API (with branches), in a data directory of the test's own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from llmlocal.app import cli
from llmlocal.app.commands.chats import FORMAT, FORMAT_VERSION
from llmlocal.app.history import ChatStore, StoredMessage
from llmlocal.models.errors import LLMLocalError

START = 1_767_225_600.0  # 2026-01-01 00:00 UTC


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        self.now += 60.0
        return self.now


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "data"
    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(folder))
    return folder


@pytest.fixture
def store(data: Path) -> Iterator[ChatStore]:
    s = ChatStore(data / "chats.db", clock=Clock())
    yield s
    s.close()


def build_penguins(store: ChatStore) -> int:
    """A chat with settings and three branches; the branch shown is not the newest one."""
    chat = store.create_chat(system_prompt="Answer in one line.", sampling={"temperature": 0.3, "top_k": 20},
                             model="smollm2-135m")
    first = store.add_message(chat.id, None, "user", "Do penguins fly?")
    store.add_message(chat.id, first.id, "assistant", "No, they swim.", model="smollm2-135m")
    kept = store.add_message(chat.id, first.id, "assistant", "", status="partial", model="smollm2-135m")
    store.update_message(kept.id, "They cannot fly", "stopped", None, {"decode_tok_s": 71.5, "completion_tokens": 4})
    edited = store.add_message(chat.id, None, "user", "Can penguins fly at all?")  # an edit: a second root
    store.add_message(chat.id, edited.id, "assistant", "No.", model="smollm2-135m")
    store.show_branch(kept.id)  # show the stopped reply's branch
    return chat.id


def build_math(store: ChatStore) -> int:
    chat = store.create_chat(title="Sums")
    q = store.add_message(chat.id, None, "user", "What is 2 + 2?")
    store.add_message(chat.id, q.id, "assistant", "4.")
    return chat.id


def llmlocal(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_sentence_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2 and out == ""
    assert err.startswith("llmlocal: ") and err.count("\n") == 1 and err.rstrip().endswith(".")
    assert "Traceback" not in err
    for word in words:
        assert word in err


def tree(store: ChatStore, chat_id: int) -> list[tuple]:
    """A chat's messages with ids replaced by their position: comparable across stores."""
    messages = store.chat_messages(chat_id)
    index = {m.id: n for n, m in enumerate(messages)}
    return [(index.get(m.parent_id), m.role, m.content, m.status, m.finish_reason, m.model, m.stats,
             m.created_at, m.updated_at) for m in messages]


# ---- export -> import -------------------------------------------------------------------
def test_export_import_round_trip_keeps_branches_and_settings(
    store: ChatStore, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    penguins, math = build_penguins(store), build_math(store)
    exported = tmp_path / "chats.json"
    code, out, err = llmlocal(capsys, "chats", "export", "--all", "--format", "json", "-o", str(exported))
    assert code == 0 and out == "" and "Exported 2 chats" in err
    first = json.loads(exported.read_text())
    assert first["format"] == FORMAT and first["version"] == FORMAT_VERSION
    assert [c["id"] for c in first["chats"]] == [penguins, math]
    assert len(first["chats"][0]["messages"]) == 5

    # Into another data directory: the chats come back whole, with new ids.
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(other))
    ChatStore(other / "chats.db").create_chat(title="Already here")  # takes id 1
    code, out, err = llmlocal(capsys, "chats", "import", str(exported))
    assert code == 0 and out == "Imported 2 chats: 2, 3.\n"
    restored = ChatStore(other / "chats.db")
    for old, new in ((penguins, 2), (math, 3)):
        before, after = store.conversation(old), restored.conversation(new)
        assert tree(restored, new) == tree(store, old)
        assert [m.content for m in after.messages] == [m.content for m in before.messages]
        assert list(after.branches.values()) == list(before.branches.values())
        for field in ("title", "created_at", "updated_at", "system_prompt", "sampling", "model"):
            assert getattr(after.chat, field) == getattr(before.chat, field)
    shown = restored.conversation(2)
    assert [m.content for m in shown.messages] == ["Do penguins fly?", "They cannot fly"]
    assert list(shown.branches.values()) == [(1, 2), (2, 2)]
    assert shown.chat.sampling == {"temperature": 0.3, "top_k": 20}
    assert shown.messages[1].stats == {"decode_tok_s": 71.5, "completion_tokens": 4}

    # ... and exporting them again gives the same file, but for the ids and the export time.
    again = tmp_path / "again.json"
    assert llmlocal(capsys, "chats", "export", "2", "3", "-o", str(again))[0] == 0
    second = json.loads(again.read_text())
    for record in first["chats"] + second["chats"]:
        del record["id"]
    assert second["chats"] == first["chats"]
    restored.close()


def test_markdown_export_shows_the_branch_shown_with_title_model_and_settings(
    store: ChatStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    penguins = build_penguins(store)
    code, out, _ = llmlocal(capsys, "chats", "export", str(penguins), "--format", "md")
    assert code == 0
    assert out == (
        "# Do penguins fly?\n"
        "\n"
        "- Model: smollm2-135m\n"
        "- Created: 2026-01-01 00:01 UTC\n"
        "- Updated: 2026-01-01 00:07 UTC\n"
        "- Sampling: temperature 0.3, top_k 20\n"
        "\n"
        "## System prompt\n"
        "\n"
        "Answer in one line.\n"
        "\n"
        "## You (branch 1 of 2)\n"
        "\n"
        "Do penguins fly?\n"
        "\n"
        "## Assistant (branch 2 of 2, stopped)\n"
        "\n"
        "They cannot fly\n"
    )
    # Several chats in one file, separated by a rule; -o replaces a file in one rename.
    target = tmp_path / "both.md"
    target.write_text("old contents")
    math = build_math(store)
    assert llmlocal(capsys, "chats", "export", str(penguins), str(math), "--format", "md", "-o", str(target))[0] == 0
    text = target.read_text()
    assert text.startswith("# Do penguins fly?") and "\n---\n\n# Sums\n" in text and text.endswith("4.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.md", "data"]  # no temporary file left


# ---- list, show, rm ---------------------------------------------------------------------
def test_list_and_show(store: ChatStore, capsys: pytest.CaptureFixture[str]) -> None:
    penguins, math = build_penguins(store), build_math(store)
    code, out, _ = llmlocal(capsys, "chats", "list", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["id"] for r in rows] == [math, penguins]  # most recent first
    assert rows[1] | {"created_at": 0, "updated_at": 0} == {
        "id": penguins, "title": "Do penguins fly?", "model": "smollm2-135m", "created_at": 0, "updated_at": 0,
        "messages": 5,
    }
    code, out, _ = llmlocal(capsys, "chats", "list")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "TITLE", "MODEL", "UPDATED", "MESSAGES"]
    assert lines[1].startswith(f"{math}   Sums") and lines[1].endswith("  2")
    code, out, _ = llmlocal(capsys, "chats", "show", str(penguins))
    assert code == 0
    assert out == (
        f"Do penguins fly? (chat {penguins}, smollm2-135m)\n\n[system] Answer in one line.\n\n"
        "[user (branch 1 of 2)]\nDo penguins fly?\n\n[assistant (branch 2 of 2, stopped)]\nThey cannot fly\n"
    )


def test_rm_removes_the_named_chats_or_none(store: ChatStore, capsys: pytest.CaptureFixture[str]) -> None:
    penguins, math = build_penguins(store), build_math(store)
    third = build_math(store)
    code, out, err = llmlocal(capsys, "chats", "rm", str(penguins), "999")
    assert_one_sentence_error(code, out, err, "no chat 999", "llmlocal chats list")
    assert [c.id for c in store.list_chats()] == [third, math, penguins]  # nothing removed
    code, out, _ = llmlocal(capsys, "chats", "rm", str(penguins), str(third))
    assert code == 0 and out == f"Removed 2 chats: {penguins}, {third}.\n"
    assert [c.id for c in store.list_chats()] == [math]
    assert store.chat_messages(penguins) == []  # the messages go with the chat


# ---- errors -----------------------------------------------------------------------------
def test_user_errors_end_in_one_sentence_and_exit_2(
    store: ChatStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    penguins = build_penguins(store)
    assert_one_sentence_error(*llmlocal(capsys, "chats", "show", "42"), "no chat 42")
    assert_one_sentence_error(*llmlocal(capsys, "chats", "export", "42", "--format", "md"), "no chat 42")
    assert_one_sentence_error(*llmlocal(capsys, "chats", "export"), "--all")
    assert_one_sentence_error(*llmlocal(capsys, "chats", "export", str(penguins), "--all"), "--all")
    missing_dir = tmp_path / "no" / "such" / "dir" / "out.json"
    assert_one_sentence_error(*llmlocal(capsys, "chats", "export", "--all", "-o", str(missing_dir)), "-o")
    assert_one_sentence_error(*llmlocal(capsys, "chats", "import", str(tmp_path / "gone.json")), "no file")

    markdown = tmp_path / "chat.md"
    assert llmlocal(capsys, "chats", "export", str(penguins), "--format", "md", "-o", str(markdown))[0] == 0
    not_json = llmlocal(capsys, "chats", "import", str(markdown))
    assert_one_sentence_error(*not_json, "not a chats export", "--format json")
    other_json = tmp_path / "other.json"
    other_json.write_text('{"chats": []}')
    assert_one_sentence_error(*llmlocal(capsys, "chats", "import", str(other_json)), "not a chats export")
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION + 1, "chats": []}))
    assert_one_sentence_error(*llmlocal(capsys, "chats", "import", str(newer)), "newer llmlocal", "upgrade")
    assert [c.id for c in store.list_chats()] == [penguins]


@pytest.mark.parametrize("damage", ["orphan", "role", "no_content", "leaf"])
def test_a_damaged_export_imports_nothing(
    damage: str, store: ChatStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    penguins, math = build_penguins(store), build_math(store)
    exported = tmp_path / "chats.json"
    assert llmlocal(capsys, "chats", "export", "--all", "-o", str(exported))[0] == 0
    data = json.loads(exported.read_text())
    last = data["chats"][1]  # the first chat is whole: it must not be stored either
    if damage == "orphan":
        last["messages"][1]["parent_id"] = 77
    elif damage == "role":
        last["messages"][0]["role"] = "system"
    elif damage == "no_content":
        del last["messages"][1]["content"]
    else:
        last["active_leaf"] = 9
    exported.write_text(json.dumps(data))
    assert_one_sentence_error(*llmlocal(capsys, "chats", "import", str(exported)), "damaged chats export")
    assert [c.id for c in store.list_chats()] == [math, penguins]


def test_restoring_is_one_transaction(store: ChatStore) -> None:
    """The store itself stores all the chats or none, whatever the caller checked before."""
    penguins = build_penguins(store)
    good = (store.get_chat(penguins), store.chat_messages(penguins))
    orphan = StoredMessage(id=5, chat_id=0, parent_id=4, role="assistant", content="?", status="complete",
                           finish_reason=None, model=None, stats=None, created_at=START, updated_at=START)
    with pytest.raises(LLMLocalError, match="before its parent"):
        store.restore_chats([good, (store.get_chat(penguins), [orphan])])
    assert [c.id for c in store.list_chats()] == [penguins]
    assert store.message_count(penguins) == 5
    copy = store.restore_chats([good])
    assert len(copy) == 1 and tree(store, copy[0]) == tree(store, penguins)
