"""`Engine`: the one API between the app and every backend.

    engine = Engine.load(Plan(model="smollm2-135m"))
    for event in engine.generate(Request.chat([{"role": "user", "content": "Hi"}])):
        ...  # TokenEvent(text, token_ids) ... DoneEvent(text, finish_reason, stats)

The engine renders chat messages with the model's template, checks the prompt fits the
context window, tracks cancellation per request, and delegates the rest to the backend.
`generate` may be called from several threads; a backend that cannot batch serves the
requests one at a time.

With ``Plan.endpoint`` the backend is a remote OpenAI-compatible server (`remote`): no local
model is resolved or loaded, and the server renders and counts prompts. The engine asks its
backend for both either way (`backends.base`); `exact_token_counts` tells the app when
`count_tokens` is an estimate, and `n_ctx` is None when the server does not report its
context window.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmlocal.models import ResolvedModel, resolve
from llmlocal.models.errors import ContextOverflowError, LLMLocalError
from llmlocal.native.cpu import runtime as sparse_int4_runtime
from llmlocal.native.cpu.packed_cache import PackedCache

from .backends.base import Backend, Prompt
from .model.gguf_parts import save_packing, start_packing
from .plan import DEFAULT_MAX_CTX, Plan
from .planning.hardware import simd_features
from .planning.native_support import paged_pays, sparse_pays
from .prompt.chat_template import ChatTemplate, fallback_template, template_source
from .prompt.tokenizer import start_tokenizer
from .types import Event, Message, Request

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Self


class Engine:
    def __init__(self, backend: Backend, model: ResolvedModel, plan: Plan) -> None:
        self.backend = backend
        self.model = model
        self.plan = plan
        spec = model.spec
        # a model without a template: the format its vocabulary's turn markers belong to
        self.fallback_template = "chatml" if spec.chat_template else fallback_template(spec.tokens)
        source, self.template_origin = template_source(plan.chat_template, spec.chat_template, self.fallback_template)
        self.template = ChatTemplate(source, bos_token=spec.special.bos or "", eos_token=spec.special.eos or "")
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, plan: Plan | None = None) -> Engine:
        """Load the plan's model (resolved already where the plan was made, else resolved here)
        in the plan's backend (or, with an endpoint, connect to the server; ``plan.model`` then
        names one of the server's models)."""
        plan = plan or Plan()
        if plan.endpoint is not None or plan.backend == "remote":
            from .backends.remote import RemoteBackend

            remote = RemoteBackend.connect(plan)
            return cls(remote, remote.model, plan.replace(backend="remote", model=remote.model.name, n_ctx=remote.n_ctx))
        model = plan.resolved if plan.resolved is not None else resolve(plan.model)
        n_ctx = plan.n_ctx or min(model.spec.context_length, DEFAULT_MAX_CTX)
        plan = plan.replace(n_ctx=n_ctx)
        backend_name = plan.backend if plan.backend != "auto" else _auto_backend(model, plan)
        if backend_name == "llamacpp":
            from .backends.llamacpp import LlamaCppBackend

            backend: Backend = LlamaCppBackend.load(model, plan)
        elif backend_name in ("paged", "sparse"):
            # our engines tokenize themselves: the vocabulary loads while torch is imported, and
            # on the CPU the weights are packed for the kernels meanwhile
            tokenizer = start_tokenizer(model.path, model.spec.format == "gguf")
            dense_cpu = backend_name == "paged" and plan.weights == "auto" and not _on_gpu(plan)
            packed = PackedCache(Path(plan.packed_cache_dir), plan.packed_cache_size) if plan.packed_cache_dir else None
            ahead = start_packing(model.spec, packed) if dense_cpu else None
            try:
                with _no_gc():
                    if backend_name == "paged":
                        from .backends.paged import PagedBackend as Ours
                    else:
                        from .backends.sparse import SparseBackend as Ours
                    backend = Ours.load(model, plan, tokenizer=tokenizer, ahead=ahead)
                if ahead is not None and packed is not None:
                    save_packing(ahead, model.spec, packed)  # the next load maps what this one packed
            finally:
                if ahead is not None:
                    ahead.close()
        else:  # Plan validates the name; a new backend must be wired in here.
            raise LLMLocalError(f"The backend '{backend_name}' is not available in this build.")
        return cls(backend, model, plan.replace(backend=backend_name))

    def close(self) -> None:
        self.cancel()
        self.backend.close()
        if self.backend.name in ("paged", "sparse"):
            gc.unfreeze()  # what `_no_gc` froze at load, this model's objects among it

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- facts ---------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int | None:
        """Context window in tokens; None only for a remote server that does not report it."""
        return self.backend.n_ctx

    @property
    def exact_token_counts(self) -> bool:
        """False when `count_tokens` estimates (a remote server that cannot tokenize chats)."""
        return self.backend.exact_token_counts

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def device(self) -> str:
        return self.backend.device

    # ---- prompts -------------------------------------------------------------------------
    @property
    def template_notice(self) -> str | None:
        """A sentence for the user when chats are rendered with a fallback template."""
        if self.backend.renders_prompts or self.plan.chat_template is not None or self.model.spec.chat_template:
            return None
        if self.fallback_template == "chatml":
            return f"{self.model.name} carries no chat template, so chats are rendered as ChatML: choose another with --chat-template."
        return (f"{self.model.name} carries no chat template, so chats are rendered in the {self.fallback_template} format "
                "its special tokens belong to: choose another with --chat-template.")
    def render(self, messages: Sequence[Message | Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text the model sees for a conversation (generation prompt appended);
        ``tools`` (OpenAI's tool list) through the model's template, or described in the system
        message when the template knows no tools."""
        return self.backend.render(self.template, [Message.coerce(m) for m in messages], tools)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special=add_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (what a reply's logprobs name)."""
        return self.backend.token_bytes(token_id)

    def prompt_ids(self, request: Request) -> list[int]:
        prompt = self._prompt(request)
        if not prompt.exact:
            raise LLMLocalError(f"The server at {self.model.path} applies its chat template without showing it: "
                                "exact prompt tokens are not available.")
        return prompt.ids

    def count_tokens(self, messages: Sequence[Message | Mapping[str, str]]) -> int:
        """Prompt tokens of a conversation: what the app compares with `n_ctx` (see
        `exact_token_counts`)."""
        return self._prompt(Request.chat(messages)).tokens

    def _prompt(self, request: Request) -> Prompt:
        return self.backend.prompt(request, self.template, self.model.spec.special.bos)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: Request) -> Iterator[Event]:
        """Stream events for ``request``. Raises `ContextOverflowError` before streaming if the
        prompt leaves no room for a reply, and `LLMLocalError` if its grammar does not compile."""
        self.backend.check(request)
        prompt = self._prompt(request)
        # an estimate (a server that cannot count this prompt) is left to the server to judge
        if prompt.exact and self.n_ctx is not None and prompt.tokens >= self.n_ctx:
            window = "the server's context window" if self.backend.renders_prompts else "the context window"
            raise ContextOverflowError(f"The prompt is {prompt.tokens} tokens but {window} is {self.n_ctx}: "
                                       f"{self._shorter(prompt.tokens)}.")
        cancel = self._register(request)
        return self._stream(request, lambda: self.backend.generate(request, prompt, cancel))

    def prefill(self, request: Request, cancel: threading.Event | None = None) -> int:
        """Compute ``request``'s prompt ahead of time, so that a request whose prompt starts the
        same way later prefills only what follows (the paged engine's prefix cache, llama.cpp's
        context): what a chat does with the message being typed. Blocks until done or cancelled
        (`cancel` with the request's id, or setting ``cancel``, which may be set before the
        call); returns the tokens computed (0 for a remote server, which caches by itself, or a
        prompt that leaves no room for a reply)."""
        self.backend.check(request)
        prompt = self._prompt(request)
        if not prompt.exact or (self.n_ctx is not None and prompt.tokens >= self.n_ctx):
            return 0
        cancel = self._register(request, cancel)
        try:
            return self.backend.prefill(request, prompt, cancel)
        finally:
            self._unregister(request)

    def _shorter(self, tokens: int) -> str:
        """How to fit a prompt of ``tokens`` that overflows the context window."""
        maximum = self.model.spec.context_length
        if self.backend.renders_prompts:
            return "shorten it or start a new chat"
        if self.n_ctx is not None and self.n_ctx < maximum:
            return f"shorten it or pass --ctx {min(maximum, _round_up(tokens * 2))}"
        return f"shorten it (this model's maximum is {maximum})"

    def _register(self, request: Request, cancel: threading.Event | None = None) -> threading.Event:
        cancel = cancel if cancel is not None else threading.Event()
        with self._lock:
            if request.id in self._cancels:
                raise LLMLocalError(f"Request id {request.id} is already running: use a new id.")
            self._cancels[request.id] = cancel
        return cancel

    def _stream(self, request: Request, events: Callable[[], Iterator[Event]]) -> Iterator[Event]:
        try:
            yield from events()
        finally:
            self._unregister(request)

    def _unregister(self, request: Request) -> None:
        with self._lock:
            self._cancels.pop(request.id, None)

    def cancel(self, request_id: str | None = None) -> None:
        """Stop a running request (all of them when ``request_id`` is None) within one token."""
        with self._lock:
            targets = list(self._cancels.values()) if request_id is None else [self._cancels.get(request_id)]
        for event in targets:
            if event is not None:
                event.set()

    def score(self, token_ids: list[int]) -> list[float]:
        """Per-position log-probabilities of ``token_ids`` (len - 1 values)."""
        if self.n_ctx is not None and len(token_ids) > self.n_ctx:
            raise ContextOverflowError(
                f"Cannot score {len(token_ids)} tokens in a context window of {self.n_ctx}: score shorter windows."
            )
        return self.backend.score(token_ids)

    def log_probs(self, token_ids: list[int]) -> np.ndarray:
        """(len - 1, vocab) float32 next-token log-distributions along ``token_ids`` (teacher
        forced): what perplexity and KL-divergence evaluation compare between two models."""
        if self.n_ctx is not None and len(token_ids) > self.n_ctx:
            raise ContextOverflowError(
                f"Cannot score {len(token_ids)} tokens in a context window of {self.n_ctx}: score shorter windows."
            )
        return self.backend.log_probs(token_ids)


def _auto_backend(model: ResolvedModel, plan: Plan) -> str:
    """A Hugging Face checkpoint, or a CUDA device: our paged engine. A GGUF on the CPU: the
    sparse engine when the file carries calibrated activation sparsity where skipping pays on
    this CPU (native_support.sparse_pays, as the planner prefers; the native kernels built),
    the paged engine where its native kernels decode the file faster than
    llama.cpp on this CPU, or as fast with the prefix cache's disk tier on (as the planner
    prefers: native_support.paged_pays), else llama.cpp."""
    if model.spec.format != "gguf":
        return "paged"
    if plan.device == "cuda" or (plan.device == "auto" and _cuda_available()):
        return "paged"
    simd = simd_features()
    if model.spec.sparsity is not None and sparse_int4_runtime.built() and sparse_pays(model.spec, simd):
        return "sparse"
    if paged_pays(model.spec, simd, plan.kv_cache_dir is not None):
        return "paged"
    return "llamacpp"


@contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector off while a model loads: importing torch and building the
    model make hundreds of thousands of objects that all live on, and collections triggered by
    their count walked them again and again (a tenth of the 1.5B's load on the paged engine).
    They are then frozen out of the collector's generations (the first collection after
    loading walked them all: 90 ms, and each full one later again, a pause in a streamed
    reply); `Engine.close` gives them back, so a closed model's cycles are collected."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()  # (not after a failed load: its leftovers stay the collector's)
    finally:
        if was:
            gc.enable()


def _on_gpu(plan: Plan) -> bool:
    """Whether our engine would run the plan on a GPU (`paged_setup.pick_device`)."""
    return plan.device == "cuda" or (plan.device == "auto" and _cuda_available())


def _cuda_available() -> bool:
    # Only consult torch if it is already imported or CUDA libraries may exist: importing
    # torch costs a second, which CPU-only runs of llama.cpp should not pay.
    import importlib.util
    import os

    if importlib.util.find_spec("torch") is None:
        return False
    if not (os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia")):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _round_up(n: int, to: int = 1024) -> int:
    return (n + to - 1) // to * to
