"""What the chat's thread workers do: stream a reply into the store, and continue a full chat
in a new one. Plain functions of (engine, store, job, post): they block, so the app runs them
in Textual thread workers; they talk to the UI only through the messages they post.

A reply is stored as soon as it starts (empty, ``partial``), rewritten at most every
``SAVE_EVERY_S`` while it streams, and finally marked ``complete`` or ``stopped`` with its
figures: if the process dies, the text up to the last save is in the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from llmlocal.engine.types import DoneEvent, Request, SamplingParams
from llmlocal.models.errors import LLMLocalError

from ..history import ChatStore
from .live_stats import LiveStats, downsample
from .settings import ChatSettings
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
    from llmlocal.engine import Engine
    from textual.message import Message

SAVE_EVERY_S = 0.5
Post = Callable[["Message"], object]


@dataclass(frozen=True)
class ReplyJob:
    """One reply to produce, and where it goes in the chat's tree.

    With ``user_text`` a new user message is stored under ``parent_id`` and answered; without
    it (regenerate) a new reply is stored under ``parent_id``, which is a user message.
    ``history`` is the branch above the new message, root first (no system prompt).
    """

    request_id: str
    chat_id: int | None  # None: a new chat
    parent_id: int | None
    user_text: str | None
    history: tuple[dict[str, str], ...]
    settings: ChatSettings
    model_name: str
    allow_overflow: bool = False  # the user chose to send although the reply may be cut short
    # Set by the app to stop the request. Engine.cancel only reaches a request the engine has
    # registered; the worker re-checks this once it has, so an early stop is never lost.
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)

    def messages(self) -> list[dict[str, str]]:
        new = [{"role": "user", "content": self.user_text}] if self.user_text is not None else []
        return self.settings.system_messages() + list(self.history) + new


def reply_reserve(sampling: SamplingParams, n_ctx: int) -> int:
    """Tokens a prompt must leave free so that a reply has room: the reply's cap, at most an
    eighth of the window (a long window is not refused for a short prompt)."""
    return max(1, min(sampling.max_tokens or 256, n_ctx // 8))


def does_not_fit(prompt_tokens: int, n_ctx: int | None, reserve: int, allow_overflow: bool) -> bool:
    if n_ctx is None:  # a remote server that does not say: it will refuse what does not fit
        return False
    return prompt_tokens >= n_ctx or (prompt_tokens + reserve > n_ctx and not allow_overflow)


def run_reply(engine: Engine, store: ChatStore, job: ReplyJob, post: Post) -> None:
    messages = job.messages()
    try:
        # The chat's reply format, from its schema file as it is now: one that has gone or
        # broken since it was chosen refuses the reply before anything is stored.
        grammar = job.settings.reply_format.grammar()
        prompt_tokens = engine.count_tokens(messages)
    except LLMLocalError as e:
        post(ReplyFailed(job.request_id, str(e), job.user_text))
        return
    n_ctx = engine.n_ctx
    reserve = reply_reserve(job.settings.sampling, n_ctx) if n_ctx is not None else 0
    if does_not_fit(prompt_tokens, n_ctx, reserve, job.allow_overflow):
        assert n_ctx is not None
        post(ContextFull(job, prompt_tokens, n_ctx, reserve))
        return

    settings = job.settings
    if job.chat_id is None:
        chat = store.create_chat(
            system_prompt=settings.system_prompt, sampling=settings.sampling_dict(), model=job.model_name
        )
    else:
        chat = store.get_chat(job.chat_id)
    user = store.add_message(chat.id, job.parent_id, "user", job.user_text) if job.user_text is not None else None
    parent = user.id if user is not None else job.parent_id
    reply = store.add_message(chat.id, parent, "assistant", "", status="partial", model=job.model_name)
    request = Request.chat(messages, replace(settings.sampling, grammar=grammar), id=job.request_id)
    try:
        events = engine.generate(request)  # registers the request id: cancel() now reaches it
    except LLMLocalError as e:  # refused before the first token: the message was not answered
        if job.chat_id is None:
            store.delete_chat(chat.id)
        else:
            store.delete_message(user.id if user is not None else reply.id)
        post(ReplyFailed(job.request_id, str(e), job.user_text))
        return
    if job.cancel.is_set():
        engine.cancel(job.request_id)
    post(ReplyStarted(job.request_id, store.get_chat(chat.id), user, reply, prompt_tokens))

    live = LiveStats(prompt_tokens=prompt_tokens)
    text = ""
    start = saved_at = time.perf_counter()
    try:
        for event in events:
            now = time.perf_counter()
            if isinstance(event, DoneEvent):
                status = "stopped" if event.finish_reason == "cancelled" else "complete"
                stats = event.stats.to_dict() | {"token_rates": downsample(live.rates)}
                final = store.update_message(reply.id, event.text, status, event.finish_reason, stats)
                post(ReplyDone(job.request_id, final, event.stats))
                return
            live.add(now - start, len(event.token_ids))
            text += event.text
            post(ReplyChunk(job.request_id, event.text, len(event.token_ids), now - start))
            if now - saved_at >= SAVE_EVERY_S or (text and live.completion_tokens == 1):
                store.update_message(reply.id, text, "partial")
                saved_at = now
    except LLMLocalError as e:  # failed mid-reply: keep what came, as a stopped reply
        store.update_message(reply.id, text, "stopped")
        post(ReplyFailed(job.request_id, str(e), None))


CarryMode = Literal["turns", "summary"]
SUMMARY_INSTRUCTION = (
    "Summarize the conversation below in a few sentences: the user's goals, the facts "
    "established and anything still open. Write only the summary."
)


def carry_over(engine: Engine, store: ChatStore, job: ReplyJob, mode: CarryMode, post: Post) -> None:
    """Start a new chat that continues ``job``'s full one, then hand ``job.user_text`` back
    to the app to send there. ``turns`` copies the latest turns that fit in half the window;
    ``summary`` has the model summarise the conversation into the new chat's system prompt."""
    text = job.user_text or ""
    old = store.get_chat(job.chat_id) if job.chat_id is not None else None
    title = f"{old.display_title} (continued)" if old else None
    settings = job.settings
    n_ctx = engine.n_ctx or 4096  # (a window is only full when the engine reports one)
    try:
        if mode == "turns":
            kept = _latest_turns(engine, job, budget=n_ctx // 2)
            system = settings.system_prompt
        else:
            summary = _summarise(engine, job, n_ctx)
            head = f"{settings.system_prompt}\n\n" if settings.system_prompt else ""
            system = f"{head}Summary of the conversation so far:\n{summary}"
            kept = []
    except LLMLocalError as e:
        post(CarryFailed(job.request_id, str(e), text))
        return
    chat = store.create_chat(title=title, system_prompt=system, sampling=settings.sampling_dict(), model=job.model_name)
    parent = None
    for message in kept:
        parent = store.add_message(chat.id, parent, message["role"], message["content"]).id  # type: ignore[arg-type]
    post(CarriedOver(job.request_id, store.get_chat(chat.id), text, mode == "summary"))


def _latest_turns(engine: Engine, job: ReplyJob, budget: int) -> list[dict[str, str]]:
    """The longest tail of the history that starts at a user message and, with the system
    prompt and the new message, stays within ``budget`` tokens."""
    history = list(job.history)
    starts = [i for i, m in enumerate(history) if m["role"] == "user"]
    for start in starts:  # earliest start first: the first that fits keeps the most
        tail = history[start:]
        if engine.count_tokens(replace(job, history=tuple(tail)).messages()) <= budget:
            return tail
    return []


def _summarise(engine: Engine, job: ReplyJob, n_ctx: int) -> str:
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in job.history]
    # Drop the oldest lines until the summary request fits in half the window.
    while lines:
        messages = [{"role": "user", "content": SUMMARY_INSTRUCTION + "\n\n" + "\n".join(lines)}]
        if engine.count_tokens(messages) <= n_ctx // 2:
            break
        lines.pop(0)
    if not lines:
        raise LLMLocalError("The conversation is too long to summarise in this context window: carry the last turns instead.")
    sampling = replace(job.settings.sampling, max_tokens=max(16, min(200, n_ctx // 4)), n=1)
    done = None
    events = engine.generate(Request.chat(messages, sampling, id=job.request_id))
    if job.cancel.is_set():
        engine.cancel(job.request_id)
    for event in events:
        if isinstance(event, DoneEvent):
            done = event
    if done is None or done.finish_reason == "cancelled" or not done.text.strip():
        raise LLMLocalError("The summary was stopped before it was written: try again, or carry the last turns.")
    return done.text.strip()
