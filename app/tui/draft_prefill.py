"""`DraftPrefill`: the part of `ChatApp` that prefills the message while it is being typed.

A long message (a pasted file, a log) costs its whole prefill before the first word of the
reply: on a laptop's CPU, seconds per thousand tokens. But the user usually pauses before
pressing Enter (to type the question under the paste, to read it over), and the prompt the
reply will have is known by then up to the message's last tokens. So once the message box has
been still for `PREFILL_AFTER_S`, the conversation with the draft as its new user message is
prefilled in a thread worker (`Engine.prefill`): its K/V go to the engine's prefix cache (the
paged engine's blocks, llama.cpp's context), and the reply, when it is sent, prefills only
what changed after them. Typing again cancels that prefill and, after the next pause, starts
one for the new text; sending cancels it too (its finished blocks are kept). Nothing is shown
and nothing is stored: the reply's figures count the reused tokens as cached.

Off with `llmlocal chat --no-prefill-draft`, and idle while a reply is written or a model loads.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING

from textual import work
from textual.timer import Timer
from textual.widgets import TextArea
from llmlocal.models.errors import LLMLocalError

if TYPE_CHECKING:
    from llmlocal.engine import Engine, Request

    from .chat_app import ChatApp

    _AppBase = ChatApp
else:
    _AppBase = object

PREFILL_AFTER_S = 0.8  # the message box still this long: prefill the draft


class DraftPrefill(_AppBase):
    prefill_draft: bool = True  # set by ChatApp from its arguments
    _draft_timer: Timer | None = None
    _draft_cancel: threading.Event | None = None  # the prefill in flight's
    _draft_engine: Engine | None = None  # ... and its engine, not closed before it ends
    _draft_prompt: tuple[object, ...] | None = None  # the messages last prefilled

    # NOTE: an on_<message> handler, not @on: this mixin is a plain class (see ReplyActions).
    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area is not self.prompt or not self.prefill_draft:
            return
        self.stop_draft_prefill()
        if self._draft_timer is not None:
            self._draft_timer.stop()
        self._draft_timer = self.set_timer(PREFILL_AFTER_S, self.start_draft_prefill)

    def start_draft_prefill(self) -> None:
        """Prefill the conversation as `send` would make it with the message box's text."""
        text = self.prompt.text
        engine = self.engine
        if not text.strip() or engine is None or self.loading is not None or self.reply is not None:
            return
        if self._draft_cancel is not None:  # one at a time: the last one is still stopping
            return
        job = self.reply_job_for(text)
        messages = job.messages()
        key = (id(engine), tuple((m["role"], m["content"]) for m in messages))
        if key == self._draft_prompt:
            return
        from llmlocal.engine import Request

        self._draft_prompt = key
        self._draft_cancel = cancel = threading.Event()
        self._draft_engine = engine
        self._draft_worker(engine, Request.chat(messages, job.settings.sampling, id=f"draft-{uuid.uuid4().hex}"), cancel)

    def stop_draft_prefill(self) -> None:
        """Cancel the prefill in flight, if any (it ends within one engine step)."""
        if self._draft_cancel is not None:
            self._draft_cancel.set()

    @work(thread=True, group="draft")
    def _draft_worker(self, engine: Engine, request: Request, cancel: threading.Event) -> None:
        with self.threads.running():
            try:
                engine.prefill(request, cancel)
            except LLMLocalError:
                pass  # a draft that would not fit, or a model that went away: the reply will say
            finally:
                if not self.closing:
                    self.call_from_thread(self._draft_done, cancel)

    def _draft_done(self, cancel: threading.Event) -> None:
        if cancel is not self._draft_cancel:
            return
        self._draft_cancel = self._draft_engine = None
        self.close_retired()
        if cancel.is_set():  # stopped by new text: prefill the text as it is now (if any)
            self._draft_prompt = None
            self.start_draft_prefill()

    def draft_busy(self, engine: Engine) -> bool:
        """Whether a draft's prefill is still running on ``engine`` (which must stay open)."""
        return self._draft_cancel is not None and self._draft_engine is engine
