"""Small modal questions: confirm, type a name, and what to do when the context is full."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no; Y / Enter confirms, N / Esc declines."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, yes: str = "Delete") -> None:
        super().__init__(classes="dialog-screen")
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, markup=False, classes="dialog-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextPromptScreen(ModalScreen["str | None"]):
    """One line of text (a chat's new title); Enter accepts, Esc cancels."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.prompt_title = title
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.prompt_title, classes="dialog-text")
            yield Input(self.value, id="dialog-input")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class ContextFullScreen(ModalScreen[str]):
    """The message does not fit after the conversation: the user chooses; nothing is dropped
    on their behalf. Dismisses with "turns", "summary", "anyway" or "cancel"."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("t", "choose('turns')", "Last turns"),
        Binding("s", "choose('summary')", "Summary"),
        Binding("a", "choose('anyway')", "Send anyway"),
        Binding("escape,c", "choose('cancel')", "Cancel"),
    ]

    def __init__(self, prompt_tokens: int, n_ctx: int, reserve: int) -> None:
        super().__init__(classes="dialog-screen")
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx
        self.reserve = reserve

    def compose(self) -> ComposeResult:
        fits = self.prompt_tokens < self.n_ctx
        room = max(0, self.n_ctx - self.prompt_tokens)
        text = (
            f"This chat and your message come to {self.prompt_tokens} tokens; the context window "
            f"holds {self.n_ctx}"
            + (f", leaving {room} for the reply." if fits else ".")
            + " Nothing has been dropped. How do you want to go on?"
        )
        with Vertical(classes="dialog"):
            yield Static(text, markup=False, classes="dialog-text")
            yield Button("New chat with the last turns (t)", id="turns", variant="primary")
            yield Button("New chat with a summary of this one (s)", id="summary")
            if fits:
                yield Button("Send here anyway; the reply may be cut short (a)", id="anyway")
            yield Button("Cancel: keep editing the message (c)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#turns", Button).focus()

    def action_choose(self, choice: str) -> None:
        if choice == "anyway" and self.prompt_tokens >= self.n_ctx:
            return
        self.dismiss(choice)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(str(event.button.id))
