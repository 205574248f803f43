"""The chat settings panel (F3): a per-chat system prompt and sampling parameters."""

from __future__ import annotations

from pathlib import Path

from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.settings_screen import ChatSettingsScreen
from llmlocal.engine import Engine, Plan, SamplingParams
from textual.widgets import Input, Static, TextArea
from tui_support import type_and_send, wait_for


async def set_field(pilot, name: str, value: str) -> None:
    field = pilot.app.screen.query_one(f"#set-{name}", Input)
    field.focus()
    field.value = ""
    await pilot.press(*value)


async def test_system_prompt_and_parameters_apply_to_the_chat(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(), SamplingParams(temperature=0.8, max_tokens=30), engine=engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        assert isinstance(app.screen, ChatSettingsScreen)
        screen = app.screen
        assert screen.query_one("#set-max_tokens", Input).value == "30"  # the defaults, shown
        await pilot.press(*"You are a pirate.")  # the system prompt box has the focus
        await set_field(pilot, "temperature", "0")
        await set_field(pilot, "max_tokens", "5")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen))
        assert app.settings.system_prompt == "You are a pirate."
        assert (app.settings.sampling.temperature, app.settings.sampling.max_tokens) == (0, 5)

        await type_and_send(pilot, "Hello!")
        reply = app.messages[-1]
        assert reply.stats["completion_tokens"] == 5 and reply.finish_reason == "length"
        # The system prompt went to the model: the prompt is exactly system + user.
        expected = engine.count_tokens([
            {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"},
        ])
        assert reply.stats["prompt_tokens"] == expected
        assert expected != engine.count_tokens([{"role": "user", "content": "Hello!"}])  # (the template's own default)
        chat = store.get_chat(app.chat.id)
        assert chat.system_prompt == "You are a pirate."
        assert chat.sampling["max_tokens"] == 5 and chat.sampling["temperature"] == 0

        # Greedy: regenerating gives the same reply.
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.messages[-1].id != reply.id and app.reply is None, what="the new reply")
        assert app.messages[-1].content == reply.content

        # A new chat starts from the defaults again; the first keeps its settings.
        await pilot.press("ctrl+n")
        assert app.settings.system_prompt is None and app.settings.sampling.max_tokens == 30
        await pilot.pause(0.05)
        assert store.get_chat(chat.id).system_prompt == "You are a pirate."


async def test_invalid_values_keep_the_panel_open_and_esc_discards(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat(system_prompt="Be brief.", sampling={"temperature": 0.0, "max_tokens": 7})
    app = ChatApp(Plan(), SamplingParams(), engine=engine, store=store)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert screen.query_one("#system-prompt", TextArea).text == "Be brief."
        await set_field(pilot, "top_p", "2")
        await pilot.press("ctrl+s")
        assert app.screen is screen
        assert "top_p must be in (0, 1]" in str(screen.query_one("#settings-error", Static).content)
        await set_field(pilot, "top_p", "0.9")
        screen.query_one("#set-temperature", Input).value = ""
        await pilot.press("ctrl+s")
        assert app.screen is screen and "temperature needs a value" in str(screen.query_one("#settings-error", Static).content)
        screen.query_one("#system-prompt", TextArea).text = "Be verbose."
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is not screen)
        assert app.settings.system_prompt == "Be brief."
        assert store.get_chat(chat.id).system_prompt == "Be brief."
        # Clearing the system prompt and saving removes it; blank max tokens means no cap.
        await pilot.press("f3")
        app.screen.query_one("#system-prompt", TextArea).text = ""
        app.screen.query_one("#set-max_tokens", Input).value = ""
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen))
        stored = store.get_chat(chat.id)
        assert stored.system_prompt is None and stored.sampling["max_tokens"] is None
