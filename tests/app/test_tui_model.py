"""The model picker (F2): the store's models, the loaded plan, and switching model in a chat."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.conversation import Notice
from llmlocal.app.tui.model_picker import ModelPicker, plan_summary
from llmlocal.engine import Engine, Plan, SamplingParams
from textual.widgets import DataTable, Input, Static
from tui_support import panel_text, type_and_send, wait_for, wait_idle

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def is_freed(engine: Engine) -> bool:
    """Whether the engine's model was closed: llama-cpp-python drops its model pointer; the
    paged engine (what `auto` loads where it decodes faster) stops its decode loop."""
    backend = engine.backend
    if engine.backend_name == "llamacpp":
        return backend._llm._model.model is None  # type: ignore[attr-defined]
    return backend._closed and not backend._thread.is_alive()  # type: ignore[attr-defined]


async def open_picker(pilot) -> ModelPicker:
    app = pilot.app
    await pilot.press("f2")
    assert isinstance(app.screen, ModelPicker)
    picker = app.screen
    await wait_for(pilot, lambda: not picker.query_one("#picker-loading").display, what="the model list")
    return picker


async def test_switch_model_within_a_chat(engine: Engine, starter_path: str, tmp_path: Path) -> None:
    other = tmp_path / "smollm-twin.gguf"  # the same weights under another name: a second model
    other.symlink_to(starter_path)
    store = ChatStore(tmp_path / "chats.db")
    app = ChatApp(Plan(n_ctx=1024), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(130, 40)) as pilot:
        await type_and_send(pilot, "Hi!")
        chat_id = app.chat.id
        picker = await open_picker(pilot)
        plan = str(picker.query_one("#picker-plan", Static).content)
        assert "smollm2-135m" in plan and "backend llamacpp" in plan and "n_ctx 2048" in plan
        name = picker.query_one("#picker-name", Input)
        name.focus()
        name.value = str(other)
        await pilot.press("enter")
        # While it loads (the app's own first load shows the indicator deterministically, in
        # test_tui.py), the old model stays in charge; a small model may already be done here.
        await wait_for(pilot, lambda: app.loading == str(other) or app.engine is not engine, what="loading")
        if app.loading is not None:
            assert app.panel.state.loading and app.query_one("#engine-loading").display
            assert "loading" in panel_text(app) and app.engine is engine
        await wait_idle(pilot)
        twin = app.engine
        assert twin is not engine and twin.model.name == "smollm-twin.gguf" and twin.n_ctx == 1024
        assert not app.panel.state.loading and "smollm-twin.gguf" in panel_text(app)
        assert not is_freed(engine)  # given to the app, not the app's to close
        # The same chat goes on with the new model.
        await type_and_send(pilot, "Are you there?")
        assert app.chat.id == chat_id and len(app.messages) == 4
        assert [m.model for m in app.messages if m.role == "assistant"] == ["smollm2-135m", "smollm-twin.gguf"]
        assert store.get_chat(chat_id).model == "smollm-twin.gguf"
        # Switching again closes the model the app loaded, once the next one is in place.
        picker = await open_picker(pilot)
        name = picker.query_one("#picker-name", Input)
        name.focus()
        name.value = "smollm2-135m"
        await pilot.press("enter")
        await wait_idle(pilot)
        await wait_for(pilot, lambda: is_freed(twin), what="the replaced model to be freed")
        assert app.engine.model.name == "smollm2-135m" and app.engine is not engine
        assert twin not in app.owned
    assert is_freed(app.engine)  # closing the app frees what it loaded
    assert not is_freed(engine)


async def test_a_model_that_does_not_load_leaves_the_chat_as_it_was(engine: Engine, tmp_path: Path) -> None:
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(tmp_path / "chats.db"))
    async with app.run_test(size=(130, 40)) as pilot:
        picker = await open_picker(pilot)
        name = picker.query_one("#picker-name", Input)
        name.focus()
        name.value = str(tmp_path / "missing.gguf")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.loading is None and app.query(Notice), what="the error")
        assert "No model named" in app.query(Notice).last().text
        assert app.engine is engine and not app.panel.state.loading
        await type_and_send(pilot, "Still here?")
        assert app.messages[-1].model == "smollm2-135m"


async def test_the_picker_lists_the_model_store(
    engine: Engine, starter_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmlocal.models.store import list_models

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache and models directory
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LLMLOCAL_MODELS_DIR", str(tmp_path / "models"))
    local = tmp_path / "models" / "mine.gguf"  # ... but for one local file
    local.parent.mkdir()
    local.symlink_to(starter_path)
    expected = [m.name for m in list_models()]
    assert expected == ["smollm2-135m", str(local)]
    assert "smollm2-135m" in expected
    app = ChatApp(Plan(), GREEDY, engine=engine, store=ChatStore(tmp_path / "chats.db"))
    async with app.run_test(size=(130, 40)) as pilot:
        picker = await open_picker(pilot)
        table = picker.query_one("#picker-table", DataTable)
        assert picker.names == expected and table.row_count == len(expected)
        row = table.get_row_at(0)
        assert row[0] == "●" and row[1] == "smollm2-135m" and "MB" in row[2] and row[3] == "Q4_1"
        assert table.get_row_at(1)[1] == str(local) and table.get_row_at(1)[6] == "local"
        await pilot.press("escape")
        assert not isinstance(app.screen, ModelPicker) and app.loading is None
        # Enter on a row loads that model.
        picker = await open_picker(pilot)
        await pilot.press("down", "enter")
        await wait_idle(pilot)
        assert app.engine.model.name == "mine.gguf" and app.engine is not engine


def test_plan_summary_shows_what_differs_from_the_defaults() -> None:
    rows = dict(plan_summary(Plan(model="x", backend="paged", n_ctx=4096, kv_blocks=64, api_key="secret")))
    assert rows == {"backend": "paged", "device": "auto", "n_ctx": "4096", "kv_blocks": "64"}
    assert list(rows)[:3] == ["backend", "device", "n_ctx"]


def twin_in_models_dir(starter_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The starter's weights as a second model, a file in an otherwise empty model store."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LLMLOCAL_MODELS_DIR", str(tmp_path / "models"))
    twin = tmp_path / "models" / "smollm-twin.gguf"
    twin.parent.mkdir()
    twin.symlink_to(starter_path)
    return twin


def held_chat(store: ChatStore, title: str, model: str) -> int:
    chat = store.create_chat(title=title)
    q = store.add_message(chat.id, None, "user", "Hi!")
    store.add_message(chat.id, q.id, "assistant", "Hello.", model=model)  # records the chat's model
    return chat.id


async def test_a_reopened_chat_loads_the_model_it_was_held_with(
    engine: Engine, starter_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    twin_in_models_dir(starter_path, tmp_path, monkeypatch)
    store = ChatStore(tmp_path / "chats.db")
    starter_chat = held_chat(store, "On the starter", "smollm2-135m")
    twin_chat = held_chat(store, "On the twin", "smollm-twin.gguf")  # the engine's name for the file
    app = ChatApp(Plan(), GREEDY, engine=engine, store=store)
    async with app.run_test(size=(130, 40)) as pilot:
        assert app.chat.id == twin_chat
        await wait_idle(pilot)
        assert app.engine is not engine and app.engine.model.name == "smollm-twin.gguf"
        assert not app.query(Notice)
        await type_and_send(pilot, "Still you?")
        assert app.messages[-1].model == "smollm-twin.gguf"
        # Opening the other chat brings its model back.
        await app.open_chat(starter_chat)
        await wait_idle(pilot)
        assert app.engine.model.name == "smollm2-135m" and app.engine is not engine
        assert store.get_chat(starter_chat).model == "smollm2-135m"


async def test_a_chat_whose_model_is_gone_falls_back_with_a_notice(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    held_chat(store, "Old", "deleted-model.gguf")
    app = ChatApp(Plan(), GREEDY, store=store)  # the app loads its own model
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_idle(pilot)
        notice = app.query(Notice).last().text
        assert "held with deleted-model.gguf, which did not load" in notice and "smollm2-135m" in notice
        assert app.engine.model.name == "smollm2-135m"
        await type_and_send(pilot, "Are you there?")
        assert app.messages[-1].model == "smollm2-135m" and app.messages[-1].content


async def test_a_model_named_with_model_stays_for_the_session(
    engine: Engine, starter_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    twin_in_models_dir(starter_path, tmp_path, monkeypatch)
    store = ChatStore(tmp_path / "chats.db")
    held_chat(store, "On the twin", "smollm-twin.gguf")
    app = ChatApp(Plan(model=starter_path), GREEDY, engine=engine, store=store)  # as `chat --model FILE`
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_idle(pilot)
        assert app.engine is engine and app.loading is None
        assert "last used smollm-twin.gguf; replies now come from smollm2-135m" in app.query(Notice).last().text
