"""Backend `llamacpp`: dense GGUF inference through llama-cpp-python.

llama.cpp holds one sequence in its KV cache. Requests are served one at a time (a lock);
consecutive requests that share a prefix — the turns of one chat — reuse the cached KV of
that prefix, which `Llama.generate` finds by comparing token ids.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from typing import Any, Iterator

import numpy as np
from llmlocal.models import ResolvedModel
from llmlocal.models.errors import LLMLocalError, ModelFormatError

from ..core.stats import StatsRecorder
from ..plan import Plan
from ..planning.hardware import physical_cores
from ..planning.memory_model import llamacpp_flash_attn
from ..prompt.detokenize import TextStream
from ..prompt.grammar import Constraint, TokenMasks
from ..types import DoneEvent, Event, FinishReason, Request, TokenEvent, TokenLogprob
from .base import LocalBackend, Prompt

_params_lock = threading.Lock()


@contextlib.contextmanager
def llama_model_params(**fields: Any) -> Iterator[None]:
    """Set model parameters that `llama_cpp.Llama` has no argument for, on the defaults it
    starts from while it loads."""
    import llama_cpp.llama_cpp as c

    if not fields:
        yield
        return
    with _params_lock:
        default = c.llama_model_default_params

        def params() -> Any:
            p = default()
            for name, value in fields.items():
                setattr(p, name, value)
            return p

        c.llama_model_default_params = params
        try:
            yield
        finally:
            c.llama_model_default_params = default


def cpu_model_params() -> dict[str, Any]:
    """Model parameters that keep llama.cpp from crashing on this CPU.

    On CPUs with AMX, llama.cpp's AMX matmul (an "extra buffer type") segfaults on batched
    prompt evaluation of 4-bit weights (seen with llama-cpp-python 0.3.36 on a Sapphire
    Rapids host); without extra buffer types it uses its ordinary CPU kernels, which also
    forgoes its weight repacking. LLMLOCAL_LLAMACPP_EXTRA_BUFTS=1 keeps them (to measure
    llama.cpp's decode at its own default there: one-token steps do not crash)."""
    if os.environ.get("LLMLOCAL_LLAMACPP_EXTRA_BUFTS", "").strip() == "1":
        return {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return {}
    return {"use_extra_bufts": False} if " amx_tile" in flags else {}


def open_llama(**kwargs: Any) -> Any:
    """`llama_cpp.Llama(**kwargs)` with the model parameters this CPU needs (`cpu_model_params`);
    every full model llmlocal or its tests load through llama.cpp is opened here."""
    import llama_cpp

    with llama_model_params(**cpu_model_params()):
        return llama_cpp.Llama(**kwargs)


# KV cache element types llama.cpp is given (ggml type ids); the memory planner counts them.
GGML_KV_TYPES = {"f16": 1, "q8_0": 8}


class LlamaCppBackend(LocalBackend):
    name = "llamacpp"

    def __init__(self, llm: Any, model: ResolvedModel, n_ctx: int, device: str) -> None:
        self._llm = llm
        self._model = model
        self.n_ctx = n_ctx
        self.device = device
        self._lock = threading.Lock()  # one request at a time: llama.cpp holds one sequence
        self._token_masks: TokenMasks | None = None  # built on the first request with a grammar

    @classmethod
    def load(cls, model: ResolvedModel, plan: Plan) -> LlamaCppBackend:
        import llama_cpp

        if model.spec.format != "gguf":
            raise ModelFormatError(
                f"llama.cpp runs GGUF files and {model.path} is a Hugging Face checkpoint: use "
                f"--backend paged, or convert it with `llmlocal quantize {model.path}`."
            )
        n_ctx = plan.n_ctx or model.spec.context_length
        threads = plan.threads or physical_cores()
        gpu_layers = plan.gpu_layers if plan.device != "cpu" else 0
        kv = "f16" if plan.kv_dtype == "auto" else plan.kv_dtype
        if kv not in GGML_KV_TYPES:
            raise LLMLocalError(f"The llamacpp backend keeps its KV cache in f16 or q8_0, not {kv}: pass --kv-dtype f16 or q8_0.")
        try:
            llm = open_llama(
                model_path=model.path,
                n_ctx=n_ctx,
                n_batch=min(plan.n_batch, n_ctx),
                n_ubatch=min(plan.n_batch, n_ctx),
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=gpu_layers,
                type_k=GGML_KV_TYPES[kv],
                type_v=GGML_KV_TYPES[kv],
                flash_attn=llamacpp_flash_attn(kv),
                verbose=False,
            )
        except (ValueError, RuntimeError) as e:
            raise ModelFormatError(
                f"llama.cpp could not load {model.path} (architecture '{model.spec.architecture}'): "
                "this llama.cpp build may not support it; use another model or upgrade llama-cpp-python."
            ) from e
        on_gpu = gpu_layers > 0 and bool(llama_cpp.llama_supports_gpu_offload())
        return cls(llm, model, n_ctx, "cuda" if on_gpu else "cpu")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._llm.close()

    # ---- tokens --------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        # special=True: control tokens written by the chat template (<|im_start|>) are parsed
        # as the single tokens they are, not as text.
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    def detokenize(self, token_ids: list[int]) -> str:
        return self._llm.detokenize(token_ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self._llm.detokenize([token_id]))

    def _is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._llm._model.vocab, token))

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: Request, prompt: Prompt, cancel: threading.Event) -> Iterator[Event]:
        prompt_ids = prompt.ids
        recorder = StatsRecorder(self.name, self.device)
        with self._lock:
            # n samples one after another; after the first, the prompt's KV is cached.
            for index in range(request.sampling.n):
                yield from self._generate_locked(request, prompt_ids, cancel, recorder, index)
                recorder = StatsRecorder(self.name, self.device)

    def _generate_locked(
        self, request: Request, prompt_ids: list[int], cancel: threading.Event, recorder: StatsRecorder, index: int
    ) -> Iterator[Event]:
        llm = self._llm
        p = request.sampling
        cached, _ = self._prefill_all_but_last(prompt_ids)
        llm.set_seed(p.seed + index if p.seed is not None else random.getrandbits(31))
        llm.last_n_tokens_size = p.repeat_last_n

        text = TextStream(p.stop)
        constraint = self._grammar_masks().constraint(p.grammar) if p.grammar is not None else None
        step = _StepLogits(constraint, keep=p.logprobs is not None)
        completion: list[int] = []
        kept: tuple[TokenLogprob, ...] = ()
        finish: FinishReason = "cancelled" if cancel.is_set() else "stop"
        room = self.n_ctx - len(prompt_ids)  # tokens that fit after the prompt
        tokens = llm.generate(
            prompt_ids,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            temp=p.temperature,
            repeat_penalty=p.repeat_penalty,
            reset=True,
            logits_processor=[step] if step.active else None,
        )
        try:
            while not cancel.is_set():
                token = next(tokens, None)
                if token is None or (self._is_eog(token) and not p.ignore_eos):
                    finish = "stop"
                    break
                if constraint is not None:
                    constraint.advance(token)
                completion.append(token)
                recorder.token()
                piece = text.feed(llm.detokenize([token], prev_tokens=None))
                logprobs = step.logprobs(token, p.logprobs)
                kept += logprobs
                yield TokenEvent(piece, (token,), index, logprobs)
                if text.stopped:
                    finish = "stop"
                    break
                if p.max_tokens is not None and len(completion) >= p.max_tokens:
                    finish = "length"
                    break
                if len(completion) >= room:
                    finish = "context"
                    break
            else:
                finish = "cancelled"
        finally:
            tokens.close()
        tail = text.flush()
        if tail:
            yield TokenEvent(tail, (), index)
        stats = recorder.finish(len(prompt_ids), cached_prompt_tokens=cached, n_ctx=self.n_ctx)
        yield DoneEvent(text.text, finish, stats, index, kept)

    def prefill(self, request: Request, prompt: Prompt, cancel: threading.Event) -> int:
        """The prompt's K/V into the context, all but its last token (which a request evaluates
        on its own, `_prefill_all_but_last`): a request starting with it reuses them. Evaluated
        n_batch tokens at a time, ``cancel`` looked at between them: a draft that was replaced
        does not hold up the next request for its whole length."""
        with self._lock:
            if cancel.is_set():
                return 0
            cached, done = self._prefill_all_but_last(prompt.ids, cancel)
            return done - cached

    def _grammar_masks(self) -> TokenMasks:
        if self._token_masks is None:
            vocab = self._llm._model.vocab
            eog = [t for t in range(self._llm.n_vocab()) if self._is_eog(t)]
            self._token_masks = TokenMasks.for_llama_vocab(vocab, self._llm.n_vocab(), eog)
        return self._token_masks

    def _prefill_all_but_last(self, prompt_ids: list[int], stop: threading.Event | None = None) -> tuple[int, int]:
        """Bring the KV cache to ``prompt_ids[:-1]``, reusing its longest cached prefix, n_batch
        tokens at a time (as `eval` splits them anyway), ``stop`` looked at between them.

        Returns (how many prompt tokens came from the cache, how many the context holds now).
        The last prompt token is always evaluated on its own (by `Llama.generate`), whether the
        rest was cached or not:
        llama.cpp's kernels round differently for a one-token batch than for a long one, so
        evaluating it the same way every time is what keeps greedy decoding of a repeated
        request identical, cold or cached.
        """
        llm = self._llm
        cached = min(_common_prefix(llm._input_ids.tolist(), prompt_ids), len(prompt_ids) - 1)
        if cached == 0:
            llm.reset()
        llm.n_tokens = done = cached  # eval() drops the KV cache past n_tokens before appending
        end = len(prompt_ids) - 1
        while done < end and not (stop is not None and stop.is_set()):
            llm.eval(prompt_ids[done : min(end, done + llm.n_batch)])
            done = min(end, done + llm.n_batch)
        return cached, done

    # ---- scoring ----------------------------------------------------------------------
    def log_probs(self, token_ids: list[int]) -> np.ndarray:
        """(len - 1, vocab) float32: log-softmax of the next-token distribution after each prefix.

        One teacher-forced pass in batches of n_batch, logits kept for every position.
        """
        import llama_cpp

        llm = self._llm
        n_vocab = llm.n_vocab()
        out = np.empty((max(len(token_ids) - 1, 0), n_vocab), dtype=np.float32)
        if len(token_ids) < 2:
            return out
        with self._lock:
            llm.reset()
            llm._ctx.kv_cache_clear()
            try:
                for start in range(0, len(token_ids) - 1, llm.n_batch):
                    chunk = token_ids[start : min(start + llm.n_batch, len(token_ids) - 1)]
                    llm._batch.set_batch(batch=chunk, n_past=start, logits_all=True)
                    llm._ctx.decode(llm._batch)
                    logits = np.ctypeslib.as_array(
                        llama_cpp.llama_get_logits(llm._ctx.ctx), shape=(len(chunk) * n_vocab,)
                    ).reshape(len(chunk), n_vocab)  # (chunk, vocab): row i predicts token start + i + 1
                    rows = logits.astype(np.float64)
                    out[start : start + len(chunk)] = rows - _logsumexp(rows)
            finally:
                # The KV cache now holds the scored text, not a chat: forget it.
                llm.reset()
                llm._ctx.kv_cache_clear()
        return out

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1."""
        if len(token_ids) < 2:
            return []
        lp = self.log_probs(token_ids)
        return lp[np.arange(len(token_ids) - 1), token_ids[1:]].astype(np.float64).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _logsumexp(x: np.ndarray) -> np.ndarray:
    # (rows, vocab) -> (rows, 1)
    m = x.max(axis=1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))


class _StepLogits:
    """llama-cpp-python's logits processor, called with each next token's logits (in token id
    order, before its samplers): applies the grammar's mask, and keeps the logits for the
    token's logprobs. The caller advances ``constraint`` with each token it takes."""

    def __init__(self, constraint: Constraint | None, keep: bool) -> None:
        self.constraint, self.keep = constraint, keep
        self.active = constraint is not None or keep
        self.last: np.ndarray | None = None

    def __call__(self, _input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.keep:
            self.last = np.array(scores, dtype=np.float32)
        if self.constraint is None:
            return scores
        return np.where(self.constraint.allowed(), scores, np.float32(-np.inf)).astype(np.float32, copy=False)

    def logprobs(self, token: int, top: int | None) -> tuple[TokenLogprob, ...]:
        if top is None or self.last is None:
            return ()
        import torch

        from ..core.sampling import token_logprobs

        return tuple(token_logprobs(torch.from_numpy(self.last).view(1, -1), [token], top))
