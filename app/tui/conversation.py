"""The conversation: one `MessageView` per message of the shown branch.

A message view is focusable; its keys copy the text, edit a user message (which branches
the chat) and step through the branches of the tree at that message. The views only post
what the user asked for; the app does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from ..history import StoredMessage

FINISH_NOTES = {
    "length": "cut at max tokens",
    "context": "context window full",
}


@dataclass(frozen=True)
class MessageInfo:
    """What a view shows about a message besides its text."""

    role: str  # "user" | "assistant"
    message_id: int | None = None
    model: str | None = None
    status: str = "complete"  # complete | partial | stopped | streaming
    finish_reason: str | None = None
    completion_tokens: int | None = None
    branch: tuple[int, int] = (1, 1)  # (position from 1, siblings)

    @classmethod
    def of(cls, m: StoredMessage, branch: tuple[int, int]) -> MessageInfo:
        tokens = m.stats.get("completion_tokens") if m.stats else None
        return cls(m.role, m.id, m.model, m.status, m.finish_reason, tokens, branch)

    def header(self) -> str:
        parts = ["you" if self.role == "user" else (self.model or "assistant")]
        if self.completion_tokens is not None:
            parts.append(f"{self.completion_tokens} tokens")
        if self.status == "stopped":
            parts.append("stopped")
        elif self.status == "partial":
            parts.append("interrupted: the app closed while this was written")
        elif self.status == "streaming":
            parts.append("writing…")
        elif self.finish_reason in FINISH_NOTES:
            parts.append(FINISH_NOTES[self.finish_reason])
        position, count = self.branch
        if count > 1:
            parts.append(f"‹ {position}/{count} ›")
        return "  ·  ".join(parts)


class MessageView(Vertical, can_focus=True):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("c", "copy", "Copy"),
        Binding("e", "edit", "Edit (branch)"),
        Binding("left,[", "branch(-1)", "Prev branch"),
        Binding("right,]", "branch(1)", "Next branch"),
    ]

    @dataclass
    class CopyRequested(Message):
        text: str

    @dataclass
    class EditRequested(Message):
        message_id: int
        text: str

    @dataclass
    class BranchRequested(Message):
        message_id: int
        step: int

    def __init__(self, info: MessageInfo, text: str) -> None:
        super().__init__(classes=f"message {info.role}")
        self.info = info
        self.text = text
        self.chunks = 0  # pieces a streamed reply arrived in: more than one means it streamed

    @property
    def message_id(self) -> int | None:
        return self.info.message_id

    @property
    def finish_reason(self) -> str | None:
        return self.info.finish_reason

    def compose(self) -> ComposeResult:
        yield Static(self.info.header(), markup=False, classes="message-header")
        if self.info.role == "user":
            yield Static(self.text, markup=False, classes="message-body")
        else:
            yield Markdown(self.text, classes="message-body")

    def set_info(self, info: MessageInfo) -> None:
        self.info = info
        self.query_one(".message-header", Static).update(info.header())
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "edit":
            return self.info.role == "user" and self.info.message_id is not None
        if action == "branch":
            return self.info.branch[1] > 1
        return True

    def action_copy(self) -> None:
        self.post_message(self.CopyRequested(self.text))

    def action_edit(self) -> None:
        if self.info.message_id is not None:
            self.post_message(self.EditRequested(self.info.message_id, self.text))

    def action_branch(self, step: int) -> None:
        if self.info.message_id is not None:
            self.post_message(self.BranchRequested(self.info.message_id, step))

    def stream(self) -> MarkdownStream:
        """Append to this reply's Markdown as fragments arrive, without re-rendering the
        blocks already shown (Textual's Markdown stream parses only the tail)."""
        return Markdown.get_stream(self.query_one(".message-body", Markdown))


class Notice(Static):
    """A line from llmlocal itself (an error, a stopped reply): never sent to the model."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="notice")
        self.text = text


class ConversationView(VerticalScroll):
    """The shown branch, oldest first; stays scrolled to the end while a reply streams."""

    def on_mount(self) -> None:
        self.anchor()

    async def show(self, messages: list[StoredMessage], branches: dict[int, tuple[int, int]]) -> None:
        await self.remove_children()
        views = [MessageView(MessageInfo.of(m, branches.get(m.id, (1, 1))), m.content) for m in messages]
        if views:
            await self.mount_all(views)
        self.scroll_end(animate=False)

    async def add(self, info: MessageInfo, text: str) -> MessageView:
        view = MessageView(info, text)
        await self.mount(view)
        return view

    async def notice(self, text: str) -> Notice:
        notice = Notice(text)
        await self.mount(notice)
        return notice

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def view_of(self, message_id: int) -> MessageView | None:
        return next((v for v in self.query(MessageView) if v.message_id == message_id), None)
