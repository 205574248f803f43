"""Widgets of the chat screen. They render what they are given and post typed messages;
none of them touches the engine, a file or a model."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Shift+Enter or Ctrl+J starts a new line."""

    NEWLINE_KEYS = ("shift+enter", "ctrl+j")

    @dataclass
    class Submitted(Message):
        text: str

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(text))
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class UserMessage(Static):
    """A message the user sent, shown as plain text (no markup)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.text = text


class AssistantMessage(Markdown):
    """A streamed reply, rendered as Markdown. `text` is the raw reply so far."""

    def __init__(self) -> None:
        super().__init__("", classes="message assistant")
        self.text = ""
        self.chunks = 0  # pieces the reply arrived in: more than one means it streamed
        self.finish_reason: str | None = None


class Notice(Static):
    """A line from llmlocal itself (an error, a stopped reply): never sent to the model."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="notice")
        self.text = text


class StatusBar(Static):
    """One line: model, backend and device, then the last reply's TTFT and speed."""

    def show(self, *parts: str) -> None:
        self.update("  ·  ".join(p for p in parts if p))
