"""A message that does not fit after the conversation: the user is told and chooses (a new chat
with the last turns, a new chat with a summary, send anyway, or cancel); history is never
dropped on their behalf."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.dialogs import ContextFullScreen
from llmlocal.engine import Engine, Plan, SamplingParams
from tui_support import type_and_send, wait_for, wait_idle

N_CTX = 300
GREEDY = SamplingParams(temperature=0, max_tokens=8)  # 8 tokens kept free for a reply
LONG_Q = "Tell me everything about the history of the river Thames, its bridges, its tides, and the boats. " * 4
LONG_A = "The Thames flows through London. It has many bridges, strong tides, and a long history of trade. " * 4
TURNS = [LONG_Q, LONG_A, "Thanks.", "You are welcome."]
NEW = "Now compare the Thames with the Seine in Paris and the Danube in Vienna, in detail, with dates. " * 4


@pytest.fixture(scope="module")
def small() -> Iterator[Engine]:
    with Engine.load(Plan(n_ctx=N_CTX)) as engine:
        yield engine


def seed(store: ChatStore) -> int:
    chat = store.create_chat(title="Rivers", sampling={"temperature": 0, "max_tokens": 8})
    parent = None
    for i, text in enumerate(TURNS):
        parent = store.add_message(chat.id, parent, "user" if i % 2 == 0 else "assistant", text).id
    return chat.id


def history() -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(TURNS)]


async def ask(pilot, text: str) -> ContextFullScreen:
    app = pilot.app
    await type_and_send(pilot, text, wait=False)
    await wait_for(pilot, lambda: isinstance(app.screen, ContextFullScreen), what="the question")
    return app.screen


def test_the_scenario_overflows_the_window(small: Engine) -> None:
    alone = small.count_tokens(history())
    together = small.count_tokens([*history(), {"role": "user", "content": NEW}])
    assert alone < N_CTX * 0.9 and together >= N_CTX  # the chat fits; the next message does not


async def test_cancel_gives_the_message_back_and_changes_nothing(small: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = seed(store)
    app = ChatApp(Plan(), GREEDY, engine=small, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ask(pilot, NEW)
        assert f"holds {N_CTX}" in str(screen.query_one(".dialog-text").content)
        assert not screen.query("#anyway")  # it cannot be sent at all: no "send anyway"
        await pilot.press("c")
        await wait_for(pilot, lambda: not isinstance(app.screen, ContextFullScreen))
        assert app.prompt.text == NEW
        assert store.message_count(chat) == 4 and len(store.list_chats()) == 1
        assert app.chat.id == chat and len(app.messages) == 4


async def test_carry_the_last_turns_into_a_new_chat(small: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    old = seed(store)
    app = ChatApp(Plan(), GREEDY, engine=small, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(pilot, NEW)
        await pilot.press("t")
        await wait_for(pilot, lambda: app.chat.id != old and len(app.messages) >= 4, what="the new chat")
        await wait_idle(pilot)
        assert app.chat.title == "Rivers (continued)"
        # The long first turn did not fit in half the window; the last one came along.
        assert [m.content for m in app.messages[:3]] == ["Thanks.", "You are welcome.", NEW]
        assert app.messages[3].role == "assistant" and app.messages[3].status == "complete"
        assert app.settings.sampling.max_tokens == 8  # the settings came along too
        assert store.message_count(old) == 4  # the full chat is untouched
        assert any("carried over" in n.text for n in app.query("Notice"))


async def test_carry_a_summary_into_a_new_chat(small: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    old = seed(store)
    app = ChatApp(Plan(), GREEDY, engine=small, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(pilot, NEW)
        await pilot.press("s")
        await wait_for(pilot, lambda: app.panel.state.activity == "summarizing…" or app.chat.id != old)
        await wait_for(pilot, lambda: app.chat.id != old and len(app.messages) == 2, what="the new chat")
        await wait_idle(pilot)
        system = app.chat.system_prompt
        assert system.startswith("Summary of the conversation so far:\n") and len(system) > 40
        assert app.settings.system_prompt == system
        assert app.messages[0].content == NEW and app.messages[1].status == "complete"
        assert store.message_count(old) == 4


async def test_send_anyway_when_only_the_reply_room_is_short(small: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = seed(store)
    # A message that fits, but leaves fewer than the 8 tokens kept for the reply.
    words = NEW.split()
    text = ""
    for word in words:
        longer = f"{text} {word}".strip()
        if small.count_tokens([*history(), {"role": "user", "content": longer}]) >= N_CTX - 1:
            break
        text = longer
    total = small.count_tokens([*history(), {"role": "user", "content": text}])
    assert N_CTX - 8 < total < N_CTX, total
    app = ChatApp(Plan(), GREEDY, engine=small, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ask(pilot, text)
        assert screen.query("#anyway")
        await pilot.press("a")
        await wait_for(pilot, lambda: len(app.messages) == 6, what="the reply")
        await wait_idle(pilot)
        assert app.chat.id == chat and app.messages[4].content == text
        assert app.messages[5].finish_reason in ("context", "stop")
        # The panel warns: the window is nearly full.
        assert app.panel.state.context_share >= 0.9 and app.panel.has_class("-context-warn")
        assert chat in app.warned
