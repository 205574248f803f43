"""Backend `paged`: llmlocal's own PyTorch engine — block KV cache with prefix caching,
paged attention and continuous batching (the CUDA path; it runs on CPU too).

Threads: every `generate` call puts a sequence in the inbox and then reads its own event
queue. One engine thread admits the inbox to the scheduler before each step and runs steps
while any sequence is unfinished: schedule -> run the model on the step's tokens -> sample ->
push each sequence's new text to its queue. All scheduler, block-manager and sequence state
is touched only under `_lock`, which the engine thread holds for a whole step; requests
arrive through the inbox and wake it with an event, never waiting for that lock (a Python
lock is not fair: a caller could wait many steps while the engine thread re-takes it).
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import torch
from llmlocal.models import ResolvedModel
from llmlocal.models.errors import LLMLocalError
from llmlocal.native.cpu import runtime as sparse_int4_runtime
from llmlocal.native.cpu.pack_ahead import PackAhead

from ..core.block_manager import ROOT_KEY, BlockManager
from ..core.kv_disk import DiskTier
from ..core.model_runner import ModelRunner, StepItem
from ..core.sampling import sample_batch, token_logprobs
from ..core.scheduler import RequestTooLargeError, Scheduler
from ..core.sequence import Sequence
from ..core.step_masks import StepMasks
from ..model.fast_decode import FastDecode, native_int4, native_quant
from ..model.llama import LlamaModel
from ..model.loader import load_gguf, load_hf
from ..plan import Plan
from ..prompt.tokenizer import Tokenizer, start_tokenizer
from ..spec.drafter import Drafter, DraftModel, DraftRequest
from ..spec.spec_control import PER_TOKEN_PRIOR, DraftLength
from ..spec.speculative import verify
from ..types import DoneEvent, Event, FinishReason, Request, TokenEvent, TokenLogprob
from .base import LocalBackend, Prompt
from .paged_setup import make_drafter, open_disk_tier, pick_device, pick_dtype, pick_kv_dtype
from .paged_stream import EngineFailure, Stream, logprob_rows, new_stream, stream_of

# Engines not closed by their owner are closed at interpreter exit, while their threads still
# run: finalizing the modules under a running decode loop aborted the process.
_OPEN: weakref.WeakSet[PagedBackend] = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_OPEN):
        backend.close()


class PagedBackend(LocalBackend):
    name = "paged"

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        n_ctx: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        drafter: Drafter | None = None,
        draft_k: int | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.runner = runner
        self.disk = disk  # the prefix cache's disk tier, if the plan keeps one
        self.drafter = drafter
        ratio = 0.0
        if isinstance(drafter, DraftModel):
            ratio = drafter.runner.model.weight_bytes() / max(1, runner.model.weight_bytes())
        per_token = PER_TOKEN_PRIOR["cpu" if runner.device.type == "cpu" else "cuda"]
        self.draft_length = DraftLength(fixed=draft_k, draft_ratio=ratio, per_token=per_token) if drafter is not None else None
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.device = str(runner.device)
        self.block_size = runner.block_size
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True,
                                   root_key=disk.root_key if disk else ROOT_KEY, lower=disk)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_batched_tokens, max_num_seqs),
            max_model_len=n_ctx, tail_alone=runner.prompt_rows_vary,
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._live: dict[int, Sequence] = {}
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()  # set on a new request, a cancellation or close
        self._closed = False
        self._masks: StepMasks | None = None  # made for the first request with a grammar
        self._thread = threading.Thread(target=self._loop, name="llmlocal-paged", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, model: ResolvedModel, plan: Plan, drafter: Drafter | None = None,
             tokenizer: Future[Tokenizer] | None = None, ahead: PackAhead | None = None) -> PagedBackend:
        """Load ``model`` as the plan says; ``drafter`` overrides the plan's ``draft`` (e.g. to
        test verification with known proposals); ``tokenizer`` and ``ahead``: the model's
        tokenizer and kernel layout already under way (`start_tokenizer`, `start_packing`)."""
        device = pick_device(plan)
        dtype = pick_dtype(plan, device)
        spec = model.spec
        n_ctx = plan.n_ctx or spec.context_length
        if device.type == "cpu" and plan.threads:
            torch.set_num_threads(plan.threads)
            if sparse_int4_runtime.built():  # the native kernels' pool (process-wide, as torch's)
                sparse_int4_runtime.set_num_threads(plan.threads)
        pending = tokenizer or start_tokenizer(model.path, spec.format == "gguf")  # loads beside the weights
        net = cls._load_net(model, plan, device, dtype, n_ctx, ahead)
        vocab = pending.result()
        block_size = plan.block_size
        # Default pool: every batch slot can hold a full context window... capped at 4 windows
        # (the planner will size this from free memory).
        num_blocks = plan.kv_blocks or -(-n_ctx // block_size) * min(plan.max_batch, 4)
        kv_dtype = pick_kv_dtype(plan, device, dtype)
        runner = ModelRunner(net, num_blocks, block_size, kv_dtype=kv_dtype)
        if cls is PagedBackend:  # (the sparse backend attaches its own, with thresholds)
            FastDecode.attach(runner)
        if device.type == "cuda" and os.environ.get("LLMLOCAL_CUDA_GRAPHS", "1") != "0":
            runner.enable_cuda_graphs(plan.max_batch, n_ctx)
        if drafter is None and plan.draft:
            drafter = make_drafter(plan, spec, runner, n_ctx, kv_dtype)
        disk = open_disk_tier(model, plan, runner, role=cls.name)
        return cls(runner, vocab, n_ctx, plan.max_batch, plan.max_batch_tokens, drafter, plan.draft_k, disk)

    @classmethod
    def _load_net(cls, model: ResolvedModel, plan: Plan, device: torch.device, dtype: torch.dtype, n_ctx: int,
                  ahead: PackAhead | None = None) -> LlamaModel:
        """The target model's network (a subclass may build its layers differently)."""
        if model.spec.format == "gguf":
            int4 = native_int4(device, dtype) if plan.weights in ("auto", "int4") else None
            quant = native_quant(device, dtype, model.spec, ahead=ahead) if plan.weights == "auto" else None
            return load_gguf(model.spec, device, dtype, plan.weights, max_position=n_ctx, int4=int4, quant=quant)
        return load_hf(model.path, device, dtype, plan.weights, max_position=n_ctx)

    def _extra_stats(self, stream: Stream) -> dict[str, object]:
        """`Stats` fields a subclass reports for a finished request (none here)."""
        return {}

    def close(self) -> None:
        _OPEN.discard(self)
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._masks is not None:
            self._masks.close()
        if self.disk is not None:
            self.disk.close()  # what is queued gets written: the next run finds it
        if self.drafter is not None:
            self.drafter.close()
        self.tokenizer.close()

    # ---- tokens --------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special)

    def detokenize(self, token_ids: list[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: Request, prompt: Prompt, cancel: threading.Event) -> Iterator[Event]:
        p = request.sampling
        events: queue.SimpleQueue = queue.SimpleQueue()
        streams = [self._new_stream(request, cancel, events, i) for i in range(p.n)]
        streams[0].siblings = streams[1:]
        if p.grammar is not None:  # compiled here: a bad grammar is the caller's error, before queueing
            if self._masks is None:
                self._masks = StepMasks(self.tokenizer.token_masks(self.runner.model.cfg.vocab_size))
            for stream in streams:
                stream.constraint = self._masks.constraint(p.grammar)
        seq = Sequence(next(self._ids), prompt.ids, max_tokens=p.max_tokens, extra=streams[0])
        try:
            self.scheduler.check_fits(seq)
        except RequestTooLargeError as e:
            raise LLMLocalError(str(e).replace("give the KV cache more memory", "pass a larger --kv-blocks")) from None
        if self.disk is not None:  # read here, in the caller's thread: the engine thread keeps stepping
            # NOTE: the pool is read without the lock: a stale answer costs a read or a recompute
            self.disk.stage(seq.seq_id, self.blocks.uncached_prefix(seq.token_ids))
        self._inbox.put(seq)
        self._wake.set()
        remaining = p.n
        try:
            while remaining:
                event = events.get()
                if isinstance(event, EngineFailure):
                    raise event.error
                yield event
                if isinstance(event, DoneEvent):
                    remaining -= 1
        finally:
            if remaining:  # the consumer stopped reading: stop the request's sequences
                cancel.set()
                self._wake.set()

    def _new_stream(self, request: Request, cancel: threading.Event, events: queue.SimpleQueue, index: int) -> Stream:
        return new_stream(request, cancel, events, index, self.name, self.runner.device)

    def prefill(self, request: Request, prompt: Prompt, cancel: threading.Event) -> int:
        computed = super().prefill(request, prompt, cancel)
        if isinstance(self.drafter, DraftModel) and not cancel.is_set():  # the draft's K/V too (`DraftModel.warm`)
            with self._lock:
                self.drafter.warm(prompt.ids, cancel)
        return computed

    # ---- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.clear()  # before looking: a request put after this sets it again
            with self._lock:
                self._admit()
                if self._closed:
                    for seq in list(self._live.values()):
                        self.scheduler.abort(seq.seq_id)
                        self._finish(seq, "cancelled")
                    return
                if self._live:
                    try:
                        self._step()
                    except BaseException as e:  # a bug: tell every waiting consumer, keep serving
                        for seq in list(self._live.values()):
                            self.scheduler.abort(seq.seq_id)
                            stream = stream_of(seq)
                            stream.events.put(EngineFailure(e))
                            if self.disk is not None:
                                self.disk.release(seq.seq_id)
                        self._live.clear()
                    continue
            self._wake.wait()

    def _admit(self) -> None:
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            self.scheduler.add(seq)  # fits: `generate` checked
            self._live[seq.seq_id] = seq

    def _step(self) -> None:
        for seq in list(self._live.values()):
            if stream_of(seq).cancel.is_set():
                self.scheduler.abort(seq.seq_id)  # frees its blocks; full ones stay cached
                self._finish(seq, "cancelled")
        if not self._live:
            return
        if self.drafter is not None:
            self._propose()
        out = self.scheduler.schedule()
        if self.drafter is not None:
            for seq_id in out.preempted:
                self.drafter.release(seq_id)
        if out.is_empty:
            return
        used = self.blocks.num_used_blocks
        if out.loads:
            assert self.disk is not None
            self.runner.write_blocks([b.block_id for b in out.loads], self.disk.take([b.key for b in out.loads]))
        self.runner.copy_blocks([(c.src, c.dst) for c in out.copies])
        items = [
            StepItem(s.seq, s.start, s.num_tokens, s.samples, 1 + s.seq.num_draft_tokens if s.samples else 1)
            for s in out.items
        ]
        masks = self._masks.start(items, lambda seq: stream_of(seq).constraint) if self._masks is not None else None
        # the draft-length controller prices one-token steps and steps that check drafts; a
        # step with a prompt in it costs per token what neither does, and is not observed
        plain = all(s.num_tokens == 1 and s.start > 0 for s in out.items)
        checks = not plain and all(s.start > 0 and s.num_tokens == 1 + s.seq.num_draft_tokens for s in out.items)
        t0 = time.perf_counter()
        logits, sampled_items = self.runner.execute(items)
        raw = logprob_rows(logits, sampled_items)  # before the masks: the model's own distribution
        if masks is not None:
            StepMasks.apply(logits, sampled_items, masks.result())
        new_tokens = self._sample(logits, sampled_items)
        if self.draft_length is not None:
            seconds = time.perf_counter() - t0
            if plain or checks:
                self.draft_length.observe_target(out.num_batched_tokens, seconds, plain)
            else:  # what prices a draft's catch-up before it has run one
                self.draft_length.observe_prompt(out.num_batched_tokens, seconds)
        sampled: dict[int, int] = {}
        accepted: dict[int, int] = {}
        stopped: set[int] = set()
        forks: list[tuple[Sequence, list[tuple[Stream, int, TokenLogprob | None]]]] = []
        row = 0
        for it, tokens in zip(sampled_items, new_tokens):
            stream = stream_of(it.seq)
            sid = it.seq.seq_id
            stream.kv_blocks_used = used
            stream.target_steps += 1
            rows, top = raw.get(sid), stream.request.sampling.logprobs or 0
            if stream.siblings:  # n > 1: the other samples draw their first token from these logits
                last = logits[row + it.num_logits - 1 : row + it.num_logits]
                draws = []
                for sib in stream.siblings:
                    token = sample_batch(last, [sib.request.sampling], [it.seq.token_ids], [sib.generator])[0]
                    draws.append((sib, token, None if rows is None else token_logprobs(rows[-1:], [token], top)[0]))
                forks.append((it.seq, draws))
                stream.siblings = []
            row += it.num_logits
            lps = token_logprobs(rows, tokens, top) if rows is not None else [None] * len(tokens)
            for j, token in enumerate(tokens):
                if self._emit(stream, token, lps[j]):
                    tokens = tokens[: j + 1]
                    stopped.add(sid)
                    break
            sampled[sid] = tokens[-1]
            if it.seq.num_draft_tokens:
                accepted[sid] = len(tokens) - 1
        for seq in self.scheduler.update(out, sampled, stopped, accepted):
            self._finish(seq, seq.finish_reason or "stop")
        if self.disk is not None:  # blocks filled by this step, copied out for the writer thread
            full = self.blocks.take_new_full()
            if full:
                self.disk.put(full, self.runner.read_blocks([b.block_id for b in full]).numpy())
        for parent, draws in forks:
            for sib, token, lp in draws:
                self._start_sibling(parent, sib, token, lp)

    def _sample(self, logits: torch.Tensor, items: list[StepItem]) -> list[list[int]]:
        """The tokens each sampling item produces: one, or (verifying drafts) the kept drafts
        and the target's next token."""
        starts = np.cumsum([0] + [it.num_logits for it in items])
        plain = [i for i, it in enumerate(items) if not it.seq.num_draft_tokens]
        out: list[list[int]] = [[] for _ in items]
        if plain:
            streams = [stream_of(items[i].seq) for i in plain]
            rows = torch.as_tensor([int(starts[i]) for i in plain])
            tokens = sample_batch(
                logits[rows],
                [s.request.sampling for s in streams],
                [items[i].seq.token_ids for i in plain],
                [s.generator for s in streams],
            )
            for i, token in zip(plain, tokens):
                out[i] = [token]
        for i, it in enumerate(items):
            if out[i]:
                continue
            seq, stream = it.seq, stream_of(it.seq)
            assert stream.proposal is not None
            k = seq.num_draft_tokens  # the scheduler may have trimmed the proposal
            drafts = seq.token_ids[seq.num_tokens - k :]
            probs = stream.proposal.probs[:k] if stream.proposal.probs is not None else None
            verdict = verify(
                logits[int(starts[i]) : int(starts[i + 1])], drafts, probs, stream.request.sampling,
                seq.token_ids[: seq.num_tokens - k], stream.generator,
            )
            stream.proposal = None
            stream.drafted += k
            stream.accepted += verdict.accepted
            assert self.draft_length is not None
            self.draft_length.observe(seq.seq_id, k, verdict.accepted)
            out[i] = drafts[: verdict.accepted] + [verdict.token]
        return out

    def _propose(self) -> None:
        """Append draft tokens to the decoding sequences where the cost model says they pay."""
        assert self.drafter is not None and self.draft_length is not None
        running = self.scheduler.running
        if self.scheduler.waiting and len(running) < self.scheduler.max_num_seqs:
            # Requests about to start widen the next steps, where checking drafts costs more,
            # and a draft would first catch its mirror up with the prompt: not now. (Measured:
            # eight requests arriving together, the first one or two drafted while the others
            # waited a step for admission, a tenth of a second of catch-up for nothing.)
            return
        decoding = [
            s for s in running
            if s.num_uncomputed_tokens == 1 and not s.num_draft_tokens and not stream_of(s).cancel.is_set()
        ]
        if not decoding:
            return
        step_tokens = min(self.scheduler.max_num_batched_tokens, sum(s.num_uncomputed_tokens for s in running))
        room = {s.seq_id: self.scheduler.token_limit(s) - s.num_tokens - 1 for s in decoding}
        lag = {s.seq_id: self.drafter.lag(s) for s in decoding} if isinstance(self.drafter, DraftModel) else None
        decoded = {s.seq_id: s.num_tokens - s.num_prompt_tokens for s in decoding}
        ks = self.draft_length.choose([s.seq_id for s in decoding], step_tokens, room, lag, decoded)
        self.draft_length.decay_idle([sid for sid, k in ks.items() if k == 0])
        requests = []
        for seq in decoding:
            if ks[seq.seq_id] > 0:
                stream = stream_of(seq)
                requests.append(DraftRequest(seq, ks[seq.seq_id], stream.request.sampling, stream.generator, stream.constraint, room[seq.seq_id]))
        if not requests:
            return
        t0 = time.perf_counter()
        proposals = self.drafter.propose(requests)
        if isinstance(self.drafter, DraftModel):
            self.draft_length.observe_draft(self.drafter.last_tokens, self.drafter.last_passes, time.perf_counter() - t0)
        for req, proposal in zip(requests, proposals):
            if proposal.tokens:
                req.seq.add_draft(proposal.tokens)
                stream_of(req.seq).proposal = proposal

    def _emit(self, stream: Stream, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Stream one sampled token's text; True if the sample ends here (EOG or stop string)."""
        if self.tokenizer.is_eog(token) and not stream.request.sampling.ignore_eos:
            return True
        if stream.constraint is not None:
            stream.constraint.advance(token)
        stream.recorder.token()
        piece = stream.text.feed(self.tokenizer.token_bytes(token))
        if logprob is not None:
            stream.logprobs.append(logprob)
        stream.events.put(TokenEvent(piece, (token,), stream.index, (logprob,) if logprob is not None else ()))
        return stream.text.stopped

    def _start_sibling(self, parent: Sequence, stream: Stream, token: int, logprob: TokenLogprob | None) -> None:
        """Sample `stream.index` of a request continues from the parent's prompt with its own
        first token, sharing the parent's KV blocks when the parent still holds them."""
        child = parent.fork(next(self._ids))
        del child.token_ids[parent.num_prompt_tokens :]
        child.append_token(token)
        child.extra = stream
        stream.kv_blocks_used = self.blocks.num_used_blocks
        ended: FinishReason | None = None
        if self._emit(stream, token, logprob):
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
        stream = stream_of(seq)
        self._live.pop(seq.seq_id, None)
        if self.disk is not None:
            self.disk.release(seq.seq_id)
        spec: dict[str, object] = {}
        if self.drafter is not None and self.draft_length is not None:
            self.drafter.release(seq.seq_id)
            self.draft_length.forget(seq.seq_id)
            spec = {"drafted_tokens": stream.drafted, "accepted_tokens": stream.accepted, "target_steps": stream.target_steps}
        tail = stream.text.flush()
        if tail:
            stream.events.put(TokenEvent(tail, (), stream.index))
        stats = stream.recorder.finish(
            seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            n_ctx=self.n_ctx,
            kv_blocks_used=stream.kv_blocks_used,
            kv_blocks_total=self.blocks.num_blocks,
            **spec,
            **self._extra_stats(stream),
        )
        stream.events.put(DoneEvent(stream.text.text, reason, stats, stream.index, tuple(stream.logprobs)))

    # ---- scoring -------------------------------------------------------------------------
    def log_probs(self, token_ids: list[int]) -> np.ndarray:
        """(len - 1, vocab) next-token log-distributions, one teacher-forced pass in chunks."""
        if len(token_ids) < 2:
            return np.empty((0, self.runner.model.cfg.vocab_size), dtype=np.float32)
        # NOTE: scoring uses a private KV cache, never the shared pool: recomputing blocks
        # that the prefix cache shares with live sequences would break their read-only rule.
        seq = Sequence(-1, token_ids[:-1])
        seq.block_table = list(range(-(-seq.num_tokens // self.block_size)))
        with self._lock:  # one forward pass at a time on this model
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
