"""What every backend implements; the `Engine` wraps one of these."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    import numpy as np

from ..types import Event, Request


class Backend(Protocol):
    name: str  # "llamacpp", "paged", ...
    device: str  # "cpu", "cuda:0", ...
    n_ctx: int  # context window in tokens

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS where the model wants one."""
        ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a UTF-8 character may be split across tokens)."""
        ...

    def generate(self, request: Request, prompt_ids: list[int], cancel: threading.Event) -> Iterator[Event]:
        """Stream the reply to ``prompt_ids``; stop within one token once ``cancel`` is set.

        The last event is a `DoneEvent`. The backend may assume ``len(prompt_ids) < n_ctx``.
        """
        ...

    def log_probs(self, token_ids: list[int]) -> np.ndarray:
        """(len(token_ids) - 1, vocab) float32 log-softmax; row i is the distribution of the
        token after ``token_ids[: i + 1]``."""
        ...

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 (so len(token_ids) - 1 values)."""
        ...

    def close(self) -> None: ...
