"""The message prefilled while it is typed (`DraftPrefill`), on the real starter model: the
reply to a pasted message reuses its prefill (its figures count those tokens as cached), on
llama.cpp and on the paged engine, whose reply is the same as a cold run's; typing on after a
paste does not stop its prefill, and the longer text is prefilled after; replacing the text
stops it; `--no-prefill-draft` leaves the engine alone."""

from __future__ import annotations

from pathlib import Path

from tui_support import type_and_send, wait_for, wait_idle
from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PASTE = " ".join(f"Item {i}: the parcel for house {i * 7} goes out on day {i % 5}." for i in range(40))
MESSAGE = PASTE + "\n\nWhich house gets item 3?"


async def prefilled_reply(engine: Engine, store: ChatStore, text: str) -> dict:
    """Leave ``text`` in the message box until its prefill is done, then send it: the stored
    reply's figures."""
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_idle(pilot)
        app.prompt.focus()
        app.prompt.text = text
        await wait_for(pilot, lambda: app._draft_prompt is not None, what="the draft's prefill to start")
        await wait_for(pilot, lambda: app._draft_cancel is None, what="the draft's prefill to end")
        await pilot.press("enter")
        await wait_idle(pilot)
        reply = store.conversation(app.chat.id).messages[-1]
        assert reply.role == "assistant" and reply.status == "complete"
        return {"text": reply.content, **reply.stats}


async def test_a_message_left_in_the_box_is_prefilled_on_llamacpp(engine: Engine, tmp_path: Path) -> None:
    stats = await prefilled_reply(engine, ChatStore(tmp_path / "chats.db"), MESSAGE)
    assert stats["prompt_tokens"] > 400
    # all but the prompt's last token came from the prefill (a fresh chat: nothing else cached)
    assert stats["cached_prompt_tokens"] >= stats["prompt_tokens"] - 2


async def test_the_paged_engine_reuses_it_and_replies_as_a_cold_run(tmp_path: Path) -> None:
    with Engine.load(Plan(backend="paged", n_ctx=2048)) as cold:
        done = [e for e in cold.generate(Request.chat([{"role": "user", "content": MESSAGE}], GREEDY))
                if isinstance(e, DoneEvent)][0]
    assert done.stats.cached_prompt_tokens == 0
    with Engine.load(Plan(backend="paged", n_ctx=2048)) as warm:
        stats = await prefilled_reply(warm, ChatStore(tmp_path / "chats.db"), MESSAGE)
    # whole blocks of the prompt came from the prefill: all but its last, partial one at most
    assert stats["cached_prompt_tokens"] >= stats["prompt_tokens"] - 32
    assert stats["text"] == done.text  # the prompt's rows are computed alike in any chunks


async def test_typing_on_after_a_paste_prefills_the_longer_text(engine: Engine, tmp_path: Path) -> None:
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(tmp_path / "chats.db"))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_idle(pilot)
        app.prompt.focus()
        app.prompt.text = PASTE
        await wait_for(pilot, lambda: app._draft_prompt is not None, what="the first draft's prefill")
        first = app._draft_prompt
        app.prompt.text = MESSAGE  # typed on: the paste's prefill goes on, then the whole text's
        await wait_for(pilot, lambda: app._draft_prompt not in (None, first) and app._draft_cancel is None,
                       what="the second draft's prefill")
        assert app._draft_prompt[1][-1] == ("user", MESSAGE)
        await type_and_send(pilot, MESSAGE)
        reply = app.store.conversation(app.chat.id).messages[-1]
        assert reply.stats["cached_prompt_tokens"] >= reply.stats["prompt_tokens"] - 2


async def test_replacing_the_text_stops_its_prefill(engine: Engine, tmp_path: Path) -> None:
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(tmp_path / "chats.db"))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_idle(pilot)
        app.prompt.focus()
        app.prompt.text = "Replaced. " + PASTE * 3
        await wait_for(pilot, lambda: app._draft_prompt is not None, what="the first draft's prefill")
        first = app._draft_cancel
        app.prompt.text = "Something else: " + PASTE[:300]  # keeps none of the first text
        if first is not None:  # (not over yet: a busy machine takes longer than the starter does here)
            await wait_for(pilot, first.is_set, what="the first prefill to be stopped")
        await wait_for(pilot, lambda: app._draft_prompt is not None and app._draft_cancel is None
                       and app._draft_prompt[1][-1] == ("user", "Something else: " + PASTE[:300]),
                       what="the new text's prefill")


async def test_no_prefill_draft_leaves_the_engine_alone(engine: Engine, tmp_path: Path) -> None:
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(tmp_path / "chats.db"), prefill_draft=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_idle(pilot)
        app.prompt.focus()
        text = "Not prefilled. " + MESSAGE  # (llama.cpp's context holds MESSAGE's prompt from before)
        app.prompt.text = text
        await pilot.pause(2.0)
        assert app._draft_prompt is None and app._draft_cancel is None
        await type_and_send(pilot, text)
        reply = app.store.conversation(app.chat.id).messages[-1]
        # only the chat template's start is shared with what the context held
        assert reply.stats["cached_prompt_tokens"] < 40


async def test_a_reopened_chat_is_prefilled_before_the_next_message(engine: Engine, tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat(sampling={}, model="smollm2-135m")
    user = store.add_message(chat.id, None, "user", "Reopened. " + PASTE)
    store.add_message(chat.id, user.id, "assistant", "House 21 gets item 3.", status="complete")
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:  # opens the most recent chat
        await wait_for(pilot, lambda: app._draft_prompt is not None and app._draft_cancel is None,
                       what="the history's prefill")
        assert app._draft_prompt[1][-1] == ("assistant", "House 21 gets item 3.")
        await type_and_send(pilot, "And item 4?")
        reply = store.conversation(chat.id).messages[-1]
        assert reply.stats["prompt_tokens"] > 400
        # the history came from the prefill; only the new message and the template's tail did not
        assert reply.stats["cached_prompt_tokens"] >= reply.stats["prompt_tokens"] - 24
