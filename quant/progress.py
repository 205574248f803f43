"""The progress display of quantize's phases: llmlocal's one progress style, which lives in
`llmlocal.models.progress` (where `models pull` uses it too)."""

from llmlocal.models.progress import Listener, Progress

__all__ = ["Listener", "Progress"]
