"""A chat's reply format (F3, `chat --format json` / `--json-schema`): every reply of the chat
is generated under the grammar, through the engine's constrained decoding, on the real
starter model."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from textual.widgets import Select, Static, TextArea
from tui_support import panel_text, type_and_send, wait_for, wait_idle
from llmlocal.app import cli
from llmlocal.app.commands.chat import make_app, reply_format_from_args
from llmlocal.app.commands.chats import conversation_markdown, export_chats, read_export
from llmlocal.app.history import MIGRATIONS, ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.conversation import Notice
from llmlocal.app.tui.settings import ChatSettings, ReplyFormat
from llmlocal.app.tui.settings_screen import ChatSettingsScreen
from llmlocal.engine import Engine, Grammar, Plan, SamplingParams
from llmlocal.engine.prompt.grammar import check_grammar
from llmlocal.models.errors import LLMLocalError

# Greedy, with room for a whole object: the starter model closes this one by itself, in about
# 20 tokens (a longer one, "Describe a cat as JSON.", closed on one CPU and looped on another,
# whose kernels round differently).
GREEDY = SamplingParams(temperature=0, max_tokens=300)
CAT = "Give me a JSON object with a cat's name and age."
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
          "required": ["colour", "count"], "additionalProperties": False}


async def choose_format(pilot, kind: str, schema: str = "") -> None:
    """In the open settings panel: pick the reply format (and type its schema), then Ctrl+S."""
    screen = pilot.app.screen
    assert isinstance(screen, ChatSettingsScreen)
    screen.query_one("#set-reply_format", Select).value = kind
    await pilot.pause(0.05)
    assert screen.query_one("#reply-schema", TextArea).display == (kind == "json_schema")
    screen.query_one("#reply-schema", TextArea).text = schema
    await pilot.press("ctrl+s")


async def send_refused(pilot, text: str) -> None:
    """Send ``text`` where the reply will be refused (the text comes back to the box at once)."""
    app = pilot.app
    app.prompt.focus()
    app.prompt.text = text
    await pilot.press("enter")
    await wait_idle(pilot)


def settings_error(app: ChatApp) -> str:
    return str(app.screen.query_one("#settings-error", Static).content)


async def test_json_object_from_f3_gives_json_replies_kept_on_reopening_and_export(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(path))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_idle(pilot)
        assert "replies:" not in panel_text(app)  # free text: nothing shown
        await pilot.press("f3")
        await choose_format(pilot, "json")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen), what="the panel to close")
        assert app.settings.reply_format == ReplyFormat("json")
        assert "replies: JSON" in panel_text(app)

        await type_and_send(pilot, CAT)
        reply = app.messages[-1]
        assert reply.role == "assistant" and reply.finish_reason == "stop"
        assert isinstance(json.loads(reply.content), dict)
        chat_id = app.chat.id
        assert app.store.get_chat(chat_id).sampling["reply_format"] == {"type": "json"}
        # A new chat starts as free text again.
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.chat is None)
        assert app.settings.reply_format == ReplyFormat() and "replies:" not in panel_text(app)
    app.store.close()

    again = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(path))  # reopening the chat
    async with again.run_test(size=(120, 40)) as pilot:
        await wait_idle(pilot)
        assert again.chat.id == chat_id and again.settings.reply_format == ReplyFormat("json")
        assert "replies: JSON" in panel_text(again)
        await pilot.press("f3")
        assert again.screen.query_one("#set-reply_format", Select).value == "json"  # shown as set
        await pilot.press("escape")

    # Export and import: the imported chat has the same reply format.
    exported = tmp_path / "chats.json"
    exported.write_text(json.dumps(export_chats(again.store, [chat_id])))
    other = ChatStore(tmp_path / "other.db")
    [new_id] = other.restore_chats(read_export(str(exported)))
    imported = other.get_chat(new_id)
    assert imported.sampling["reply_format"] == {"type": "json"}
    assert ChatSettings.from_chat(imported).reply_format == ReplyFormat("json")
    assert "- Reply format: JSON object" in conversation_markdown(other.conversation(new_id))
    other.close()
    again.store.close()


async def test_a_schema_that_does_not_compile_is_refused_in_the_panel(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat(sampling={"temperature": 0.0})
    bad = '{"type": "object", "properties": {"n": {"type": "numbr"}}}'
    with pytest.raises(LLMLocalError) as grammar_error:
        check_grammar(Grammar.json_schema(bad))
    with pytest.raises(LLMLocalError) as json_error:
        Grammar.json_schema('{"type": ')
    broken_file = tmp_path / "broken.json"
    broken_file.write_text(bad)
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await choose_format(pilot, "json_schema", bad)
        assert app.screen is screen and settings_error(app) == str(grammar_error.value)  # Grammar's own sentence
        await choose_format(pilot, "json_schema", '{"type": ')
        assert app.screen is screen and settings_error(app) == str(json_error.value)
        await choose_format(pilot, "json_schema", str(tmp_path / "missing.json"))
        assert app.screen is screen and settings_error(app).startswith("Cannot read the JSON schema")
        await choose_format(pilot, "json_schema", str(broken_file))
        assert app.screen is screen and settings_error(app) == f"{broken_file}: {grammar_error.value}"
        await choose_format(pilot, "json_schema", "")
        assert app.screen is screen and "JSON schema is missing" in settings_error(app)
        # Nothing was saved; leaving discards the choice.
        assert "reply_format" not in store.get_chat(chat.id).sampling
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is not screen)
        assert app.settings.reply_format == ReplyFormat()

        # A good schema file is kept as its absolute path.
        (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
        await pilot.press("f3")
        await choose_format(pilot, "json_schema", str(tmp_path / "s.json"))
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen), what="the panel to close")
        assert store.get_chat(chat.id).sampling["reply_format"] == {"type": "json_schema", "file": str(tmp_path / "s.json")}
        assert "replies: JSON schema" in panel_text(app)
    store.close()


async def test_a_schema_file_that_breaks_later_refuses_the_reply_and_keeps_the_message(engine: Engine, tmp_path: Path) -> None:
    schema = tmp_path / "colour.json"
    schema.write_text(json.dumps(SCHEMA))
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat(sampling={"temperature": 0.0, "max_tokens": 100,
                                       "reply_format": {"type": "json_schema", "file": str(schema)}})
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_idle(pilot)
        assert app.chat.id == chat.id and "replies: JSON schema" in panel_text(app)
        await type_and_send(pilot, "Pick a colour and a count.")
        reply = json.loads(app.messages[-1].content)
        assert set(reply) == {"colour", "count"} and reply["colour"] in ("red", "green", "blue")
        stored = store.message_count(chat.id)

        schema.unlink()  # the file disappears
        await send_refused(pilot, "And another one?")
        await wait_for(pilot, lambda: app.query(Notice), what="a notice")
        notice = app.query(Notice).last().text
        assert notice.startswith(f"Cannot read the JSON schema {schema}") and "\n" not in notice
        assert app.prompt.text == "And another one?"  # the message is kept to send again
        assert store.message_count(chat.id) == stored  # and nothing was stored

        schema.write_text("{not json")  # the file comes back broken
        await send_refused(pilot, "Try again.")
        await wait_for(pilot, lambda: app.query(Notice) and app.query(Notice).last().text != notice, what="a new notice")
        notice = app.query(Notice).last().text
        assert notice.startswith(f"{schema}: The JSON schema is not valid JSON") and "\n" not in notice
        assert app.prompt.text == "Try again." and store.message_count(chat.id) == stored
    store.close()


async def test_chat_format_json_flag_sets_the_new_chat(engine: Engine, tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["chat", "--format", "json", "-t", "0", "-n", "300", CAT])
    store = ChatStore(tmp_path / "chats.db")
    store.create_chat(title="An older chat")  # not the one the message goes to
    app = make_app(args, store, plan=Plan(), engine=engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.chat is not None and app.messages, what="the first message")
        await wait_idle(pilot)
        assert app.settings.reply_format == ReplyFormat("json") and "replies: JSON" in panel_text(app)
        assert app.store.get_chat(app.chat.id).sampling["reply_format"] == {"type": "json"}
        assert isinstance(json.loads(app.messages[-1].content), dict)
    store.close()


def test_chat_json_schema_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    args = cli.build_parser().parse_args(["chat", "--json-schema", "s.json"])
    assert reply_format_from_args(args) == ReplyFormat("json_schema", str(tmp_path / "s.json"))  # absolute
    assert reply_format_from_args(cli.build_parser().parse_args(["chat"])) == ReplyFormat()
    # A schema that cannot be used is reported as `run` reports it, before anything loads.
    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(tmp_path / "data"))
    assert cli.main(["chat", "--json-schema", "missing.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmlocal: Cannot read the JSON schema missing.json") and "--json-schema" in err
    (tmp_path / "bad.json").write_text('{"type": "numbr"}')
    assert cli.main(["chat", "--json-schema", "bad.json"]) == 2
    assert "does not compile" in capsys.readouterr().err


async def test_an_old_database_without_a_reply_format_loads(engine: Engine, tmp_path: Path) -> None:
    """A chats.db written before reply formats existed (schema 1, sampling without the key)."""
    path = tmp_path / "chats.db"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("PRAGMA user_version = 1")
    old_sampling = {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
                    "repeat_last_n": 64, "seed": None, "max_tokens": 8, "stop": [], "n": 1, "ignore_eos": False,
                    "grammar": None, "logprobs": None}
    db.execute("INSERT INTO chats (title, created_at, updated_at, sampling) VALUES ('Old', 1, 1, ?)",
               (json.dumps(old_sampling),))
    db.execute("INSERT INTO messages (chat_id, role, content, status, created_at, updated_at) "
               "VALUES (1, 'user', 'Hi', 'complete', 1, 1)")
    db.execute("UPDATE chats SET active_leaf = 1")
    db.commit()
    db.close()
    store = ChatStore(path)
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_idle(pilot)
        assert app.chat.title == "Old" and [m.content for m in app.messages] == ["Hi"]
        assert app.settings.reply_format == ReplyFormat() and app.settings.sampling.max_tokens == 8
        assert "replies:" not in panel_text(app)
        await pilot.press("f3")
        assert app.screen.query_one("#set-reply_format", Select).value == "text"
        await pilot.press("ctrl+s")  # saving it as it is stores no reply format: still free text
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen))
        assert "reply_format" not in store.get_chat(1).sampling
    store.close()
