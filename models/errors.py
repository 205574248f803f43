"""Errors a user can cause and fix.

Every layer of llmlocal raises a subclass of :class:`LLMLocalError` for problems the user can
do something about (a missing file, a context too small, an unsupported architecture). The
message is one plain sentence that names the fix; the CLI prints it and exits with code 2.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class LLMLocalError(Exception):
    """A problem the user can fix; ``str(error)`` says how."""

    exit_code = 2


class ModelNotFoundError(LLMLocalError):
    """No model file for the given name or path."""


class ModelFormatError(LLMLocalError):
    """The file exists but is not a usable model (not GGUF, truncated, unsupported)."""


class ContextOverflowError(LLMLocalError):
    """The prompt does not fit the context window."""
