"""Helpers shared by the chat TUI tests (driven with Textual's pilot on the real model)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static

# The machine running the suite may be busy: waits are long, and nothing asserts a time.
TIMEOUT_S = 180.0


async def wait_for(pilot: Pilot[Any], condition: Callable[[], object], timeout: float = TIMEOUT_S, what: str = "") -> None:
    steps = int(timeout / 0.05)
    for _ in range(steps):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"not met in {timeout:.0f} s: {what or condition}")


async def wait_idle(pilot: Pilot[Any], timeout: float = TIMEOUT_S) -> None:
    """Until no request is in flight and the model is loaded."""
    app = pilot.app
    await wait_for(pilot, lambda: app.reply is None and app.engine is not None and app.loading is None, timeout, "idle")
    await pilot.pause(0.05)


async def type_and_send(pilot: Pilot[Any], text: str, wait: bool = True) -> None:
    """Put ``text`` in the message box (set directly: typing key by key is slow), press
    Enter, and (``wait``) wait until the reply is written."""
    app = pilot.app
    app.prompt.focus()
    app.prompt.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.prompt.text == "", what="the message to be taken")  # send() clears it
    if wait:
        await wait_idle(pilot)


def shown_text(widget: Static, width: int = 60) -> str:
    """What a Static shows, as plain text (its content rendered by Rich)."""
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content)
    return console.export_text()


def panel_text(app: Any) -> str:
    return "\n".join(shown_text(app.query_one(f"#engine-{part}", Static)) for part in ("head", "speed", "figures"))
