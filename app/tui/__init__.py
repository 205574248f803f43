"""The chat TUI (Textual). Widgets render and post messages; workers call the engine."""

from .chat_app import ChatApp

__all__ = ["ChatApp"]
