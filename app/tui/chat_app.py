"""`ChatApp`: the `llmlocal chat` screen.

Threads: the engine is loaded and called in thread workers (llama.cpp blocks); workers post
typed messages back to the app, which updates the widgets. Every reply carries the id of
its request, so events of a reply that was stopped or replaced are ignored (no stale text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Markdown

from .widgets import AssistantMessage, Notice, PromptInput, StatusBar, UserMessage

if TYPE_CHECKING:
    from llmlocal.engine import DoneEvent, Engine, Plan, SamplingParams


class EngineReady(Message):
    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine


@dataclass
class EngineFailed(Message):
    error: str


@dataclass
class ReplyChunk(Message):
    request_id: str
    text: str


@dataclass
class ReplyDone(Message):
    request_id: str
    done: DoneEvent


@dataclass
class ReplyFailed(Message):
    request_id: str
    error: str


class ChatApp(App[None]):
    TITLE = "llmlocal chat"
    CSS_PATH = "chat.tcss"
    BINDINGS = [
        Binding("escape", "stop", "Stop reply", priority=True),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        plan: Plan,
        sampling: SamplingParams | None = None,
        system: str | None = None,
        engine: Engine | None = None,
    ) -> None:
        super().__init__()
        from llmlocal.engine import SamplingParams

        self.plan = plan
        self.sampling = sampling or SamplingParams()
        self.system = system
        self.engine: Engine | None = engine
        self._owns_engine = engine is None
        self.history: list[dict[str, str]] = []  # the conversation sent to the model
        self.request_id: str | None = None  # the reply being streamed, if any
        self._reply: AssistantMessage | None = None
        self._stream: Any = None  # MarkdownStream of the current reply
        self._last_stats: str = ""

    # ---- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="messages")
        yield PromptInput(id="prompt", soft_wrap=True, show_line_numbers=False)
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#messages", VerticalScroll).anchor()
        self.query_one(PromptInput).focus()
        if self.engine is None:
            self._status("loading model…")
            self._load_engine()
        else:
            self._status()

    async def on_unmount(self) -> None:
        if self.engine is not None:
            self.engine.cancel()
            if self._owns_engine:
                self.engine.close()

    # ---- engine work (threads) -----------------------------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def _load_engine(self) -> None:
        from llmlocal.engine import Engine
        from llmlocal.models.errors import LLMLocalError

        try:
            engine = Engine.load(self.plan)
        except LLMLocalError as e:
            self.post_message(EngineFailed(str(e)))
            return
        self.post_message(EngineReady(engine))

    @work(thread=True, group="generate")
    def _generate(self, request: Any) -> None:
        from llmlocal.engine import DoneEvent
        from llmlocal.models.errors import LLMLocalError

        assert self.engine is not None
        try:
            for event in self.engine.generate(request):
                if isinstance(event, DoneEvent):
                    self.post_message(ReplyDone(request.id, event))
                elif event.text:
                    self.post_message(ReplyChunk(request.id, event.text))
        except LLMLocalError as e:
            self.post_message(ReplyFailed(request.id, str(e)))

    # ---- messages from workers -----------------------------------------------------------
    def on_engine_ready(self, message: EngineReady) -> None:
        self.engine = message.engine
        self._status()

    def on_engine_failed(self, message: EngineFailed) -> None:
        self._status("model failed to load")
        self._notice(message.error)

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        if message.request_id != self.request_id or self._reply is None:
            return  # a reply that was stopped or replaced
        self._reply.text += message.text
        self._reply.chunks += 1
        await self._stream.write(message.text)

    async def on_reply_done(self, message: ReplyDone) -> None:
        if message.request_id != self.request_id or self._reply is None:
            return
        done = message.done
        reply = self._reply
        await self._finish_stream()
        reply.finish_reason = done.finish_reason
        self.history.append({"role": "assistant", "content": done.text})
        if done.finish_reason == "cancelled":
            self._notice("Reply stopped.")
        elif done.finish_reason == "context":
            self._notice("The context window is full: start a new chat (Ctrl+N) to continue.")
        s = done.stats
        parts = []
        if s.ttft_s is not None:
            parts.append(f"TTFT {s.ttft_s * 1000:.0f} ms")
        if s.decode_tok_s is not None:
            parts.append(f"{s.decode_tok_s:.1f} tok/s")
        parts.append(f"ctx {s.prompt_tokens + s.completion_tokens}/{s.n_ctx or self.engine.n_ctx}")  # type: ignore[union-attr]
        self._last_stats = "  ·  ".join(parts)
        self._status()

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        if message.request_id != self.request_id:
            return
        await self._finish_stream()
        if self._reply is not None:
            await self._reply.remove()
            self._reply = None
        # The message was not answered: take it out of the conversation and give it back to
        # the input box, so nothing the user wrote is lost.
        if self.history and self.history[-1]["role"] == "user":
            unsent = self.history.pop()["content"]
            prompt = self.query_one(PromptInput)
            if not prompt.text:
                prompt.text = unsent
        self._notice(message.error)
        self._status()

    # ---- user actions --------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def send(self, message: PromptInput.Submitted) -> None:
        from llmlocal.engine import Request

        if self.engine is None:
            self.notify("The model is still loading.", severity="warning")
            return
        if self.request_id is not None:
            self.notify("A reply is streaming: press Esc to stop it first.", severity="warning")
            return
        self.query_one(PromptInput).clear()
        self.history.append({"role": "user", "content": message.text})
        messages = self.query_one("#messages", VerticalScroll)
        await messages.mount(UserMessage(message.text))
        self._reply = AssistantMessage()
        await messages.mount(self._reply)
        self._stream = Markdown.get_stream(self._reply)
        system = [{"role": "system", "content": self.system}] if self.system else []
        request = Request.chat(system + self.history, self.sampling)
        self.request_id = request.id
        self._status("generating…")
        self._generate(request)

    def action_stop(self) -> None:
        if self.engine is not None and self.request_id is not None:
            self.engine.cancel(self.request_id)

    async def action_new_chat(self) -> None:
        self.action_stop()
        await self._finish_stream()
        self.history.clear()
        await self.query_one("#messages", VerticalScroll).remove_children()
        self._last_stats = ""
        self._status()

    # ---- helpers -------------------------------------------------------------------------
    async def _finish_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
        self._stream = None
        self._reply = None
        self.request_id = None

    def _notice(self, text: str) -> None:
        self.query_one("#messages", VerticalScroll).mount(Notice(text))

    def _status(self, state: str = "") -> None:
        if self.engine is not None:
            head = [self.engine.model.name, f"{self.engine.backend_name} on {self.engine.device}"]
        else:
            head = [self.plan.model or "smollm2-135m"]
        self.query_one(StatusBar).show(*head, state or self._last_stats)
