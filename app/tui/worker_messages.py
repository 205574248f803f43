"""Typed messages that the app's thread workers post back to the UI thread.

Replies carry the id of their request: the app ignores events of a request it no longer
shows (stopped, or the user moved to another chat), so no stale text lands anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual.message import Message

from ..history import Chat, StoredMessage

if TYPE_CHECKING:
    from llmlocal.engine import Engine, Stats

    from .reply_worker import ReplyJob


@dataclass
class EngineLoaded(Message):
    engine: Engine


@dataclass
class EngineLoadFailed(Message):
    model: str
    error: str


@dataclass
class ModelsListed(Message):
    models: list[Any]  # llmlocal.models.store.StoredModel
    error: str | None = None  # why the list could not be read (the picker still takes a name)


@dataclass
class ContextCounted(Message):
    """Prompt tokens of the shown conversation, counted when it is opened or changes."""

    chat_id: int | None
    leaf_id: int | None
    tokens: int


@dataclass
class ReplyStarted(Message):
    request_id: str
    chat: Chat  # a new chat is created only once its first prompt is known to fit
    user: StoredMessage | None  # the new user message, None when regenerating
    reply: StoredMessage  # stored already, empty and partial
    prompt_tokens: int


@dataclass
class ReplyChunk(Message):
    request_id: str
    text: str
    tokens: int  # new tokens in this event (0: text held back, or released at the end)
    elapsed_s: float  # since the request was handed to the engine, measured in the worker


@dataclass
class ReplyDone(Message):
    request_id: str
    reply: StoredMessage  # as stored: final text, status, finish reason and stats
    stats: Stats


@dataclass
class ReplyFailed(Message):
    request_id: str
    error: str
    unsent: str | None  # the user's text, to give back to the input box when it was not sent


@dataclass
class ContextFull(Message):
    """The conversation plus the new message leaves too little room for a reply."""

    job: ReplyJob
    prompt_tokens: int
    n_ctx: int
    reserve: int  # tokens kept free for the reply


@dataclass
class CarriedOver(Message):
    """A new chat continues a full one (its last turns, or a summary): send ``text`` there."""

    request_id: str
    chat: Chat
    text: str  # empty: regenerate the reply to the chat's last message
    summary: bool  # the new chat starts from a summary (else from the last turns)


@dataclass
class CarryFailed(Message):
    request_id: str
    error: str
    text: str
