"""`ModelActions`: the part of `ChatApp` that picks, loads and replaces the model.

A model loads in a thread worker while the current one keeps serving; once the new engine is
ready it takes over and the old one is closed (if the app loaded it) as soon as no request
runs on it. The plan of a picked model comes from `ChatApp.plan_for` (the CLI runs the
memory planner there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmlocal.models.errors import LLMLocalError
from textual import work

from .model_picker import ModelPicker
from .worker_messages import EngineLoaded, EngineLoadFailed, ModelsListed

if TYPE_CHECKING:
    from llmlocal.engine import Engine

    from .chat_app import ChatApp

    _AppBase = ChatApp
else:
    _AppBase = object


class ModelActions(_AppBase):
    # NOTE: on_<message> handlers, not @on: this mixin is a plain class (see ReplyActions).
    def action_pick_model(self) -> None:
        current = self.engine.model.name if self.engine else None
        picker = ModelPicker(current, self.engine.plan if self.engine else None, self.engine.device if self.engine else None)

        def done(name: str | None) -> None:
            if name:
                self.switch_model(name)

        self.push_screen(picker, done)
        self._list_models()

    @work(thread=True, group="models", exclusive=True)
    def _list_models(self) -> None:
        from llmlocal.models.store import list_models

        try:
            self.post_message(ModelsListed(list(list_models())))
        except LLMLocalError as e:
            self.post_message(ModelsListed([], str(e)))

    def on_models_listed(self, message: ModelsListed) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, ModelPicker):
                screen.show_models(message.models, message.error)

    def switch_model(self, name: str) -> None:
        if self.loading is not None:
            self.notify(f"{self.loading} is still loading.", severity="warning")
            return
        if self.reply is not None:
            self.stop_reply()
        self.load_model(name)

    # ---- a reopened chat brings its model -----------------------------------------------
    async def follow_chat_model(self) -> None:
        """Load the model the shown chat was held with, when it is not the one loaded. A model
        named with --model stays for the whole session; so does one still loading or replying."""
        from llmlocal.models import DEFAULT_MODEL

        wanted = self.chat.model if self.chat is not None else None
        current = self.loading or (self.engine.model.name if self.engine else self.base_plan.model or DEFAULT_MODEL)
        if not wanted or wanted == current:
            return
        if self.reply is not None or self.loading is not None or self.model_pinned():
            await self.conversation.notice(
                f"This chat last used {wanted}; replies now come from {current} (F2 switches the model)."
            )
            return
        self.following = wanted
        self.load_model(wanted, from_chat=True)

    def model_pinned(self) -> bool:
        """True when the first plan names a model other than the default one (--model)."""
        from ..config import effective, load

        if self.base_plan.model is None:
            return False
        try:
            default = str(effective(load(), "model").value)
        except LLMLocalError:
            return True
        return self.base_plan.model != default

    # ---- loading ---------------------------------------------------------------------------
    def load_model(self, name: str | None, from_chat: bool = False) -> None:
        """Load ``name`` (None: the first plan's model) in a worker; the current model serves
        until the new one is ready, then is closed. ``from_chat``: ``name`` is a chat's model
        as the store recorded it (the engine's name for it)."""
        from llmlocal.models import DEFAULT_MODEL

        self.loading = name or self.base_plan.model or DEFAULT_MODEL
        state = self.panel.state
        state.activity = f"loading {self.loading}…"
        state.loading = True
        self.panel.render_state()
        self._load_worker(name, from_chat)

    @work(thread=True, group="load", exclusive=True)
    def _load_worker(self, name: str | None, from_chat: bool = False) -> None:
        from llmlocal.engine import Engine

        with self.threads.running():
            try:
                if name is not None and from_chat:
                    name = stored_name(name)
                engine = Engine.load(self.base_plan if name is None else self.plan_for(name))
            except LLMLocalError as e:
                self.post_message(EngineLoadFailed(self.loading or "", str(e)))
                return
            if self.closing:  # the app was closed while the model loaded
                engine.close()
                return
            self.post_message(EngineLoaded(engine))

    async def on_engine_loaded(self, message: EngineLoaded) -> None:
        old, self.engine = self.engine, message.engine
        self.following = None
        if self.loading is not None:
            self.owned.append(message.engine)
        self.loading = None
        if old is not None and old is not message.engine:
            self.stop_draft_prefill()
            self.retired.append(old)
            self.close_retired()
            if self.chat is not None:
                self.chat = self.store.update_chat(self.chat.id, model=message.engine.model.name)
            self.notify(f"Switched to {message.engine.model.name}.")
        engine = message.engine
        state = self.panel.state
        state.model, state.backend, state.device, state.n_ctx = (
            engine.model.name, engine.backend_name, engine.device, engine.n_ctx,
        )
        state.estimated = not getattr(engine, "exact_token_counts", True)
        state.activity, state.loading = "", False
        self.panel.render_state()
        self.count_context()
        self.start_draft_prefill()  # the open chat's history on the new model
        if self.first_message is not None:
            text, self.first_message = self.first_message, None
            await self.send(text)

    async def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        self.loading = None
        if self.following is not None:
            await self.fall_back(self.following, message.error)
            return
        state = self.panel.state
        state.activity = "" if self.engine else "no model loaded: F2 picks one"
        state.loading = False
        self.panel.render_state()
        await self.conversation.notice(message.error)

    async def fall_back(self, wanted: str, error: str) -> None:
        """A chat's own model did not load: keep the loaded one, or load the first plan's."""
        from llmlocal.models import DEFAULT_MODEL

        self.following = None
        instead = self.engine.model.name if self.engine else self.base_plan.model or DEFAULT_MODEL
        await self.conversation.notice(
            f"This chat was held with {wanted}, which did not load ({error.rstrip('.')}); "
            f"replies come from {instead} (F2 picks another model)."
        )
        if self.engine is None:
            self.load_model(None)
        else:
            self.panel.state.activity, self.panel.state.loading = "", False
            self.panel.render_state()

    def close_retired(self) -> None:
        """Close replaced engines that this app loaded, once no request is running on them."""
        if self.reply is not None:
            return
        retired, self.retired = self.retired, []
        for engine in retired:
            if self.draft_busy(engine):  # closed once its draft's prefill stops (_draft_done)
                self.retired.append(engine)
            elif engine in self.owned:
                self.owned.remove(engine)
                self._close_worker(engine)

    @work(thread=True, group="close")
    def _close_worker(self, engine: Engine) -> None:
        with self.threads.running():
            engine.close()


def stored_name(name: str) -> str:
    """The name to load a chat's model by. The store records the engine's name for a model,
    which for a file is the file's name: find that file among the stored models."""
    from llmlocal.models.store import list_models

    try:
        models = list(list_models())
    except LLMLocalError:
        return name
    for m in models:
        if name == m.name:
            return name
    for m in models:
        if name == m.path.name:
            return m.name
    return name
