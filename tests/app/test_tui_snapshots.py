"""SVG snapshots (pytest-textual-snapshot) of the main screen, the model picker and the help
screen. Deterministic: the conversation and its figures are stored by the test with fixed
times (UTC) and fixed engine figures, so no live speed is on screen.

Update after an intended change: pytest tests/app/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.model_picker import ModelPicker
from llmlocal.engine import Engine, Plan, SamplingParams
from tui_support import wait_for

SIZE = (130, 40)
REPLY = """Use slicing, or reverse the list in place:

```python
items = [1, 2, 3]
print(items[::-1])   # a new list: [3, 2, 1]
items.reverse()      # in place
```

`reversed(items)` gives an iterator instead of a copy."""
STATS = {
    "backend": "llamacpp", "device": "cpu", "prompt_tokens": 41, "completion_tokens": 58,
    "cached_prompt_tokens": 0, "n_ctx": 2048, "ttft_s": 0.184, "decode_tok_s": 71.3,
    "itl_ms_p50": 13.6, "itl_ms_p95": 17.9, "total_s": 0.98,
    "token_rates": [58.0, 66.5, 70.1, 73.4, 71.8, 74.0, 69.2, 72.7, 75.1, 70.4, 73.9, 71.0, 68.3, 74.6, 72.2, 70.8],
}


class FixedClock:
    def __init__(self) -> None:
        self.now = 1_767_225_600.0  # 2026-01-01 00:00 UTC

    def __call__(self) -> float:
        self.now += 3600.0
        return self.now


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def store(tmp_path: Path, utc: None) -> Iterator[ChatStore]:
    s = ChatStore(tmp_path / "chats.db", clock=FixedClock())
    older = s.create_chat(title="Do penguins fly?")
    q = s.add_message(older.id, None, "user", "Do penguins fly?")
    s.add_message(older.id, q.id, "assistant", "No: they swim.", model="smollm2-135m")
    chat = s.create_chat(sampling={"temperature": 0.0, "max_tokens": 200}, model="smollm2-135m")
    s.add_message(chat.id, None, "user", "reverse list python")  # an earlier version: a branch
    q = s.add_message(chat.id, None, "user", "How do I reverse a list in Python?")
    a = s.add_message(chat.id, q.id, "assistant", "", status="partial", model="smollm2-135m")
    s.update_message(a.id, REPLY, "complete", "stop", STATS)
    yield s
    s.close()


def quiet(app: ChatApp) -> None:
    app.prompt.cursor_blink = False


def test_main_screen_with_a_conversation(snap_compare, engine: Engine, store: ChatStore) -> None:
    app = ChatApp(Plan(), SamplingParams(temperature=0), engine=engine, store=store)

    async def ready(pilot) -> None:
        quiet(app)
        await wait_for(pilot, lambda: app.panel.state.context_tokens is not None, what="the context count")

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_model_picker(snap_compare, engine: Engine, store: ChatStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty Hugging Face cache and models directory: the bundled model only.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LLMLOCAL_MODELS_DIR", str(tmp_path / "models"))
    app = ChatApp(Plan(), SamplingParams(temperature=0), engine=engine, store=store)

    async def ready(pilot) -> None:
        quiet(app)
        await wait_for(pilot, lambda: app.panel.state.context_tokens is not None)
        await pilot.press("f2")
        picker = app.screen
        assert isinstance(picker, ModelPicker)
        await wait_for(pilot, lambda: not picker.query_one("#picker-loading").display, what="the model list")

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_help_screen(snap_compare, engine: Engine, store: ChatStore) -> None:
    app = ChatApp(Plan(), SamplingParams(temperature=0), engine=engine, store=store)

    async def ready(pilot) -> None:
        quiet(app)
        await wait_for(pilot, lambda: app.panel.state.context_tokens is not None)
        await pilot.press("f1")

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)
