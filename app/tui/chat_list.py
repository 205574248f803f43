"""The sidebar: a search box over the list of chats, newest first.

Enter (or a click) opens a chat; R renames it, Delete removes it after a confirmation. The
sidebar posts what was asked; the app reads and writes the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from ..history import Chat


def chat_date(timestamp: float) -> str:
    """When a chat was last written, in local time: 'Mar 02 14:05'."""
    return time.strftime("%b %d %H:%M", time.localtime(timestamp))


class ChatItem(ListItem):
    def __init__(self, chat: Chat) -> None:
        super().__init__(classes="chat-item")
        self.chat = chat

    def compose(self) -> ComposeResult:
        yield Label(self.chat.display_title, markup=False, classes="chat-title")
        yield Label(chat_date(self.chat.updated_at), classes="chat-date")


class ChatItems(ListView):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r,f4", "rename", "Rename"),
        Binding("delete,d", "delete", "Delete"),
    ]

    def _chat_id(self) -> int | None:
        item = self.highlighted_child
        return item.chat.id if isinstance(item, ChatItem) else None

    def action_rename(self) -> None:
        chat_id = self._chat_id()
        if chat_id is not None:
            self.post_message(ChatList.RenameRequested(chat_id))

    def action_delete(self) -> None:
        chat_id = self._chat_id()
        if chat_id is not None:
            self.post_message(ChatList.DeleteRequested(chat_id))


class ChatList(Vertical):
    @dataclass
    class Opened(Message):
        chat_id: int

    @dataclass
    class RenameRequested(Message):
        chat_id: int

    @dataclass
    class DeleteRequested(Message):
        chat_id: int

    @dataclass
    class SearchChanged(Message):
        query: str

    def compose(self) -> ComposeResult:
        yield Label("llmlocal · chats", id="sidebar-title")
        yield Input(placeholder="Search chats", id="chat-search")
        yield ChatItems(id="chat-items")

    @property
    def query_text(self) -> str:
        return self.query_one("#chat-search", Input).value

    @property
    def items(self) -> ChatItems:
        return self.query_one(ChatItems)

    async def show(self, chats: list[Chat], current: int | None) -> None:
        """List ``chats`` and put the cursor on the one shown (none if it is not listed)."""
        items = self.items
        await items.clear()
        await items.extend(ChatItem(c) for c in chats)
        ids = [c.id for c in chats]
        items.index = ids.index(current) if current in ids else None

    def titles(self) -> list[str]:
        return [item.chat.display_title for item in self.items.query(ChatItem)]

    @on(Input.Changed, "#chat-search")
    def _search(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value))

    @on(Input.Submitted, "#chat-search")
    def _to_list(self, event: Input.Submitted) -> None:
        event.stop()
        self.items.focus()

    @on(ListView.Selected, "#chat-items")
    def _open(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ChatItem):
            self.post_message(self.Opened(event.item.chat.id))
