"""Constrained decoding: a request's `Grammar` as a mask over each next token's logits.

llguidance compiles the grammar against the model's vocabulary and, after every token, says
which tokens may come next (a bitmask over the vocabulary); the samplers give the others
probability zero, so the reply matches the grammar token by token and the model still picks
among what the grammar allows. A draft token the grammar forbids has probability zero under
the masked target, so speculative decoding rejects it and stays exact.

llguidance was picked over xgrammar by measurement, on the 0.5B Qwen vocabulary (151,936
tokens) with a nested JSON schema over a 47-token document: a mask in 36 us on average
(xgrammar 11 us), the schema compiled in 1.3 ms (xgrammar 110 ms, paid by every request with
a new schema), and no dependencies (xgrammar brings transformers and triton). Both masks are
well under 1% of a decode step on a CPU.

One implementation serves every backend: `paged` masks its batched sampler's rows and
computes the masks on a worker thread while the model runs; `llamacpp` masks through
llama-cpp-python's logits processor.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from llmlocal.models.errors import LLMLocalError

from ..types import Grammar


def grammar_text(grammar: Grammar) -> str:
    """The llguidance grammar for ``grammar``."""
    from llguidance import LLMatcher

    if grammar.kind == "json":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if grammar.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json.loads(grammar.spec))
    if grammar.kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.spec)
    if grammar.kind == "choice":  # a JSON string is a valid Lark string literal
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(grammar.spec)))
    return LLMatcher.grammar_from_lark(grammar.spec)


def check_grammar(grammar: Grammar) -> None:
    """Raise `LLMLocalError` naming the problem if ``grammar`` does not compile."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar_text(grammar))
    if error:
        raise LLMLocalError(f"The {grammar.kind.replace('_', ' ')} grammar does not compile ({_one_line(error)}): fix it.")


def _one_line(error: str) -> str:
    """llguidance's message without the source excerpt it draws under it."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    cause = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {cause[len('error:'):].strip()}".strip() if lines else error


class Constraint:
    """One reply's place in its grammar."""

    def __init__(self, matcher: Any, n_vocab: int, end_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._end_ids = end_ids  # end-of-generation tokens: the reply stops there, the grammar is not told
        self._words = np.empty((n_vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """(n_vocab,) bool: the tokens that may come next."""
        w = self._words
        self._matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        return np.unpackbits(w.view(np.uint8), bitorder="little")[: self._n_vocab].astype(bool)

    def allowed_through(self, drafts: Sequence[int]) -> list[np.ndarray | None]:
        """The masks of the positions of ``drafts`` and of the one after them (k + 1 rows, as a
        verification step scores), the state left as it was. Past a draft the grammar forbids,
        rows are None: verification rejects that draft, so no later row is sampled from."""
        masks: list[np.ndarray | None] = [self.allowed()]
        consumed = 0
        for token in drafts:
            if self.ends(token) or not masks[-1][token] or not self._matcher.consume_token(token):  # type: ignore[index]
                break
            consumed += 1
            masks.append(self.allowed())
        if consumed:
            self._matcher.rollback(consumed)
        return masks + [None] * (len(drafts) + 1 - len(masks))

    def ends(self, token: int) -> bool:
        """``token`` ends the reply (an end-of-generation token the grammar allowed)."""
        return token in self._end_ids

    def advance(self, token: int) -> None:
        """The reply goes on with ``token`` (one the last mask allowed). An end-of-generation
        token is not passed on: the reply stops there, and llguidance cannot take one back."""
        if self.ends(token):
            return
        if not self._matcher.consume_token(token):
            raise AssertionError(f"token {token} was sampled outside the grammar: {self._matcher.get_error()}")

    def rollback(self, count: int) -> None:
        """Take back the last ``count`` tokens (drafts that were only proposed)."""
        if count and not self._matcher.rollback(count):
            raise AssertionError(f"the grammar could not take back {count} tokens: {self._matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """The reply so far is complete under the grammar."""
        return bool(self._matcher.is_accepting())


class TokenMasks:
    """A model's vocabulary as llguidance sees it, built on first use (about a second for
    150k tokens) and kept for the model's lifetime."""

    def __init__(self, build: Callable[[], Any], n_vocab: int, eog_ids: Sequence[int]) -> None:
        self._build = build
        self._end_ids = frozenset(eog_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self.n_vocab = n_vocab

    @classmethod
    def for_llama_vocab(cls, vocab: Any, n_vocab: int, eog_ids: Sequence[int]) -> TokenMasks:
        """From a llama.cpp vocabulary (`llama_model.vocab`); rows past its tokens are never allowed."""

        def build() -> Any:
            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it reads token attributes through a deprecated name
                warnings.simplefilter("ignore", DeprecationWarning)
                return lltokenizer_from_vocab(vocab, n_vocab=n_vocab, eos_token=sorted(eog_ids))

        return cls(build, n_vocab, eog_ids)

    @classmethod
    def for_hf_tokenizer(cls, tokenizer_json: str, n_vocab: int, eog_ids: Sequence[int]) -> TokenMasks:
        """From a Hugging Face `tokenizer.json` (its text)."""

        def build() -> Any:
            from llguidance import LLTokenizer

            return LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=sorted(eog_ids))

        return cls(build, n_vocab, eog_ids)

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build()
            return self._tokenizer

    def constraint(self, grammar: Grammar) -> Constraint:
        """A new reply under ``grammar``; `LLMLocalError` if the grammar does not compile."""
        from llguidance import LLMatcher

        check_grammar(grammar)
        matcher = LLMatcher(self._lltokenizer(), grammar_text(grammar))
        if matcher.is_error():
            raise LLMLocalError(
                f"The {grammar.kind.replace('_', ' ')} grammar does not compile ({_one_line(matcher.get_error())}): fix it."
            )
        return Constraint(matcher, self.n_vocab, self._end_ids)


def mask_logits(logits: Any, allowed: np.ndarray) -> None:
    """Give the tokens ``allowed`` leaves out logit -inf, in place (a (V,) torch row)."""
    import torch

    with torch.inference_mode():  # the engines' logits are inference tensors
        keep = torch.from_numpy(allowed).to(logits.device)
        logits.masked_fill_(~keep, float("-inf"))
