"""Regenerate, edit an earlier message (a branch), step back to the old branch, copy."""

from __future__ import annotations

from pathlib import Path

from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.conversation import MessageView
from llmlocal.engine import Engine, Plan, SamplingParams
from tui_support import type_and_send, wait_for, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def contents(app: ChatApp) -> list[str]:
    return [v.text for v in app.query(MessageView)]


async def test_regenerate_adds_a_sibling_reply_and_keeps_the_old_one(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(), SamplingParams(temperature=1.0, max_tokens=12), engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await type_and_send(pilot, "Name a fruit.")
        question, first = app.messages
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.reply is not None or app.messages[-1].id != first.id, what="regenerating")
        await wait_idle(pilot)
        assert len(app.messages) == 2 and app.messages[0].id == question.id  # no new user message
        second = app.messages[1]
        assert second.id != first.id and second.parent_id == question.id and second.status == "complete"
        assert app.branches[second.id] == (2, 2)
        view = app.query(MessageView).last()
        assert "‹ 2/2 ›" in view.info.header()
        # The first reply is one step to the left, on screen and in the store.
        view.focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.messages[-1].id == first.id, what="the first reply")
        assert contents(app) == [question.content, first.content]
        assert "‹ 1/2 ›" in app.query(MessageView).last().info.header()
        assert store.get_chat(app.chat.id).active_leaf == first.id


async def test_edit_an_earlier_message_branches_and_the_old_branch_stays_reachable(
    engine: Engine, tmp_path: Path
) -> None:
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await type_and_send(pilot, "What color is the sky?")
        await type_and_send(pilot, "And the grass?")
        old = [m.content for m in app.messages]
        assert len(old) == 4
        # Select the first message (Ctrl+Up walks up from the message box) and edit it.
        for _ in range(4):
            await pilot.press("ctrl+up")
        first_view = app.query(MessageView).first()
        assert app.focused is first_view
        await pilot.press("e")
        assert app.editing is not None and app.editing.id == app.messages[0].id
        assert app.prompt.text == "What color is the sky?"
        assert app.query_one("#edit-banner").display
        app.prompt.text = "What color is the sea?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.prompt.text == "")
        await wait_idle(pilot)
        assert not app.query_one("#edit-banner").display and app.editing is None
        # The new branch: the edited question and its reply, nothing of the old follow-up.
        assert app.messages[0].content == "What color is the sea?"
        assert len(app.messages) == 2
        new_root = app.messages[0]
        assert new_root.parent_id is None and app.branches[new_root.id] == (2, 2)
        assert "‹ 2/2 ›" in app.query(MessageView).first().info.header()
        # Step back: the whole old branch returns, down to its last reply.
        app.query(MessageView).first().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: len(app.messages) == 4, what="the old branch")
        assert [m.content for m in app.messages] == old
        assert contents(app) == old
        assert app.focused is app.query(MessageView).first()  # the selection stays at that message
        await pilot.press("right")
        await wait_for(pilot, lambda: len(app.messages) == 2, what="the new branch again")
        assert app.messages[0].content == "What color is the sea?"
        # Escape while editing cancels the edit and leaves the conversation alone.
        app.query(MessageView).first().focus()
        await pilot.press("e")
        assert app.editing is not None
        await pilot.press("escape")
        assert app.editing is None and app.prompt.text == "" and len(app.messages) == 2
    assert store.message_count(app.chat.id) == 6


async def test_copy_puts_a_message_on_the_clipboard(engine: Engine, tmp_path: Path) -> None:
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(tmp_path / "chats.db"))
    async with app.run_test(size=(120, 36)) as pilot:
        await type_and_send(pilot, "Say hello.")
        reply = app.query(MessageView).last()
        reply.focus()
        await pilot.press("c")
        assert app.clipboard == reply.text == app.messages[-1].content
        app.query(MessageView).first().focus()
        await pilot.press("c")
        assert app.clipboard == "Say hello."
        # A reply cannot be edited: the key is not offered on it.
        assert reply.check_action("edit", ()) is False
