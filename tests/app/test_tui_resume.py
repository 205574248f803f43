"""A saved chat reopened after the app quit: the paged engine reads the earlier turns' KV blocks
from the disk cache instead of computing them again, and the engine panel says how many."""

from __future__ import annotations

from pathlib import Path

from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.engine import Plan, SamplingParams
from tui_support import panel_text, type_and_send, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=12)
NOTES = ("Keep these notes for later: the meeting moved to Thursday at ten, the budget review "
         "needs the spring figures, Anna brings the printed slides, and the room is on the third "
         "floor next to the library. ") * 4


async def test_a_reopened_chat_reads_its_history_from_the_disk_cache(tmp_path: Path) -> None:
    plan = Plan(backend="paged", device="cpu", n_ctx=2048, kv_cache_dir=str(tmp_path / "kv"))
    store = ChatStore(tmp_path / "chats.db")
    first = ChatApp(plan, GREEDY, store=store)
    async with first.run_test(size=(130, 40)) as pilot:
        await wait_idle(pilot)
        await type_and_send(pilot, NOTES)
        history_tokens = first.panel.state.context_tokens
        chat_id = first.chat.id
    assert history_tokens is not None and history_tokens > 150

    second = ChatApp(plan, GREEDY, store=store)  # a new app: nothing of the first one's memory
    async with second.run_test(size=(130, 40)) as pilot:
        await wait_idle(pilot)
        assert second.chat.id == chat_id  # the most recent chat, reopened
        await type_and_send(pilot, "When is the meeting?")
        state = second.panel.state
        assert state.prompt_tokens is not None and state.prompt_tokens > history_tokens
        # every full block of the first turn, prompt and reply, came from the disk
        assert state.cached_prompt_tokens is not None and state.cached_prompt_tokens >= history_tokens - 32
        assert f"({state.cached_prompt_tokens} cached)" in panel_text(second)
        assert second.engine is not None and second.engine.backend.disk.counts["read"] > 0  # type: ignore[attr-defined]
    store.close()
