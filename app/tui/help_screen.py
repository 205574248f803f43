"""The help screen (F1 or ?): every key of the chat, read from the bindings themselves so the
list cannot drift from what the keys do."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

KEY_NAMES = {
    "left": "←", "right": "→", "up": "↑", "down": "↓", "escape": "Esc", "enter": "Enter",
    "delete": "Delete", "question_mark": "?", "shift+enter": "Shift+Enter",
}

Section = tuple[str, list[tuple[str, str]]]


def key_label(keys: str) -> str:
    """'ctrl+n' -> 'Ctrl+N', 'left,[' -> '← [', 'f1,question_mark' -> 'F1 ?'."""
    out = []
    for key in keys.split(","):
        key = key.strip()
        if key in KEY_NAMES:
            out.append(KEY_NAMES[key])
        elif key.startswith("ctrl+"):
            rest = key[5:]
            out.append("Ctrl+" + KEY_NAMES.get(rest, rest.upper()))
        elif len(key) <= 3 and key.startswith("f") and key[1:].isdigit():
            out.append(key.upper())
        else:
            out.append(key.upper() if len(key) == 1 and key.isalpha() else key)
    return " ".join(out)


def rows_of(bindings: Iterable[BindingType]) -> list[tuple[str, str]]:
    rows = []
    for b in bindings:
        if isinstance(b, Binding) and b.description:
            rows.append((key_label(b.key), b.tooltip or b.description))
    return rows


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,question_mark,q", "close", "Close")]

    def __init__(self, sections: Sequence[Section]) -> None:
        super().__init__(classes="dialog-screen")
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog", id="help"):
            yield Label("llmlocal chat: keys", classes="dialog-title")
            for title, rows in self.sections:
                table = Table.grid(padding=(0, 2))
                table.add_column(style="bold", no_wrap=True, width=20)
                table.add_column()
                for key, what in rows:
                    table.add_row(key, what)
                yield Static(Text(title, style="underline"), classes="help-section")
                yield Static(table)
            yield Static(Text("\nEsc closes this screen and any dialog.", style="dim"))

    def action_close(self) -> None:
        self.dismiss(None)
