"""`ReplyActions`: the part of `ChatApp` that deals with replies.

Send, stop, regenerate, edit (a new branch), step between branches, copy; the handlers of
what the reply worker posts; and the choice offered when a message does not fit the
context window. A request in flight is `ChatApp.reply`; it is cleared only by the worker's
last message for it, so at most one request runs at a time.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from textual import work
from textual.widgets.markdown import MarkdownStream

from ..history import StoredMessage
from .conversation import MessageInfo, MessageView
from .dialogs import ContextFullScreen
from .live_stats import LiveStats
from .prompt_input import PromptInput
from .reply_worker import CarryMode, ReplyJob, carry_over, run_reply
from .worker_messages import (
    CarriedOver,
    CarryFailed,
    ContextFull,
    ReplyChunk,
    ReplyDone,
    ReplyFailed,
    ReplyStarted,
)

if TYPE_CHECKING:
    from .chat_app import ChatApp

    _AppBase = ChatApp
else:
    _AppBase = object

PANEL_REFRESH_S = 0.1  # the engine panel redraws at most this often while a reply streams


@dataclass
class ReplyState:
    """The request in flight, and where its text goes (nowhere once the user moved on)."""

    request_id: str
    cancel: threading.Event
    chat_id: int | None = None
    live: LiveStats = field(default_factory=LiveStats)
    view: MessageView | None = None
    stream: MarkdownStream | None = None
    drawn_at: float = -1.0


class ReplyActions(_AppBase):
    # ---- starting a request --------------------------------------------------------------
    # NOTE: handlers here use on_<message> names, not @on: Textual collects @on handlers only
    # from classes of its own metaclass, and this mixin is a plain class.
    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        """Answer ``text`` after the shown branch, or in place of the message being edited."""
        if not self.can_start():
            return
        job = self.reply_job_for(text)
        self.prompt.clear()
        self.stop_editing()
        self.start(job)

    def reply_job_for(self, text: str) -> ReplyJob:
        """The reply `send` would start for ``text`` now: after the shown branch, or in place
        of the message being edited."""
        if self.editing is not None:
            index = next(i for i, m in enumerate(self.messages) if m.id == self.editing.id)
            above, parent = self.messages[:index], self.editing.parent_id
        else:
            above = self.messages
            parent = self.messages[-1].id if self.messages else None
        return self.job(parent, text, above)

    async def action_regenerate(self) -> None:
        """A new reply to the last user message, beside the old one (which stays a branch)."""
        if not self.can_start():
            return
        users = [i for i, m in enumerate(self.messages) if m.role == "user"]
        if not users:
            self.notify("There is no reply to regenerate yet.", severity="warning")
            return
        last_user = users[-1]
        self.start(self.job(self.messages[last_user].id, None, self.messages[: last_user + 1]))

    def job(self, parent: int | None, text: str | None, above: list[StoredMessage]) -> ReplyJob:
        assert self.engine is not None
        return ReplyJob(
            request_id=uuid.uuid4().hex,
            chat_id=self.chat.id if self.chat else None,
            parent_id=parent,
            user_text=text,
            history=tuple({"role": m.role, "content": m.content} for m in above),
            settings=self.settings,
            model_name=self.engine.model.name,
        )

    def can_start(self) -> bool:
        if self.engine is None or self.loading is not None:
            self.notify("The model is still loading.", severity="warning")
            return False
        if self.reply is not None:
            self.notify("A reply is being written: press Esc to stop it first.", severity="warning")
            return False
        return True

    def start(self, job: ReplyJob) -> None:
        self.stop_draft_prefill()  # its finished blocks stay cached for this reply
        self.reply = ReplyState(job.request_id, job.cancel, chat_id=job.chat_id)
        self.refresh_bindings()  # Esc now stops
        self.panel.state.activity = "generating…"
        self.panel.render_state()
        self._reply_worker(job)

    @work(thread=True, group="reply")
    def _reply_worker(self, job: ReplyJob) -> None:
        assert self.engine is not None
        with self.threads.running():
            run_reply(self.engine, self.store, job, self.post_message)

    # ---- stopping ------------------------------------------------------------------------
    def stop_reply(self) -> None:
        if self.reply is not None:
            self.reply.cancel.set()
            if self.engine is not None:
                self.engine.cancel(self.reply.request_id)

    def action_stop(self) -> None:
        if self.reply is not None:
            self.stop_reply()
        elif self.editing is not None:
            self.stop_editing()
            self.prompt.clear()

    async def leave_reply(self) -> None:
        """The user moves elsewhere: stop the reply and stop drawing it. Its worker stores it
        as stopped and reports back; until then no other request starts."""
        reply = self.reply
        if reply is None:
            return
        self.stop_reply()
        if reply.stream is not None:
            stream, reply.stream, reply.view = reply.stream, None, None
            await stream.stop()

    async def finish(self, request_id: str) -> bool:
        """The worker's last word on ``request_id``: True if it is the request in flight."""
        if self.reply is None or self.reply.request_id != request_id:
            return False
        await self.leave_reply()
        self.reply = None
        self.refresh_bindings()
        self.panel.state.activity = ""
        self.close_retired()
        return True

    # ---- the reply streams ---------------------------------------------------------------
    async def on_reply_started(self, message: ReplyStarted) -> None:
        reply = self.reply
        if reply is None or reply.request_id != message.request_id:
            return
        reply.live = LiveStats(prompt_tokens=message.prompt_tokens)
        shown = self.chat.id if self.chat is not None else None
        if reply.chat_id == shown and not reply.cancel.is_set():  # the user is still here
            reply.chat_id = message.chat.id
            self.chat = message.chat
            conv = self.store.conversation(message.chat.id)
            await self.sync_view(conv.messages, conv.branches)
            view = self.conversation.view_of(message.reply.id)
            if view is not None:
                view.set_info(replace(view.info, status="streaming"))
                reply.view, reply.stream = view, view.stream()
            state = self.panel.state
            state.clear_reply()
            state.prompt_tokens = state.context_tokens = message.prompt_tokens
            self.panel.render_state()
        reply.chat_id = message.chat.id
        await self.refresh_sidebar()

    async def sync_view(self, messages: list[StoredMessage], branches: dict[int, tuple[int, int]]) -> None:
        """Bring the conversation to ``messages``, re-using the views of the common prefix: a
        new message is one mount, not a re-render of the whole conversation."""
        views = self.conversation.views()
        keep = 0
        while keep < min(len(views), len(messages)) and views[keep].message_id == messages[keep].id:
            keep += 1
        for view in views[keep:]:
            await view.remove()
        for view, m in zip(views[:keep], messages):
            view.set_info(MessageInfo.of(m, branches.get(m.id, (1, 1))))
        for m in messages[keep:]:
            await self.conversation.add(MessageInfo.of(m, branches.get(m.id, (1, 1))), m.content)
        self.messages, self.branches = messages, branches

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        reply = self.reply
        if reply is None or reply.request_id != message.request_id:
            return
        reply.live.add(message.elapsed_s, message.tokens)
        if reply.view is None or reply.stream is None:
            return
        reply.view.text += message.text
        reply.view.chunks += 1
        await reply.stream.write(message.text)
        if message.elapsed_s - reply.drawn_at >= PANEL_REFRESH_S:
            reply.drawn_at = message.elapsed_s
            live, state = reply.live, self.panel.state
            state.ttft_s, state.decode_tok_s, state.rates = live.ttft_s, live.decode_tok_s, list(live.rates)
            state.completion_tokens = live.completion_tokens
            state.context_tokens = live.prompt_tokens + live.completion_tokens
            self.panel.render_state()

    async def on_reply_done(self, message: ReplyDone) -> None:
        if not await self.finish(message.request_id):
            return
        stored = message.reply
        if self.chat is not None and self.chat.id == stored.chat_id and any(m.id == stored.id for m in self.messages):
            self.messages = [stored if m.id == stored.id else m for m in self.messages]
            view = self.conversation.view_of(stored.id)
            if view is not None:
                view.text = stored.content
                view.set_info(MessageInfo.of(stored, self.branches.get(stored.id, (1, 1))))
            self.panel.state.take_stats(stored.stats or {})
            if stored.finish_reason == "cancelled":
                await self.conversation.notice("Reply stopped.")
            elif stored.finish_reason == "context":
                await self.conversation.notice("The context window filled up and the reply was cut: Ctrl+N starts a new chat.")
            self.warn_if_nearly_full()
        self.panel.render_state()
        await self.refresh_sidebar()

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        if not await self.finish(message.request_id):
            return
        self.panel.render_state()
        if self.chat is not None:
            await self.show_branch()
        # Nothing the user wrote is lost: an unanswered message goes back to the input box.
        if message.unsent and not self.prompt.text:
            self.prompt.text = message.unsent
        await self.conversation.notice(message.error)

    # ---- a message that does not fit -----------------------------------------------------
    async def on_context_full(self, message: ContextFull) -> None:
        if not await self.finish(message.job.request_id):
            return
        self.panel.render_state()
        job = message.job
        if not job.history:  # the message alone is too long: there is nothing to carry over
            if job.user_text and not self.prompt.text:
                self.prompt.text = job.user_text
            await self.conversation.notice(
                f"Your message is {message.prompt_tokens} tokens but the context window is {message.n_ctx}, "
                f"with {message.reserve} kept for the reply: shorten it, or load the model with a larger --ctx."
            )
            return

        async def chosen(choice: str | None) -> None:
            if choice == "anyway":
                self.start(replace(job, request_id=uuid.uuid4().hex, cancel=threading.Event(), allow_overflow=True))
            elif choice in ("turns", "summary"):
                self.carry(replace(job, request_id=uuid.uuid4().hex, cancel=threading.Event()), choice)  # type: ignore[arg-type]
            else:
                if job.user_text and not self.prompt.text:
                    self.prompt.text = job.user_text
                self.prompt.focus()

        self.push_screen(ContextFullScreen(message.prompt_tokens, message.n_ctx, message.reserve), chosen)

    def carry(self, job: ReplyJob, mode: CarryMode) -> None:
        self.reply = ReplyState(job.request_id, job.cancel, chat_id=job.chat_id)
        self.refresh_bindings()
        self.panel.state.activity = "summarizing…" if mode == "summary" else "starting a new chat…"
        self.panel.render_state()
        self._carry_worker(job, mode)

    @work(thread=True, group="reply")
    def _carry_worker(self, job: ReplyJob, mode: CarryMode) -> None:
        assert self.engine is not None
        with self.threads.running():
            carry_over(self.engine, self.store, job, mode, self.post_message)

    async def on_carried_over(self, message: CarriedOver) -> None:
        if not await self.finish(message.request_id):
            return
        await self.open_chat(message.chat.id)
        await self.conversation.notice(
            "Continued from a full chat: "
            + ("a summary of it is in this chat's system prompt (F3 shows it)." if message.summary
               else "its last turns were carried over.")
        )
        if message.text:
            await self.send(message.text)
        else:
            await self.action_regenerate()

    async def on_carry_failed(self, message: CarryFailed) -> None:
        if not await self.finish(message.request_id):
            return
        self.panel.render_state()
        if message.text and not self.prompt.text:
            self.prompt.text = message.text
        await self.conversation.notice(message.error)

    # ---- editing, branches, copying ------------------------------------------------------
    def on_message_view_edit_requested(self, event: MessageView.EditRequested) -> None:
        self.editing = next((m for m in self.messages if m.id == event.message_id), None)
        if self.editing is None:
            return
        self.prompt.text = event.text
        banner = self.query_one("#edit-banner")
        banner.update("Editing a message: Enter sends it as a new branch (the old one stays); Esc cancels.")  # type: ignore[attr-defined]
        banner.display = True
        self.refresh_bindings()
        self.prompt.focus()

    def stop_editing(self) -> None:
        self.editing = None
        self.query_one("#edit-banner").display = False
        self.refresh_bindings()

    async def on_message_view_branch_requested(self, event: MessageView.BranchRequested) -> None:
        if self.reply is not None:
            self.notify("A reply is being written: press Esc to stop it first.", severity="warning")
            return
        depth = next((i for i, m in enumerate(self.messages) if m.id == event.message_id), None)
        self.chat = self.store.switch_branch(event.message_id, event.step)
        self.stop_editing()
        await self.show_branch(focus_depth=depth)

    def on_message_view_copy_requested(self, event: MessageView.CopyRequested) -> None:
        self.copy_to_clipboard(event.text)
        self.notify(f"Copied {len(event.text)} characters.")
