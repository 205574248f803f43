"""The sidebar of chats: switch, rename, delete (with confirmation), search; and chats that
survive the app being closed and opened again."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.chat_list import ChatItems, ChatList
from llmlocal.app.tui.conversation import MessageView
from llmlocal.app.tui.dialogs import ConfirmScreen, TextPromptScreen
from llmlocal.engine import Engine, Plan, SamplingParams
from tui_support import panel_text, type_and_send, wait_for, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def seed(store: ChatStore, title: str, *turns: str) -> int:
    """A chat with alternating user / assistant messages."""
    chat = store.create_chat(title=title)
    parent = None
    for i, text in enumerate(turns):
        parent = store.add_message(chat.id, parent, "user" if i % 2 == 0 else "assistant", text).id
    return chat.id


async def test_switch_between_chats_from_the_sidebar(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    older = seed(store, "Birds", "Do penguins fly?", "No, they swim.")
    newer = seed(store, "Math", "What is 2 + 2?", "4.")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        assert app.chat.id == newer  # the most recent chat opens
        assert app.query_one(ChatList).titles() == ["Math", "Birds"]
        assert [v.text for v in app.query(MessageView)] == ["What is 2 + 2?", "4."]
        items = app.query_one(ChatItems)
        items.focus()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.chat.id == older, what="the other chat")
        assert [v.text for v in app.query(MessageView)] == ["Do penguins fly?", "No, they swim."]
        assert app.focused is app.prompt
        # A message goes to the chat shown, which moves to the top of the list.
        await type_and_send(pilot, "Why not?")
        assert [m.content for m in store.conversation(older).messages][:3] == ["Do penguins fly?", "No, they swim.", "Why not?"]
        assert app.query_one(ChatList).titles() == ["Birds", "Math"]
        assert store.message_count(newer) == 2


async def test_rename_and_search(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    seed(store, "Birds", "Do penguins fly?", "No, they swim.")
    math = seed(store, "Math", "What is 2 + 2?", "It is four.")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        app.query_one(ChatItems).focus()
        await pilot.press("r")
        assert isinstance(app.screen, TextPromptScreen)
        await pilot.press(*["backspace"] * 10, *"Arithmetic", "enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, TextPromptScreen))
        assert store.get_chat(math).title == "Arithmetic"
        assert app.query_one(ChatList).titles() == ["Arithmetic", "Birds"]
        # F4 renames the chat shown; Esc leaves it as it was.
        await pilot.press("f4")
        assert isinstance(app.screen, TextPromptScreen)
        await pilot.press("escape")
        assert store.get_chat(math).title == "Arithmetic"
        # Search: by title, by content (case-insensitive), and back to all.
        await pilot.press("ctrl+f")
        await pilot.press(*"PENGUIN")
        await wait_for(pilot, lambda: app.query_one(ChatList).titles() == ["Birds"])
        await pilot.press(*["backspace"] * 7, *"four")
        await wait_for(pilot, lambda: app.query_one(ChatList).titles() == ["Arithmetic"])
        await pilot.press(*["backspace"] * 4)
        await wait_for(pilot, lambda: app.query_one(ChatList).titles() == ["Arithmetic", "Birds"])


async def test_delete_asks_first(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    birds = seed(store, "Birds", "Do penguins fly?", "No.")
    math = seed(store, "Math", "What is 2 + 2?", "4.")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        assert app.chat.id == math
        app.query_one(ChatItems).focus()
        await pilot.press("delete")
        assert isinstance(app.screen, ConfirmScreen)
        assert "Math" in app.screen.question and "2 messages" in app.screen.question
        await pilot.press("n")
        await pilot.pause(0.05)
        assert not isinstance(app.screen, ConfirmScreen)
        assert [c.id for c in store.list_chats()] == [math, birds]
        app.query_one(ChatItems).focus()
        await pilot.press("delete")
        await pilot.press("y")
        await wait_for(pilot, lambda: app.chat is not None and app.chat.id == birds, what="the next chat")
        assert [c.id for c in store.list_chats()] == [birds]
        assert app.query_one(ChatList).titles() == ["Birds"]
        assert [v.text for v in app.query(MessageView)] == ["Do penguins fly?", "No."]
        # Deleting the last chat leaves a new, empty one.
        await pilot.press("f8", "y")
        await wait_for(pilot, lambda: app.chat is None, what="an empty chat")
        assert store.list_chats() == [] and not app.query(MessageView)


async def test_chats_survive_closing_the_app(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    first = ChatApp(Plan(), GREEDY, system="Answer briefly.", engine=engine, store=ChatStore(path))
    async with first.run_test(size=(120, 36)) as pilot:
        await type_and_send(pilot, "What is the capital of France?")
        before = [(m.role, m.content) for m in first.messages]
        speed = first.panel.state.decode_tok_s
    first.store.close()

    again = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(path))  # "tomorrow"
    async with again.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: again.panel.state.context_tokens is not None, what="the context count")
        assert [(m.role, m.content) for m in again.messages] == before
        assert [v.text for v in again.query(MessageView)] == [c for _, c in before]
        assert again.settings.system_prompt == "Answer briefly."  # the chat keeps its own settings
        assert again.settings.sampling.max_tokens == 8
        # The last reply's figures come back with it.
        assert again.panel.state.decode_tok_s == speed
        assert "TTFT" in panel_text(again) and "Context" in panel_text(again)


async def test_a_reply_cut_off_by_a_crash_shows_as_interrupted(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat()
    q = store.add_message(chat.id, None, "user", "Tell me a story.")
    store.add_message(chat.id, q.id, "assistant", "Once upon a", status="partial")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_idle(pilot)
        view = app.query(MessageView).last()
        assert view.text == "Once upon a" and "interrupted" in view.info.header()
        # Regenerate writes a whole reply beside it.
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.messages[-1].content != "Once upon a", what="a new reply")
        await wait_idle(pilot)
        assert app.messages[-1].status == "complete" and app.branches[app.messages[-1].id] == (2, 2)


async def test_f5_exports_the_chat_shown_to_markdown(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmlocal.app.commands.chats import conversation_markdown

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    store = ChatStore(tmp_path / "chats.db")
    birds = seed(store, "Birds", "Do penguins fly?", "No, they swim.")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        assert app.chat.id == birds
        await pilot.press("f5")
        path = work / f"llmlocal-chat-{birds}.md"
        await wait_for(pilot, lambda: any(str(path) in n.message for n in app._notifications), what="the notice")
        assert path.read_text() == conversation_markdown(store.conversation(birds))
        assert "# Birds" in path.read_text() and "## Assistant\n\nNo, they swim.\n" in path.read_text()
        # A new chat has nothing to export yet.
        await pilot.press("ctrl+n", "f5")
        await wait_for(pilot, lambda: any("not saved yet" in n.message for n in app._notifications))
        assert sorted(p.name for p in work.iterdir()) == [path.name]


async def test_f5_exports_into_the_data_dir_when_the_current_directory_is_gone(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(tmp_path / "data"))
    store = ChatStore(tmp_path / "chats.db")
    birds = seed(store, "Birds", "Do penguins fly?", "No, they swim.")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f5")
        path = tmp_path / "data" / "exports" / f"llmlocal-chat-{birds}.md"
        await wait_for(pilot, lambda: any(str(path) in n.message for n in app._notifications), what="the notice")
        assert path.read_text().startswith("# Birds\n")
