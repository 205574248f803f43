"""The chat TUI, driven with Textual's pilot on the real starter model."""

from __future__ import annotations

from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.widgets import AssistantMessage, Notice, PromptInput, StatusBar, UserMessage
from llmlocal.engine import Engine, Plan, SamplingParams


async def wait_for(pilot, condition, timeout: float = 60.0) -> None:
    steps = int(timeout / 0.05)
    for _ in range(steps):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not met in time")


async def test_type_send_and_a_streamed_reply_appears(engine: Engine) -> None:
    app = ChatApp(Plan(), SamplingParams(temperature=0, max_tokens=40), engine=engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press(*"What color is the sky")
        await pilot.press("ctrl+j")  # a new line, not a send
        await pilot.press(*"on a clear day?")
        assert app.query_one(PromptInput).text == "What color is the sky\non a clear day?"
        assert not app.query(UserMessage)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query(AssistantMessage) and app.request_id is None)
        reply = app.query(AssistantMessage).last()
        assert reply.chunks > 10, "the reply arrived token by token, not in one piece"
        assert reply.finish_reason == "length"
        assert "blue" in reply.text
        assert app.query_one(UserMessage).text == "What color is the sky\non a clear day?"
        assert app.query_one(PromptInput).text == ""
        assert [m["role"] for m in app.history] == ["user", "assistant"]
        status = str(app.query_one(StatusBar).render())
        assert "smollm2-135m" in status and "llamacpp" in status and "tok/s" in status and "TTFT" in status


async def test_escape_stops_a_long_reply(engine: Engine) -> None:
    app = ChatApp(Plan(), SamplingParams(temperature=0, max_tokens=1000), engine=engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press(*"Write the numbers from 1 to 300, separated by commas.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query(AssistantMessage) and len(app.query(AssistantMessage).last().text) > 10)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.request_id is None, timeout=5)
        reply = app.query(AssistantMessage).last()
        assert reply.finish_reason == "cancelled"
        assert len(reply.text) < 600
        assert any("stopped" in n.text for n in app.query(Notice))
        # The partial reply stays in the conversation and the chat goes on.
        assert app.history[-1] == {"role": "assistant", "content": reply.text}
        await pilot.press(*"Thanks!", "enter")
        await wait_for(pilot, lambda: len(app.query(AssistantMessage)) == 2 and app.request_id is None)
        assert len(app.history) == 4


async def test_app_loads_its_own_engine_and_new_chat_clears() -> None:
    app = ChatApp(Plan(n_ctx=512), SamplingParams(temperature=0, max_tokens=8))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press(*"Hi", "enter")
        await wait_for(pilot, lambda: app.history and app.request_id is None and len(app.history) == 2)
        await pilot.press("ctrl+n")
        await pilot.pause(0.1)
        assert app.history == [] and not app.query(UserMessage)


async def test_a_message_too_long_for_the_context_is_given_back(engine: Engine) -> None:
    small = Engine.load(Plan(n_ctx=64))
    app = ChatApp(Plan(n_ctx=64), SamplingParams(temperature=0, max_tokens=8), engine=small)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            text = "word " * 80
            app.query_one(PromptInput).text = text
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.query(Notice))
            assert "context window is 64" in app.query(Notice).last().text
            assert app.history == []
            assert app.query_one(PromptInput).text == text  # nothing the user wrote is lost
    finally:
        small.close()
