"""The chat TUI (Textual). Widgets render and post messages; the app reads and writes the
conversation store; thread workers call the engine."""

from .chat_app import ChatApp

__all__ = ["ChatApp"]
