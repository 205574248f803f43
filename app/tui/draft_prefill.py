"""`DraftPrefill`: the part of `ChatApp` that prefills the message while it is being typed.

A long message (a pasted file, a log) costs its whole prefill before the first word of the
reply: on a laptop's CPU, seconds per thousand tokens. But the prompt the reply will have is
known long before Enter, up to the message's last tokens: a user pastes, then types the
question under the paste or reads it over. So the conversation with the draft as its new user
message is prefilled in a thread worker (`Engine.prefill`), its K/V kept in the engine's
prefix cache (the paged engine's blocks, llama.cpp's context), and the reply then prefills
only what came after:

* a paste (the text grew by `PASTE_CHARS` or more at once) starts a prefill at once; other
  typing, once the message box has been still for `PREFILL_AFTER_S`;
* typing on does not stop a prefill in flight (the message's start, most of it, stays the
  same): when it ends, the text as it is then is prefilled after the next pause, which
  computes only the new tail; an edit that keeps less than half of the text being
  prefilled stops it;
* with the box empty, the chat's history is prefilled when the chat is opened or its model
  loaded: a reopened long chat whose blocks are not on disk (llama.cpp, or `--no-kv-cache`)
  is computed while its user reads it, not after the next message;
* sending stops it (the blocks it finished are kept, and the reply starts from them), and so
  do a model switch and quitting. Nothing is shown or stored: the reply's figures count the
  reused tokens as cached.

Off with `llmlocal chat --no-prefill-draft`, and idle while a reply is written or a model loads.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import TYPE_CHECKING

from llmlocal.models.errors import LLMLocalError
from textual import work
from textual.css.query import NoMatches
from textual.timer import Timer
from textual.widgets import TextArea

if TYPE_CHECKING:
    from llmlocal.engine import Engine, Request

    from .chat_app import ChatApp

    _AppBase = ChatApp
else:
    _AppBase = object

PREFILL_AFTER_S = 0.8  # the message box still this long: prefill the draft
PASTE_CHARS = 200  # the text grew by this much at once: prefill now


class DraftPrefill(_AppBase):
    prefill_draft: bool = True  # set by ChatApp from its arguments
    _draft_timer: Timer | None = None
    _draft_cancel: threading.Event | None = None  # the prefill in flight's
    _draft_engine: Engine | None = None  # ... and its engine, not closed before it ends
    _draft_text: str = ""  # ... and its text
    _draft_prompt: tuple[object, ...] | None = None  # the messages last prefilled
    _draft_seen = 0  # the length of the text at the last change

    # NOTE: an on_<message> handler, not @on: this mixin is a plain class (see ReplyActions).
    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area.id != "prompt" or not self.prefill_draft:
            return
        text = event.text_area.text
        if self._draft_cancel is not None and len(os.path.commonprefix([text, self._draft_text])) < len(self._draft_text) // 2:
            self.stop_draft_prefill()  # most of what it computes is gone from the message
        pasted = len(text) - self._draft_seen >= PASTE_CHARS
        self._draft_seen = len(text)
        if self._draft_timer is not None:
            self._draft_timer.stop()
        if pasted:
            self.start_draft_prefill()
        else:
            self._draft_timer = self.set_timer(PREFILL_AFTER_S, self.start_draft_prefill)

    def start_draft_prefill(self) -> None:
        """Prefill the conversation as `send` would make it with the message box's text; with
        the box empty, the chat's history alone (a chat just opened or a model just loaded)."""
        text = self._box_text()
        engine = self.engine
        if text is None or engine is None or self.loading is not None or self.reply is not None or not self.prefill_draft:
            return
        if self._draft_cancel is not None:  # one at a time: `_draft_done` comes back here
            return
        job = self.reply_job_for(text)
        messages = job.messages()
        if not text.strip():
            messages = messages[:-1]  # the history, without the empty message
            if not job.history:
                return
        key = (id(engine), tuple((m["role"], m["content"]) for m in messages))
        if key == self._draft_prompt:
            return
        from llmlocal.engine import Request

        self._draft_prompt, self._draft_text = key, text
        self._draft_cancel = cancel = threading.Event()
        self._draft_engine = engine
        self._draft_worker(engine, Request.chat(messages, job.settings.sampling, id=f"draft-{uuid.uuid4().hex}"), cancel)

    def stop_draft_prefill(self) -> None:
        """Stop the prefill in flight, if any (within one engine step)."""
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
        if cancel.is_set():  # stopped before its end: the same text would be prefilled again
            self._draft_prompt = None
        self.close_retired()
        if cancel.is_set() or self._box_text() != self._draft_text:  # the text (or model) as it is now, after a pause
            if self._draft_timer is not None:
                self._draft_timer.stop()
            self._draft_timer = self.set_timer(PREFILL_AFTER_S, self.start_draft_prefill)

    def _box_text(self) -> str | None:
        """The message box's text; None while another screen (a dialog) is in front of it."""
        try:
            return self.prompt.text
        except NoMatches:
            return None

    def draft_busy(self, engine: Engine) -> bool:
        """Whether a draft's prefill is still running on ``engine`` (which must stay open)."""
        return self._draft_cancel is not None and self._draft_engine is engine
