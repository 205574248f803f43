"""The chat TUI, driven with Textual's pilot on the real starter model: send and stream, stop,
a model the app loads itself, new chat, and a message too long for the window."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.chat_list import ChatList
from llmlocal.app.tui.conversation import MessageView, Notice
from llmlocal.app.tui.help_screen import HelpScreen
from llmlocal.app.tui.prompt_input import PromptInput
from llmlocal.engine import Engine, Plan, SamplingParams
from textual.widgets import Static
from tui_support import panel_text, shown_text, type_and_send, wait_for, wait_idle


async def test_type_send_and_a_streamed_reply_appears(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(), SamplingParams(temperature=0, max_tokens=40), engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press(*"What color is the sky")
        await pilot.press("ctrl+j")  # a new line, not a send
        await pilot.press(*"on a clear day?")
        assert app.query_one(PromptInput).text == "What color is the sky\non a clear day?"
        assert not app.query(MessageView)
        await pilot.press("enter")
        # (40 tokens of the starter can stream in a fraction of a second: no wait for the
        # streaming state, which the Escape test sees; the chunk count below shows the stream)
        await wait_idle(pilot)
        user, reply = app.query(MessageView)
        assert reply.chunks > 10, "the reply arrived token by token, not in one piece"
        assert reply.finish_reason == "length"
        assert "blue" in reply.text
        assert user.text == "What color is the sky\non a clear day?"
        assert app.query_one(PromptInput).text == ""
        # Both messages are in the store, the reply with its figures; the chat took its title.
        stored = store.conversation(app.chat.id).messages
        assert [(m.role, m.status) for m in stored] == [("user", "complete"), ("assistant", "complete")]
        assert stored[1].content == reply.text and stored[1].model == "smollm2-135m"
        assert stored[1].stats["completion_tokens"] == 40 and stored[1].stats["ttft_s"] > 0
        assert len(stored[1].stats["token_rates"]) >= 30  # one rate per token after the first
        assert app.chat.title == "What color is the sky"
        # The engine panel: what llama.cpp reports, and nothing it does not.
        shown = panel_text(app)
        for figure in ("smollm2-135m", "llamacpp", "cpu", "ctx 2048", "TTFT", "tok/s", "ITL p50", "ITL p95", "Prompt", "Reply", "40 tok", "Context"):
            assert figure in shown, figure
        for unreported in ("KV blocks", "Draft", "Sparsity"):
            assert unreported not in shown, unreported
        state = app.panel.state
        assert state.context_tokens == state.prompt_tokens + 40
        assert app.query_one("#engine-spark").display


async def test_escape_stops_a_long_reply_and_the_chat_goes_on(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(), SamplingParams(temperature=0, max_tokens=1000), engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await type_and_send(pilot, "Write the numbers from 1 to 300, separated by commas.", wait=False)
        await wait_for(pilot, lambda: app.reply and app.reply.view and len(app.reply.view.text) > 10, what="some text")
        await pilot.press("escape")
        await wait_idle(pilot, timeout=60)
        reply = app.query(MessageView).last()
        assert reply.finish_reason == "cancelled"
        assert 10 < len(reply.text) < 600
        assert "stopped" in reply.info.header()
        assert any("stopped" in n.text for n in app.query(Notice))
        # The partial reply stays in the conversation, stored as stopped, and the chat goes on.
        stored = store.conversation(app.chat.id).messages
        assert (stored[-1].content, stored[-1].status) == (reply.text, "stopped")
        app.settings = type(app.settings)(None, SamplingParams(temperature=0, max_tokens=8))
        await type_and_send(pilot, "Thanks!")
        assert [m.role for m in app.messages] == ["user", "assistant", "user", "assistant"]
        assert app.messages[-1].status == "complete"
        # Esc with nothing to stop does nothing (and is not offered in the footer).
        assert app.check_action("stop", ()) is False


async def test_the_app_loads_its_own_model_and_a_new_chat_starts_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(tmp_path / "data"))
    app = ChatApp(Plan(n_ctx=512), SamplingParams(temperature=0, max_tokens=8))  # its own store too
    async with app.run_test(size=(120, 36)) as pilot:
        assert app.panel.state.loading and "loading smollm2-135m" in panel_text(app)
        app.prompt.text = "Hi"
        await pilot.press("enter")  # refused while loading, and kept in the box
        assert app.prompt.text == "Hi"
        await wait_idle(pilot)
        assert app.engine.n_ctx == 512 and app.engine in app.owned
        await type_and_send(pilot, "Hi")
        assert len(app.messages) == 2
        first = app.chat
        await pilot.press("ctrl+n")
        await pilot.pause(0.1)
        assert app.chat is None and app.messages == [] and not app.query(MessageView)
        assert app.query_one("ChatList").titles() == ["Hi"]  # the old chat is still listed
    assert (tmp_path / "data" / "chats.db").is_file()
    reopened = ChatStore(tmp_path / "data" / "chats.db")
    assert reopened.conversation(first.id).messages[0].content == "Hi"
    reopened.close()


async def test_a_message_too_long_for_the_context_is_given_back(tmp_path: Path) -> None:
    small = Engine.load(Plan(n_ctx=64))
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(n_ctx=64), SamplingParams(temperature=0, max_tokens=8), engine=small, store=store)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            text = "word " * 80
            app.query_one(PromptInput).text = text
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.query(Notice), what="a notice")
            assert "context window is 64" in app.query(Notice).last().text
            assert app.messages == [] and store.list_chats() == []  # nothing was stored
            assert app.query_one(PromptInput).text == text  # nothing the user wrote is lost
    finally:
        small.close()


async def test_help_lists_the_keys_and_question_mark_still_types(engine: Engine, tmp_path: Path) -> None:
    app = ChatApp(Plan(), SamplingParams(temperature=0, max_tokens=8), engine=engine, store=ChatStore(tmp_path / "c.db"))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press(*"why?")  # in the message box, ? is a character
        assert app.prompt.text == "why?" and not isinstance(app.screen, HelpScreen)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        shown = "\n".join(shown_text(s, width=100) for s in app.screen.query(Static))
        for key, what in [("Esc", "Stop the reply"), ("Ctrl+R", "Write the last reply again"), ("F2", "Pick or switch"),
                          ("F3", "System prompt"), ("Ctrl+↑", "Previous message"), ("E", "Edit (branch)"),
                          ("Delete D", "Delete"), ("Shift+Enter Ctrl+J", "New line")]:
            assert key in shown and what in shown, (key, what)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        app.query_one(ChatList).items.focus()  # outside a text box, ? opens the help too
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark")
        assert not isinstance(app.screen, HelpScreen)
