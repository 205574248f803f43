"""The chat settings panel: the system prompt, sampling parameters and reply format of one chat.

Values are checked by building the `SamplingParams` they describe, and a JSON schema by
compiling it; an invalid one keeps the panel open with the reason shown (nothing is saved).
Ctrl+S saves, Esc leaves without saving.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from llmlocal.models.errors import LLMLocalError
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, TextArea

from .settings import EDITABLE, FORMAT_NAMES, ChatSettings, ReplyFormat

OPTIONAL = ("max_tokens", "seed")  # blank means None: no cap, a random seed
INTEGERS = ("top_k", "max_tokens", "seed")
HINTS = {
    "temperature": "0 is greedy",
    "top_k": "0 disables",
    "top_p": "1 disables",
    "min_p": "0 disables",
    "repeat_penalty": "1 disables",
    "max_tokens": "blank: until the model stops",
    "seed": "blank: random",
}


class ChatSettingsScreen(ModalScreen["ChatSettings | None"]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Save", priority=True),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, settings: ChatSettings, title: str) -> None:
        super().__init__(classes="dialog-screen")
        self.settings = settings
        self.chat_title = title

    def compose(self) -> ComposeResult:
        sampling = self.settings.sampling
        with Vertical(classes="dialog", id="settings-panel"):
            yield Label(f"Settings of “{self.chat_title}”", classes="dialog-title")
            with VerticalScroll(id="settings-fields"):
                yield Label("System prompt")
                yield TextArea(self.settings.system_prompt or "", id="system-prompt", soft_wrap=True)
                for name in EDITABLE:
                    value = getattr(sampling, name)
                    with Horizontal(classes="setting-row"):
                        yield Label(name.replace("_", " "), classes="setting-name")
                        yield Input(
                            "" if value is None else str(value),
                            id=f"set-{name}",
                            type="integer" if name in INTEGERS else "number",
                            classes="setting-input",
                        )
                        yield Label(HINTS[name], classes="setting-hint")
                fmt = self.settings.reply_format
                with Horizontal(classes="setting-row"):
                    yield Label("reply format", classes="setting-name")
                    yield Select(
                        [(title, kind) for kind, title in FORMAT_NAMES.items()],
                        value=fmt.kind,
                        allow_blank=False,
                        id="set-reply_format",
                    )
                    yield Label("every reply is constrained to it", classes="setting-hint")
                yield Label("JSON schema: the path of a .json file, or the schema itself", id="schema-label")
                yield TextArea(fmt.schema, id="reply-schema", soft_wrap=True)
            yield Static("", id="settings-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#system-prompt", TextArea).focus()
        self._show_schema()

    @on(Select.Changed, "#set-reply_format")
    def _show_schema(self) -> None:
        shown = self.query_one("#set-reply_format", Select).value == "json_schema"
        self.query_one("#schema-label").display = shown
        self.query_one("#reply-schema").display = shown

    def read_format(self) -> ReplyFormat:
        """The reply format as chosen, its schema read and compiled (`LLMLocalError` if not)."""
        kind = self.query_one("#set-reply_format", Select).value
        fmt = ReplyFormat.typed(kind, self.query_one("#reply-schema", TextArea).text)  # type: ignore[arg-type]
        fmt.grammar(fix="check the path")
        return fmt

    def read(self) -> ChatSettings:
        """The settings as typed; raises `LLMLocalError` naming the field that is wrong."""
        values: dict[str, object] = {}
        for name in EDITABLE:
            raw = self.query_one(f"#set-{name}", Input).value.strip()
            if not raw:
                if name not in OPTIONAL:
                    raise LLMLocalError(f"{name} needs a value: {HINTS[name]}.")
                values[name] = None
                continue
            try:
                values[name] = int(raw) if name in INTEGERS else float(raw)
            except ValueError:
                raise LLMLocalError(f"{name} must be a number, not '{raw}'.") from None
        sampling = dataclasses.replace(self.settings.sampling, **values)  # validates
        system = self.query_one("#system-prompt", TextArea).text.strip() or None
        return ChatSettings(system, sampling, self.read_format())

    def action_save(self) -> None:
        try:
            settings = self.read()
        except LLMLocalError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.action_cancel()
