"""`Scheduler`: continuous batching with chunked prefill and preemption, over integers.

One engine step is a pair of calls around the model runner:

    out = scheduler.schedule()              # which tokens of which sequences to compute
    runner.load_blocks(out.loads)           # blocks found in the lower tier (the disk)
    runner.copy_blocks(out.copies)          # copy-on-write rows, before any K/V is written
    logits = runner.forward(out.items)      # K/V for every item; logits where item.samples
    sampled = {item.seq.seq_id: sample(...) for item in out.items if item.samples}
    finished = scheduler.update(out, sampled, stopped=ids_that_hit_eos_or_a_stop_string)

Policy, in the order ``schedule`` applies it, under a budget of ``max_num_batched_tokens``:

1. Running sequences in decode (one uncomputed token), oldest first.
2. Running sequences still in prefill: the next chunk of their tokens, oldest first. A long
   prompt is spread over several steps and never holds up the decodes of step 1.
3. Waiting sequences, in arrival order (preempted ones are older than any never-admitted one,
   so they come first), while blocks, ``max_num_seqs`` and the budget allow. Admission stops at
   the first sequence that does not fit: later, smaller requests do not overtake it. A waiting
   sequence whose first uncached block a running prefill is still computing (the same prefix:
   a shared system prompt, requests sent together) waits for that block instead of computing
   it again; later arrivals may be admitted meanwhile.

Speculative decoding: a decoding sequence may carry ``num_draft_tokens`` proposed tokens
after its last real one; it is scheduled with all of them in one item (1 + k tokens, verified
by the step) or, when the budget or the pool is short, with fewer: the scheduler trims drafts
before it would split them over two steps or preempt anyone for them. ``update`` is told how
many drafts each sequence accepted and rolls the rest back by truncating its block table.

A running sequence that cannot get a block preempts the newest running sequence (its blocks
are freed; it goes back to waiting and is recomputed later, cheaply when its blocks are still
in the prefix cache). No sequence is admitted in a step that preempted. A request that could
not fit even alone in the pool is refused by ``add`` so nothing can wait forever.

The scheduler is not thread-safe: the engine calls it from one thread (``abort`` included).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Collection, Mapping

from llmlocal.models.errors import LLMLocalError

from ..types import FinishReason
from .block_manager import BlockLoad, BlockManager, CopyOnWrite, chained_blocks, prefix_blocks
from .sequence import Sequence, SequenceStatus, blocks_for


class RequestTooLargeError(LLMLocalError):
    """The request can never fit: its prompt and ``max_tokens`` need more KV blocks than exist."""

    def __init__(self, message: str, *, blocks_needed: int, num_blocks: int, block_size: int) -> None:
        super().__init__(message)
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks
        self.block_size = block_size


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute K/V for ``seq.token_ids[start : start + num_tokens]`` at those positions.

    ``samples`` is true when the chunk ends at the sequence's last token (as of ``schedule``):
    the runner then takes the logits of the chunk's last position and samples a token.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.end]


@dataclass
class SchedulerOutput:
    """One step. ``items`` lists the one-token items first (decodes), then the longer chunks
    (prefills), each group in scheduling order; the runner may rely on that order.

    Apply ``loads`` (blocks the lower tier holds, for sequences admitted now) and ``copies``
    before the forward pass reads or writes any K/V. ``preempted`` names the sequences sent
    back to waiting (their blocks are freed; drop any per-sequence state of theirs).
    """

    items: list[ScheduledSeq]
    copies: list[CopyOnWrite]
    preempted: list[int]
    num_batched_tokens: int
    loads: list[BlockLoad] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return sum(1 for item in self.items if item.num_tokens == 1)

    @property
    def decodes(self) -> list[ScheduledSeq]:
        return self.items[: self.num_decodes]

    @property
    def prefills(self) -> list[ScheduledSeq]:
        return self.items[self.num_decodes :]

    @property
    def is_empty(self) -> bool:
        return not self.items


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        tail_alone: bool = False,
    ) -> None:
        """``tail_alone``: a prefill stops before the rows a prefix-cache hit on the same tokens
        would compute (those after the last cacheable block), which then run as a chunk of their
        own, as on a hit: for a runner whose prompt rows' numbers depend on the chunk they are
        in (int8 activations without the bfloat16 tiles), so that the same prompt gives the
        same reply cold and warm."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        # Every running sequence needs at least one token per step, so the budget must cover
        # a full batch of decodes; otherwise the newest decodes would starve.
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs ({max_num_seqs})"
            )
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len  # the context window; None: only the pool limits
        self.tail_alone = tail_alone
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self._arrivals = itertools.count()
        self._keys: dict[int, list[int]] = {}  # seq_id -> its full prompt blocks' keys (`_prompt_keys`)

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises `RequestTooLargeError` if it can never fit the pool."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a new waiting sequence")
        self.check_fits(seq)
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)  # the newest arrival sorts last
        self._seqs[seq.seq_id] = seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a sequence as cancelled and free its blocks; None if it is not scheduled."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._retire(seq, "cancelled")
        else:
            self._finish(seq, "cancelled")
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def token_limit(self, seq: Sequence) -> int:
        """The most tokens ``seq`` may reach; it finishes when it gets there.

        The last token is sampled but never computed, so a sequence of L tokens needs L - 1
        slots. Without ``max_tokens`` the limit is the context window, or the whole pool.
        """
        pool = self.block_manager.num_blocks * self.block_manager.block_size + 1
        limit = pool if seq.max_tokens is None else seq.num_prompt_tokens + seq.max_tokens
        return limit if self.max_model_len is None else min(limit, self.max_model_len)

    def check_fits(self, seq: Sequence) -> None:
        """Raise `RequestTooLargeError` if ``seq`` can never fit the pool (reads only the
        pool's fixed sizes: safe from any thread)."""
        bm = self.block_manager
        prompt = seq.num_prompt_tokens
        if self.max_model_len is not None and prompt >= self.max_model_len:
            raise RequestTooLargeError(
                f"The prompt has {prompt} tokens and the context holds {self.max_model_len}: "
                "shorten the prompt or use a larger context.",
                blocks_needed=blocks_for(prompt, bm.block_size),
                num_blocks=bm.num_blocks,
                block_size=bm.block_size,
            )
        slots = max(prompt, self.token_limit(seq) - 1)
        blocks = blocks_for(slots, bm.block_size)
        if blocks > bm.num_blocks:
            new = "" if seq.max_tokens is None else f" + {seq.max_tokens} new"
            raise RequestTooLargeError(
                f"The request needs {blocks} KV blocks of {bm.block_size} tokens ({prompt} prompt{new} "
                f"tokens) and the KV cache has {bm.num_blocks}: shorten the prompt, lower max_tokens, "
                "or give the KV cache more memory.",
                blocks_needed=blocks,
                num_blocks=bm.num_blocks,
                block_size=bm.block_size,
            )

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work; see the module docstring for the policy."""
        # NOTE: invariants on return: every item's tokens have slots in its sequence's table
        # and the blocks it writes are its own (copies listed); the items' tokens sum to at
        # most max_num_batched_tokens; at most max_num_seqs sequences are running; a preempted
        # sequence holds no blocks and has no item.
        budget = self.max_num_batched_tokens
        planned: dict[int, ScheduledSeq] = {}
        copies: dict[int, CopyOnWrite] = {}
        preempted: list[int] = []
        loads: list[BlockLoad] = []

        self.running.sort(key=lambda s: s.arrival)
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1 + s.num_draft_tokens]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1 + s.num_draft_tokens]
        for seq in decoding + prefilling:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left
            if seq.num_draft_tokens:
                # Drafts are optional work: trim them to the budget and to the free blocks
                # rather than split them over two steps or preempt anyone for them.
                self._drop_draft(seq, max(0, seq.num_uncomputed_tokens - budget))
                while seq.num_draft_tokens and not self.block_manager.can_append(seq, seq.num_uncomputed_tokens):
                    self._drop_draft(seq, 1)
            need = seq.num_uncomputed_tokens
            while not self.block_manager.can_append(seq, need):
                victim = self.running[-1]  # newest: running stays sorted by arrival
                if victim is seq and len(self.running) == 1:
                    # add() guarantees a lone sequence fits the pool; reaching here is a bug.
                    raise RuntimeError(f"sequence {seq.seq_id} does not fit the KV cache on its own")
                plan = planned.pop(victim.seq_id, None)
                if plan is not None:
                    budget += plan.num_tokens
                copies.pop(victim.seq_id, None)  # its copy target is freed with it
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            copy = self.block_manager.append_slots(seq, need)
            if copy is not None:
                copies[seq.seq_id] = copy
            budget -= self._plan(planned, seq, budget)

        # Admitting right after preempting would take back the blocks just freed.
        admits = not preempted and budget > 0 and len(self.running) < self.max_num_seqs
        computing = self._computing() if admits and self.waiting else set()  # (none while nothing can start)
        i = 0
        while admits and i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if computing and self.block_manager.first_miss(self._lookup_keys(seq)) in computing:
                i += 1  # it waits for a running prefill's blocks rather than compute them again
                continue
            if not self.block_manager.can_allocate(seq):
                break
            loads += self.block_manager.allocate(seq)
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._plan(planned, seq, budget)
            computing |= self._computing_in(seq)

        for seq in self.running:  # drafts of a sequence left out of this step are stale next step
            if seq.num_draft_tokens and seq.seq_id not in planned:
                self._drop_draft(seq, seq.num_draft_tokens)

        decodes = [p for p in planned.values() if p.num_tokens == 1]
        prefills = [p for p in planned.values() if p.num_tokens > 1]
        return SchedulerOutput(
            items=decodes + prefills,
            copies=list(copies.values()),
            preempted=preempted,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            loads=loads,
        )

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[int, int],
        stopped: Collection[int] = (),
        accepted: Mapping[int, int] | None = None,
    ) -> list[Sequence]:
        """Apply a computed step: advance every item, append the sampled tokens, finish.

        ``sampled`` maps the seq_id of every item with ``samples`` to its new token; ``stopped``
        names sequences the runner ended (end-of-generation token or stop string; their token
        is still appended). ``accepted`` gives, for each sequence that carried draft tokens,
        how many of them (a prefix) it keeps; the others are rolled back (default: none kept)
        and the sampled token follows the kept ones. Sequences also finish at ``max_tokens``
        ("length") and at their token limit ("context"). Returns the sequences finished by
        this step, blocks freed. Items of sequences aborted since ``schedule`` are skipped.
        """
        accepted = accepted or {}
        live = [item for item in output.items if item.seq.status is SequenceStatus.RUNNING]
        expected = {item.seq.seq_id for item in output.items if item.samples}
        if unexpected := set(sampled) - expected:
            raise ValueError(f"sampled tokens for sequences that were not sampling: {sorted(unexpected)}")
        if unsampled := set(stopped) - set(sampled):
            raise ValueError(f"stopped sequences without a sampled token: {sorted(unsampled)}")
        for item in live:  # check everything before changing anything
            if item.seq.num_computed_tokens != item.start:
                raise ValueError(f"sequence {item.seq.seq_id}: this output was already applied or is stale")
            if item.samples and item.seq.seq_id not in sampled:
                raise ValueError(f"no sampled token for sequence {item.seq.seq_id}")
            if not 0 <= accepted.get(item.seq.seq_id, 0) <= item.seq.num_draft_tokens:
                raise ValueError(f"sequence {item.seq.seq_id}: accepted more draft tokens than it had")

        finished: list[Sequence] = []
        for item in live:
            seq = item.seq
            self.block_manager.mark_computed(seq, item.num_tokens)
            if not item.samples:
                continue
            if seq.num_draft_tokens:
                # Keep the accepted prefix of the drafts; the K/V of the rejected ones are
                # dropped with their blocks (the rows of a kept block are overwritten later).
                drafts = seq.num_draft_tokens
                self.block_manager.truncate(seq, seq.num_tokens - drafts + accepted.get(seq.seq_id, 0))
                seq.num_draft_tokens = 0
            seq.append_token(sampled[seq.seq_id])
            reason: FinishReason | None = None
            if seq.seq_id in stopped:
                reason = "stop"
            elif seq.max_tokens is not None and seq.num_completion_tokens >= seq.max_tokens:
                reason = "length"
            elif seq.num_tokens >= self.token_limit(seq):
                reason = "context"
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    # ---- parallel samples ----------------------------------------------------------------
    def can_fork(self, parent: Sequence) -> bool:
        """Whether a running, fully prefilled ``parent`` can get a sibling now."""
        return (
            parent.status is SequenceStatus.RUNNING
            and self._seqs.get(parent.seq_id) is parent
            and parent.num_uncomputed_tokens <= 1
            and len(self.running) < self.max_num_seqs
        )

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` (e.g. ``parent.fork(new_id)``) alongside ``parent``, sharing its blocks.

        The child must have at least one token past the parent's computed ones (its own
        sampled token, or the parent's last one); it is the newest sequence.
        """
        if not self.can_fork(parent):
            raise ValueError(f"sequence {parent.seq_id} cannot be forked now")
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence {child.seq_id} is already scheduled")
        if child.num_tokens <= parent.num_computed_tokens:
            raise ValueError(f"sequence {child.seq_id} has no token to compute after the shared prefix")
        self.check_fits(child)
        self.block_manager.fork(parent, child)
        child.arrival = next(self._arrivals)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self._seqs[child.seq_id] = child

    # ---- figures -------------------------------------------------------------------------
    @property
    def kv_blocks_used(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def kv_blocks_total(self) -> int:
        return self.block_manager.num_blocks

    def kv_waste(self) -> float:
        """Allocated slots not holding a token, over allocated slots, for running sequences.

        A block shared by several sequences counts once per sequence.
        """
        size = self.block_manager.block_size
        allocated = sum(len(s.block_table) * size for s in self.running)
        if allocated == 0:
            return 0.0
        filled = sum(min(s.num_tokens, len(s.block_table) * size) for s in self.running)
        return (allocated - filled) / allocated

    # ---- prompts shared while they are computed ------------------------------------------
    def _prompt_keys(self, seq: Sequence) -> list[int]:
        """The prefix-cache keys of ``seq``'s full prompt blocks (made once: a prompt never changes)."""
        keys = self._keys.get(seq.seq_id)
        if keys is None:
            bm = self.block_manager
            blocks = chained_blocks(seq.prompt_token_ids, bm.block_size, seq.num_prompt_tokens // bm.block_size,
                                    bm.root_key)
            keys = self._keys[seq.seq_id] = [key for key, _ in blocks]
        return keys

    def _lookup_keys(self, seq: Sequence) -> list[int]:
        """The keys ``seq`` looks up at admission (`prefix_blocks` of its tokens)."""
        bs = self.block_manager.block_size
        if seq.num_tokens > seq.num_prompt_tokens:  # preempted after generating: rare, not kept
            return [key for key, _ in prefix_blocks(seq.token_ids, bs, self.block_manager.root_key)]
        return self._prompt_keys(seq)[: (seq.num_tokens - 1) // bs]

    def _computing_in(self, seq: Sequence) -> set[int]:
        """Keys of the full prompt blocks running ``seq`` has still to compute."""
        bs = self.block_manager.block_size
        if not self.block_manager.enable_prefix_caching or seq.num_computed_tokens >= seq.num_prompt_tokens // bs * bs:
            return set()
        return set(self._prompt_keys(seq)[seq.num_computed_tokens // bs :])

    def _computing(self) -> set[int]:
        """Keys of the full prompt blocks running sequences have still to compute. A waiting
        sequence whose first uncached block is one of them is not admitted this step: next
        step the block is computed, keyed and found (two requests sharing a system prompt,
        arriving together, would each compute it; each chunk of the first would be computed
        again by the second, admitted beside it with what the first had finished)."""
        keys: set[int] = set()
        for seq in self.running:
            keys |= self._computing_in(seq)
        return keys

    # ---- internals -----------------------------------------------------------------------
    def _plan(self, planned: dict[int, ScheduledSeq], seq: Sequence, budget: int) -> int:
        need = seq.num_uncomputed_tokens
        count = min(need, budget)
        if self.tail_alone and need > 1 and not seq.num_draft_tokens:
            # a hit computes the tokens from the block holding the last one on (BlockManager)
            bs = self.block_manager.block_size
            tail = (seq.num_tokens - 1) // bs * bs
            if seq.num_computed_tokens < tail < seq.num_computed_tokens + count:
                count = tail - seq.num_computed_tokens
        planned[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, count, samples=count == need)
        return count

    def _drop_draft(self, seq: Sequence, count: int) -> None:
        """Remove the last ``count`` draft tokens, none of which has K/V yet."""
        if count:
            if seq.block_table:
                self.block_manager.truncate(seq, seq.num_tokens - count)
                seq.num_draft_tokens -= count
            else:
                seq.drop_draft(count)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # also resets num_computed_tokens: recompute from scratch
        seq.drop_draft()
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        self._retire(seq, reason)

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self._keys.pop(seq.seq_id, None)
