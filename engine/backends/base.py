"""What every backend implements; the `Engine` wraps one of these.

The engine asks its backend for everything that differs between running the model here and
asking a server: how a conversation becomes prompt text (`render`), what the prompt is in
tokens and whether that count is exact (`prompt`), which request fields it can honour
(`check`), then streams the reply to that `Prompt` (`generate`). `LocalBackend` holds the
shared answers of the backends that run the model in this process (llama.cpp, paged,
sparse): the engine's chat template renders, the backend's own tokenizer counts exactly,
every field is honoured. The remote backend gives its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..prompt.chat_template import ChatTemplate

from ..prompt.grammar import check_grammar
from ..types import DoneEvent, Event, Message, Request


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as its backend runs it."""

    ids: list[int]  # its token ids ([] where a server tokenizes it and cannot show them)
    tokens: int  # its length in tokens
    exact: bool = True  # False: ``tokens`` is an estimate (a server that cannot count this prompt)


class Backend(Protocol):
    name: str  # "llamacpp", "paged", ...
    device: str  # "cpu", "cuda:0", ... (a remote server: its address)
    n_ctx: int | None  # context window in tokens (None: a server that does not say)
    renders_prompts: bool  # True: prompts are rendered by the backend (a server's template), not the engine's
    exact_token_counts: bool  # False: `prompt` may estimate a chat's length

    def check(self, request: Request) -> None:
        """Raise `LLMLocalError` (one sentence with the fix) for a field the backend cannot honour."""
        ...

    def render(self, template: ChatTemplate, messages: Sequence[Message],
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of a conversation, generation prompt appended; ``template``: the engine's."""
        ...

    def prompt(self, request: Request, template: ChatTemplate, bos: str | None) -> Prompt:
        """The request's prompt in tokens; ``bos``: the model's BOS text, if it wants one."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS where the model wants one."""
        ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a UTF-8 character may be split across tokens)."""
        ...

    def generate(self, request: Request, prompt: Prompt, cancel: threading.Event) -> Iterator[Event]:
        """Stream the reply to ``prompt``; stop within one token once ``cancel`` is set.

        The last event is a `DoneEvent`. The backend may assume an exact prompt is shorter than
        ``n_ctx``.
        """
        ...

    def prefill(self, request: Request, prompt: Prompt, cancel: threading.Event) -> int:
        """Compute ``prompt``'s K/V into the backend's prefix cache ahead of a request that will
        start with it; stop within one step once ``cancel`` is set. Returns the tokens computed
        (0 where the backend keeps no prefix: a server's)."""
        ...

    def log_probs(self, token_ids: list[int]) -> np.ndarray:
        """(len(token_ids) - 1, vocab) float32 log-softmax; row i is the distribution of the
        token after ``token_ids[: i + 1]``."""
        ...

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 (so len(token_ids) - 1 values)."""
        ...

    def close(self) -> None: ...


class LocalBackend:
    """The `Backend` answers shared by the backends that run the model in this process."""

    renders_prompts = False
    exact_token_counts = True

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        raise NotImplementedError

    def check(self, request: Request) -> None:
        if request.sampling.grammar is not None:
            check_grammar(request.sampling.grammar)

    def render(self, template: ChatTemplate, messages: Sequence[Message],
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return template.render(list(messages), tools=tools)

    def prefill(self, request: Request, prompt: Prompt, cancel: threading.Event) -> int:
        """The prompt's K/V through a one-token greedy reply (the paged engines keep a finished
        or cancelled sequence's full blocks in their prefix cache); its token is dropped."""
        one = replace(request.sampling, max_tokens=1, temperature=0.0, n=1, grammar=None, logprobs=None, stop=())
        computed = 0
        for event in self.generate(replace(request, sampling=one), prompt, cancel):  # type: ignore[attr-defined]
            if isinstance(event, DoneEvent):
                computed = event.stats.prompt_tokens - (event.stats.cached_prompt_tokens or 0)
        return computed

    def prompt(self, request: Request, template: ChatTemplate, bos: str | None) -> Prompt:
        if request.prompt is not None:
            ids = self.tokenize(request.prompt)
        else:
            text = template.render(request.messages)
            # the template writes BOS itself when the model wants one; add it only if it did not
            ids = self.tokenize(text, add_special=not (bos and text.startswith(bos)))
        return Prompt(ids, len(ids))
