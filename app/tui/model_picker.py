"""The model picker: the models in the local store, and the plan the loaded one runs with.

The app lists the store in a worker and hands the rows over (`show_models`); the picker
dismisses with the name to load (a row, or any name or path typed below the table), or None.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label, LoadingIndicator, Static

if TYPE_CHECKING:
    from llmlocal.engine import Plan

HIDDEN_PLAN_FIELDS = ("model", "api_key", "resolved")  # the model is the title; a key is never shown
ALWAYS_SHOWN = ("backend", "device", "n_ctx")


def plan_summary(plan: Plan) -> list[tuple[str, str]]:
    """(field, value) of the plan: backend, device and n_ctx, then every field the planner
    or the user set away from its default (new Plan fields appear without code here)."""
    from llmlocal.engine import Plan

    defaults = Plan()
    rows = []
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if f.name in HIDDEN_PLAN_FIELDS or value is None:
            continue
        if f.name in ALWAYS_SHOWN or value != getattr(defaults, f.name):
            rows.append((f.name, str(value)))
    rows.sort(key=lambda r: (r[0] not in ALWAYS_SHOWN, ALWAYS_SHOWN.index(r[0]) if r[0] in ALWAYS_SHOWN else 0))
    return rows


def human_size(n: int | None) -> str:
    if n is None:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class ModelPicker(ModalScreen["str | None"]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Close")]

    def __init__(self, current: str | None, plan: Plan | None, device: str | None = None) -> None:
        """``plan``: what the loaded model runs with; ``device``: where it actually runs
        (the plan may say "auto")."""
        super().__init__(classes="dialog-screen")
        self.current = current
        self.plan = plan
        self.device = device
        self.names: list[str] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="model-picker"):
            yield Label("Models", classes="dialog-title")
            yield Static(self._plan_text(), id="picker-plan")
            yield LoadingIndicator(id="picker-loading")
            table: DataTable[Any] = DataTable(id="picker-table", cursor_type="row", zebra_stripes=True)
            table.display = False
            yield table
            yield Static("", id="picker-error", markup=False)
            yield Input(placeholder="or type a model name or a path to a .gguf file, then Enter", id="picker-name")

    def _plan_text(self) -> Text:
        if self.plan is None:
            return Text("No model loaded yet.", style="dim")
        text = Text("Loaded: ", style="dim")
        text.append(self.current or "?", style="bold")
        for name, value in plan_summary(self.plan):
            if name == "device" and self.device:
                value = self.device
            text.append(f"  {name} ", style="dim")
            text.append(value)
        return text

    def show_models(self, models: list[Any], error: str | None = None) -> None:
        """Fill the table with `StoredModel` rows (name, path, size_bytes, quant, arch,
        context_length, source)."""
        self.query_one("#picker-loading").display = False
        if error:
            self.query_one("#picker-error", Static).update(error)
        table = self.query_one("#picker-table", DataTable)
        table.clear(columns=True)
        table.add_columns("", "model", "size", "quant", "arch", "context", "source")
        self.names = []
        for m in models:
            mark = "●" if m.name == self.current else ""
            ctx = str(m.context_length) if m.context_length else ""
            table.add_row(mark, m.name, human_size(m.size_bytes), m.quant or "", m.arch or "", ctx, m.source or "")
            self.names.append(m.name)
        table.display = bool(models)
        if models:
            if self.current in self.names:
                table.move_cursor(row=self.names.index(self.current))
            table.focus()
        else:
            self.query_one("#picker-name", Input).focus()

    @on(DataTable.RowSelected, "#picker-table")
    def _row(self, event: DataTable.RowSelected) -> None:
        self.dismiss(self.names[event.cursor_row])

    @on(Input.Submitted, "#picker-name")
    def _typed(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
