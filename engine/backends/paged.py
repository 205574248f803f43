"""Backend `paged`: llmlocal's own PyTorch engine — block KV cache with prefix caching,
paged attention and continuous batching (the CUDA path; it runs on CPU too).

Threads: every `generate` call registers a sequence with the scheduler and then reads its
own event queue. One engine thread runs steps while any sequence is unfinished: schedule ->
run the model on the step's tokens -> sample -> push each sequence's new text to its queue.
All scheduler, block-manager and sequence state is touched only under `_lock`.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from llmlocal.models import ResolvedModel
from llmlocal.models.errors import LLMLocalError

from ..block_manager import BlockManager
from ..detokenize import TextStream
from ..model.loader import load_gguf, load_hf
from ..model_runner import ModelRunner, StepItem
from ..plan import Plan
from ..sampling import make_generator, sample_batch
from ..scheduler import RequestTooLargeError, Scheduler
from ..sequence import Sequence
from ..stats import StatsRecorder
from ..tokenizer import HFTokenizer, LlamaCppTokenizer, Tokenizer
from ..types import DoneEvent, Event, FinishReason, Request, TokenEvent

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class _Stream:
    """Per-request state, hung on `Sequence.extra`."""

    request: Request
    cancel: threading.Event
    recorder: StatsRecorder
    text: TextStream
    generator: torch.Generator | None
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # shared by a request's samples
    index: int = 0  # which of the request's n samples
    siblings: list[_Stream] = field(default_factory=list)  # samples 1..n-1, forked at the first token
    kv_blocks_used: int = 0  # pool blocks in use at this sequence's last step


class _EngineFailure:
    """Pushed to every open stream when a step raises: the consumer re-raises it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def pick_device(plan: Plan) -> torch.device:
    if plan.device == "cuda" or (plan.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LLMLocalError("--device cuda was asked for but PyTorch sees no CUDA GPU: use --device cpu.")
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(plan: Plan, device: torch.device) -> torch.dtype:
    if plan.dtype != "auto":
        return DTYPES[plan.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class PagedBackend:
    name = "paged"

    def __init__(
        self, runner: ModelRunner, tokenizer: Tokenizer, n_ctx: int, max_num_seqs: int, max_batched_tokens: int
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.device = str(runner.device)
        self.block_size = runner.block_size
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_batched_tokens, max_num_seqs),
            max_model_len=n_ctx,
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._live: dict[int, Sequence] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="llmlocal-paged", daemon=True)
        self._thread.start()

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, model: ResolvedModel, plan: Plan) -> PagedBackend:
        device = pick_device(plan)
        dtype = pick_dtype(plan, device)
        spec = model.spec
        n_ctx = plan.n_ctx or spec.context_length
        if device.type == "cpu" and plan.threads:
            torch.set_num_threads(plan.threads)
        if spec.format == "gguf":
            net = load_gguf(spec, device, dtype, plan.weights, max_position=n_ctx)
            tokenizer: Tokenizer = LlamaCppTokenizer(model.path)
        else:
            net = load_hf(model.path, device, dtype, plan.weights, max_position=n_ctx)
            tokenizer = HFTokenizer(model.path)
        block_size = plan.block_size
        # Default pool: every batch slot can hold a full context window... capped at 4 windows
        # (the planner will size this from free memory).
        num_blocks = plan.kv_blocks or -(-n_ctx // block_size) * min(plan.max_batch, 4)
        runner = ModelRunner(net, num_blocks, block_size, kv_dtype=dtype)
        return cls(runner, tokenizer, n_ctx, plan.max_batch, plan.max_batch_tokens)

    def close(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify_all()
        self._thread.join(timeout=10)
        self.tokenizer.close()

    # ---- tokens --------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special)

    def detokenize(self, token_ids: list[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: Request, prompt_ids: list[int], cancel: threading.Event) -> Iterator[Event]:
        p = request.sampling
        events: queue.SimpleQueue = queue.SimpleQueue()
        streams = [self._new_stream(request, cancel, events, i) for i in range(p.n)]
        streams[0].siblings = streams[1:]
        seq = Sequence(next(self._ids), prompt_ids, max_tokens=p.max_tokens, extra=streams[0])
        with self._work:
            try:
                self.scheduler.add(seq)
            except RequestTooLargeError as e:
                raise LLMLocalError(str(e).replace("give the KV cache more memory", "pass a larger --kv-blocks")) from None
            self._live[seq.seq_id] = seq
            self._work.notify_all()
        remaining = p.n
        try:
            while remaining:
                event = events.get()
                if isinstance(event, _EngineFailure):
                    raise event.error
                yield event
                if isinstance(event, DoneEvent):
                    remaining -= 1
        finally:
            if remaining:  # the consumer stopped reading: stop the request's sequences
                cancel.set()
                with self._work:
                    self._work.notify_all()

    def _new_stream(self, request: Request, cancel: threading.Event, events: queue.SimpleQueue, index: int) -> _Stream:
        p = request.sampling
        seed = p.seed + index if p.seed is not None else None
        return _Stream(
            request=request,
            cancel=cancel,
            recorder=StatsRecorder(self.name, self.device),
            text=TextStream(p.stop),
            generator=None if p.greedy else make_generator(seed, self.runner.device),
            events=events,
            index=index,
        )

    # ---- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._work:
                while not self._closed and not self._live:
                    self._work.wait()
                if self._closed:
                    for seq in list(self._live.values()):
                        self.scheduler.abort(seq.seq_id)
                        self._finish(seq, "cancelled")
                    return
                try:
                    self._step()
                except BaseException as e:  # a bug: tell every waiting consumer, keep serving
                    for seq in list(self._live.values()):
                        self.scheduler.abort(seq.seq_id)
                        stream: _Stream = seq.extra  # type: ignore[assignment]
                        stream.events.put(_EngineFailure(e))
                    self._live.clear()

    def _step(self) -> None:
        for seq in list(self._live.values()):
            if seq.extra.cancel.is_set():  # type: ignore[union-attr]
                self.scheduler.abort(seq.seq_id)  # frees its blocks; full ones stay cached
                self._finish(seq, "cancelled")
        if not self._live:
            return
        out = self.scheduler.schedule()
        if out.is_empty:
            return
        used = self.blocks.num_used_blocks
        self.runner.copy_blocks([(c.src, c.dst) for c in out.copies])
        items = [StepItem(s.seq, s.start, s.num_tokens, s.samples) for s in out.items]
        logits, sampled_items = self.runner.execute(items)
        streams: list[_Stream] = [it.seq.extra for it in sampled_items]  # type: ignore[misc]
        tokens = sample_batch(
            logits,
            [s.request.sampling for s in streams],
            [it.seq.token_ids for it in sampled_items],
            [s.generator for s in streams],
        )
        sampled: dict[int, int] = {}
        stopped: set[int] = set()
        forks: list[tuple[Sequence, list[tuple[_Stream, int]]]] = []
        for row, (it, stream, token) in enumerate(zip(sampled_items, streams, tokens)):
            sid = it.seq.seq_id
            sampled[sid] = token
            stream.kv_blocks_used = used
            if stream.siblings:  # n > 1: the other samples draw their first token from these logits
                draws = [
                    (sib, sample_batch(logits[row : row + 1], [sib.request.sampling], [it.seq.token_ids], [sib.generator])[0])
                    for sib in stream.siblings
                ]
                forks.append((it.seq, draws))
                stream.siblings = []
            if self._emit(stream, token):
                stopped.add(sid)
        for seq in self.scheduler.update(out, sampled, stopped):
            self._finish(seq, seq.finish_reason or "stop")
        for parent, draws in forks:
            for sib, token in draws:
                self._start_sibling(parent, sib, token)

    def _emit(self, stream: _Stream, token: int) -> bool:
        """Stream one sampled token's text; True if the sample ends here (EOG or stop string)."""
        if self.tokenizer.is_eog(token):
            return True
        stream.recorder.token()
        piece = stream.text.feed(self.tokenizer.token_bytes(token))
        stream.events.put(TokenEvent(piece, (token,), stream.index))
        return stream.text.stopped

    def _start_sibling(self, parent: Sequence, stream: _Stream, token: int) -> None:
        """Sample `stream.index` of a request continues from the parent's prompt with its own
        first token, sharing the parent's KV blocks when the parent still holds them."""
        child = parent.fork(next(self._ids))
        del child.token_ids[parent.num_prompt_tokens :]
        child.append_token(token)
        child.extra = stream
        stream.kv_blocks_used = self.blocks.num_used_blocks
        ended: FinishReason | None = None
        if self._emit(stream, token):
            ended = "stop"
        elif child.max_tokens == 1:
            ended = "length"
        elif child.num_tokens >= self.n_ctx:
            ended = "context"
        if ended is not None:
            self._finish(child, ended)
            return
        if self.scheduler.can_fork(parent) and parent.num_computed_tokens == parent.num_prompt_tokens:
            self.scheduler.fork(parent, child)
        else:  # the parent already finished or moved on: recompute (its full blocks are cached)
            self.scheduler.add(child)
        self._live[child.seq_id] = child

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Close the stream of a sequence the scheduler has already let go of."""
        stream: _Stream = seq.extra  # type: ignore[assignment]
        self._live.pop(seq.seq_id, None)
        tail = stream.text.flush()
        if tail:
            stream.events.put(TokenEvent(tail, (), stream.index))
        stats = stream.recorder.finish(
            seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            n_ctx=self.n_ctx,
            kv_blocks_used=stream.kv_blocks_used,
            kv_blocks_total=self.blocks.num_blocks,
        )
        stream.events.put(DoneEvent(stream.text.text, reason, stats, stream.index))

    # ---- scoring -------------------------------------------------------------------------
    def log_probs(self, token_ids: list[int]) -> np.ndarray:
        """(len - 1, vocab) next-token log-distributions, one teacher-forced pass in chunks."""
        if len(token_ids) < 2:
            return np.empty((0, self.runner.model.cfg.vocab_size), dtype=np.float32)
        # NOTE: scoring uses a private KV cache, never the shared pool: recomputing blocks
        # that the prefix cache shares with live sequences would break their read-only rule.
        seq = Sequence(-1, token_ids[:-1])
        seq.block_table = list(range(-(-seq.num_tokens // self.block_size)))
        with self._work:  # one forward pass at a time on this model
            cache = self.runner.scratch_cache(seq.num_tokens)
            rows = []
            chunk = self.scheduler.max_num_batched_tokens
            for start in range(0, seq.num_tokens, chunk):
                n = min(chunk, seq.num_tokens - start)
                logits, _ = self.runner.execute([StepItem(seq, start, n, True)], all_rows=True, kv_caches=cache)
                rows.append(torch.log_softmax(logits, dim=-1))
        return torch.cat(rows).cpu().numpy().astype(np.float32)

    def score(self, token_ids: list[int]) -> list[float]:
        if len(token_ids) < 2:
            return []
        lp = self.log_probs(token_ids)
        return lp[np.arange(len(token_ids) - 1), token_ids[1:]].astype(np.float64).tolist()
