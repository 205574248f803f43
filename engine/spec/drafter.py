"""Drafters: cheap proposals of the next k tokens, which the target model then verifies.

* `DraftModel` runs a second, smaller (or INT4) model of the same vocabulary in the engine,
  with its own KV blocks: each target sequence has a mirror sequence in the draft's block
  manager. Before proposing, the mirror is synced to the target's tokens by truncating it to
  their common prefix (dropping the K/V of drafts the target rejected: no copies) and
  appending what the target added; then the draft decodes k tokens, batched over sequences.
  Where the text already holds a likely continuation (its last tokens occurred before, as
  when a reply quotes, rewrites or summarises its prompt), the draft checks that continuation
  in one pass instead of drafting token by token: it keeps the looked-up tokens it would
  itself have drawn (`speculative.verify`'s rule with the lookup as a point-mass proposal)
  and draws its own token after them. The proposal is distributed exactly as the draft's own
  (the target's verification stays exact, and the acceptance the controller measures is the
  draft's), and costs one pass for up to k + 1 tokens where the lookup is right.
* `NgramDrafter` (prompt lookup) proposes the continuation of the latest earlier occurrence
  of the sequence's last n tokens: free, and good when the reply quotes its input.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from llmlocal.native.cpu.linear import TILES_MIN_ROWS

from ..core.block_manager import ROOT_KEY, BlockManager, chained_blocks
from ..core.kv_disk import DiskTier
from ..core.model_runner import ModelRunner, StepItem
from ..core.sampling import apply_repeat_penalty, draw, filtered_probs
from ..core.sequence import Sequence
from ..model.draft_head import DraftHead
from ..prompt.grammar import Constraint, mask_logits
from ..types import SamplingParams
from .speculative import verify

PREFILL_CHUNK = 512  # draft prompt tokens per forward pass when a mirror catches up
# Prompt lookup beside a draft model: a continuation after a match of 2 to 4 tokens is checked
# by the draft, never proposed as it is. Measured on Qwen2.5-Coder 1.5B drafted by the 0.5B
# (greedy, adaptive k, 64 tokens): proposing lookups as they are lost on code, where short
# matches are often wrong and the draft is right (1.66 -> 1.52x the target alone), and even
# four-token matches were rejected whole often enough in a summary (1.27 -> 1.29x); checking
# them gained where the reply quotes its prompt (summary 1.27 -> 1.42x, rewrite 1.36 -> 1.65x)
# and kept code as it was (1.66 -> 1.73x, 1.61 -> 1.63x).
LOOKUP_NGRAM = (2, 4)  # shortest and longest match looked up
WARM_ID = -1  # the mirror `DraftModel.warm` computes (target sequences' ids are >= 0)
WARM_CHUNK = 128  # its tokens a pass: a cancel (Enter pressed while it runs) waits for one pass at most


@dataclass
class DraftRequest:
    seq: Sequence  # a target sequence in decode, without drafts
    k: int  # tokens wanted (the drafter may return fewer)
    params: SamplingParams
    generator: torch.Generator | None
    constraint: Constraint | None = None  # the request's grammar: drafts follow it too
    room: int | None = None  # tokens the sequence can still take (None: k); a proposal may hold k + 1


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # (len(tokens), V) the drafter's distributions; None: point masses


class Drafter(Protocol):
    name: str
    seconds: float  # time spent proposing, summed (for the cost model)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def release(self, seq_id: int) -> None:
        """Forget a target sequence (finished, cancelled or preempted)."""
        ...

    def close(self) -> None:
        """The engine closes: finish what outlives it (a draft model's disk writes)."""
        ...


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seconds = 0.0

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        t0 = time.perf_counter()
        out = [Proposal(lookup(r.seq.token_ids, r.k, self.max_ngram, self.min_ngram), None) for r in requests]
        self.seconds += time.perf_counter() - t0
        return out

    def release(self, seq_id: int) -> None:
        pass

    def close(self) -> None:
        pass


def lookup(tokens: list[int], k: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (n from max_ngram down to min_ngram); [] when the suffix never occurred before."""
    n_tokens = len(tokens)
    if k < 1 or n_tokens <= min_ngram:
        return []
    last = tokens[-1]
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = tokens[n_tokens - n :]
        # candidate ends j (the position of the suffix's last token), latest first, excluding
        # the suffix itself
        for j in range(n_tokens - 2, n - 2, -1):
            if tokens[j] == last and tokens[j - n + 1 : j + 1] == suffix:
                return tokens[j + 1 : j + 1 + k]
    return []


class DraftModel:
    """A draft model with its own KV pool; one mirror sequence per target sequence.
    ``prompt_lookup``: check a continuation found earlier in the text where there is one,
    instead of drafting it token by token (see the module's docstring). ``disk``: the draft's
    own prefix cache on disk (`kv_disk`): a new mirror reads the blocks of its history found
    there, and the blocks the draft fills are kept there, as the target's are. Without it a
    reopened chat's first proposal computed the draft's whole history (742 tokens on the 0.5B:
    5.1 s on a Zen 3, where the target read its own from disk in 0.3 s)."""

    name = "model"

    def __init__(self, runner: ModelRunner, prompt_lookup: bool = True, disk: DiskTier | None = None) -> None:
        self.runner = runner
        # the bfloat16 tiles for chunks of 16+ tokens only: its catch-ups of a few tokens stay
        # on the int8 kernels (its tokens only propose, so speed decides)
        runner.prompt_chunk_min = TILES_MIN_ROWS
        self.prompt_lookup = prompt_lookup
        self.head = runner.model.lm_head
        self.disk = disk
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True,
                                   root_key=disk.root_key if disk else ROOT_KEY, lower=disk)
        self._mirrors: dict[int, Sequence] = {}
        self._cached: dict[int, int] = {}  # tokens found computed, by sequence without a mirror (`lag`)
        self.seconds = 0.0
        self.last_passes = 0  # forward passes and tokens of the last `propose`
        self.last_tokens = 0
        self.checked = 0  # proposals that checked a looked-up continuation

    def lag(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the draft would compute before its first proposal for it: those its
        prefix cache (pool or disk) lacks; 0 once it has a mirror (it keeps up step by step)."""
        if seq.seq_id in self._mirrors:
            return 0
        cached = self._cached.get(seq.seq_id)
        if cached is None:  # (its prompt's, looked up once: each step adds a token at most)
            cached = self._cached[seq.seq_id] = self.blocks.cached_tokens(seq.token_ids)
        return seq.num_tokens - cached

    def release(self, seq_id: int) -> None:
        self._cached.pop(seq_id, None)
        mirror = self._mirrors.pop(seq_id, None)
        if mirror is not None and mirror.block_table:
            self.blocks.free(mirror)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()  # what is queued gets written: the next run finds it

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        t0 = time.perf_counter()
        try:
            return self._propose(requests)
        finally:
            self.seconds += time.perf_counter() - t0

    def _propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in requests]
        advanced = [0] * len(requests)  # drafts each request's grammar was told of
        try:
            return self._draft(requests, tokens, advanced)
        finally:  # a grammar's state is the sequence's again, whatever was drafted
            for r, n in zip(requests, advanced):
                if r.constraint is not None:
                    r.constraint.rollback(n)

    def _draft(self, requests: list[DraftRequest], tokens: list[list[int]], advanced: list[int]) -> list[Proposal]:
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        guesses = [self._guess(r) for r in requests]  # continuations looked up, for the draft to check
        computing: set[int] = set()  # keys of the full blocks the new mirrors will compute now
        active = [i for i, r in enumerate(requests) if r.k > 0 and self._sync(r.seq, guesses[i], computing)]
        self.last_passes = self.last_tokens = 0
        while active:
            items = []
            for i in active:
                m = self._mirrors[requests[i].seq.seq_id]
                n = min(m.num_uncomputed_tokens, PREFILL_CHUNK)
                last = n == m.num_uncomputed_tokens
                items.append(StepItem(m, m.num_computed_tokens, n, last, 1 + len(guesses[i]) if last else 1))
            logits, sampled = self.runner.execute(items)
            self.last_passes += 1
            self.last_tokens += sum(it.num_tokens for it in items)
            for it in items:
                self.blocks.mark_computed(it.seq, it.num_tokens)
            self._keep_full()
            first_row, row = {}, 0
            for it in sampled:
                first_row[id(it.seq)] = row
                row += it.num_logits
            still = []
            for i in active:
                r = requests[i]
                m = self._mirrors[r.seq.seq_id]
                row = first_row.get(id(m))
                if row is None:  # a long catch-up continues next pass
                    still.append(i)
                    continue
                ends = False
                if guesses[i]:
                    new, qs = self._check(r, m, logits[row : row + 1 + len(guesses[i])], guesses[i])
                    guesses[i] = []
                else:
                    if r.constraint is not None:  # a draft the grammar forbids would only be rejected
                        mask_logits(logits[row], r.constraint.allowed())
                        if not bool(torch.isfinite(logits[row]).any()):
                            continue  # the grammar allows no token the draft's head has (`DraftHead`): stop here
                    new, qs, ends = self._next(r, m, logits[row])
                    advanced[i] += r.constraint is not None and not ends
                tokens[i].extend(new)
                probs[i].extend(qs)
                if not ends and len(tokens[i]) < r.k and self.blocks.can_append(m, 1):
                    copy = self.blocks.append_slots(m, 1)
                    if copy is not None:
                        self.runner.copy_blocks([(copy.src, copy.dst)])
                    still.append(i)
            active = still
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    @staticmethod
    def _next(r: DraftRequest, m: Sequence, row: torch.Tensor) -> tuple[list[int], list[torch.Tensor], bool]:
        """The draft's next token from its logits ``row``, appended to the mirror, with the
        distribution it was drawn from (sampling) and whether it ends ``r``'s grammar; the
        grammar is advanced past it otherwise."""
        token, q = _draw(row, r.params, m.token_ids, r.generator)
        ends = r.constraint is not None and r.constraint.ends(token)
        if r.constraint is not None and not ends:
            r.constraint.advance(token)
        m.append_token(token)
        return [token], [q] if q is not None else [], ends

    def _guess(self, r: DraftRequest) -> list[int]:
        """A continuation of ``r``'s text found earlier in it, for the draft to check; none
        where a grammar constrains the drafts (the draft follows it instead)."""
        if not self.prompt_lookup or r.constraint is not None:
            return []
        guess = lookup(r.seq.token_ids, r.k, LOOKUP_NGRAM[1], LOOKUP_NGRAM[0])
        self.checked += bool(guess)
        return guess

    def _check(self, r: DraftRequest, m: Sequence, rows: torch.Tensor, guess: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """The draft's own next tokens from one pass over a looked-up ``guess`` (``rows``: the
        draft's logits before each guessed token and after the last): the guessed tokens it
        keeps by `verify`'s rule for a point-mass proposal, then a token drawn by that rule
        too. Each comes out as the draft would have drawn it (greedy: its argmax; sampling:
        from its filtered distribution), so the returned distributions are the draft's own.
        The mirror keeps the K/V of the kept guesses, then the drawn token to compute next
        (dropped where all k guesses were kept and the sequence has no room for k + 1)."""
        start = m.num_tokens - len(guess)
        history = m.token_ids[:start]
        verdict = verify(rows, guess, None, r.params, history, r.generator)
        self.blocks.truncate(m, start + verdict.accepted)
        new = guess[: verdict.accepted] + [verdict.token]
        if len(new) > r.k and (r.room or 0) <= r.k:
            new.pop()
        else:
            m.append_token(verdict.token)
        if r.params.greedy:
            return new, []
        qs = [filtered_probs(apply_repeat_penalty(rows[j], history + new[:j], r.params), r.params) for j in range(len(new))]
        return new, qs

    def _include(self, tokens: list[int]) -> None:
        """Tokens of a text being drafted for: a head over part of the vocabulary (`DraftHead`)
        may propose them from now on."""
        if isinstance(self.head, DraftHead):
            self.head.include(tokens)

    def warm(self, tokens: list[int], cancel: threading.Event | None = None) -> int:
        """Compute the draft's K/V of ``tokens`` ahead of a request that will start with them
        (the chat prefills a message while it is typed: `Backend.prefill`). The blocks stay in
        the draft's prefix cache and on its disk tier, so the request's first proposal does not
        catch up on them after its first token (a 1,000-token paste: seconds of the 0.5B).
        Stops between passes once ``cancel`` is set. Returns the tokens computed."""
        m = self._new_mirror(WARM_ID, tokens)
        if m is None:
            return 0
        computed = 0
        try:
            while m.num_uncomputed_tokens and not (cancel is not None and cancel.is_set()):
                n = min(m.num_uncomputed_tokens, WARM_CHUNK)
                self.runner.execute([StepItem(m, m.num_computed_tokens, n, False)])
                self.blocks.mark_computed(m, n)
                self._keep_full()
                computed += n
        finally:
            self.blocks.free(m)
        return computed

    def _new_mirror(self, seq_id: int, tokens: list[int]) -> Sequence | None:
        """A mirror holding ``tokens``, with slots for them: the blocks of its prefix found in the
        draft's pool are shared, those on its disk tier loaded; None if the pool has no room."""
        m = Sequence(seq_id, tokens)
        self._include(tokens)
        m.num_prompt_tokens = 1  # a mirror may be cut back to any length but its first token
        if self.disk is not None:  # the history's blocks this pool lacks, from disk where kept
            self.disk.stage(seq_id, self.blocks.uncached_prefix(tokens))
        fits = self.blocks.can_allocate(m)
        if fits:
            loads = self.blocks.allocate(m)  # prefix hits: shared prompts are computed once
            if loads:
                assert self.disk is not None
                self.runner.write_blocks([b.block_id for b in loads], self.disk.take([b.key for b in loads]))
        if self.disk is not None:
            self.disk.release(seq_id)  # what was staged and not loaded
        return m if fits else None

    def _keep_full(self) -> None:
        """The blocks the last pass filled, copied out for the disk tier's writer."""
        if self.disk is not None:
            full = self.blocks.take_new_full()
            if full:
                self.disk.put(full, self.runner.read_blocks([b.block_id for b in full]).numpy())

    def _sync(self, seq: Sequence, guess: list[int], computing: set[int]) -> bool:
        """Make the mirror of ``seq`` hold exactly its tokens and then ``guess``, with slots for
        them; False if the draft's pool has no room, or if a new mirror's first uncached block
        is in ``computing`` (another new mirror of this proposal computes it: next step it is
        found, not computed twice), and no drafting for this sequence this step. A new mirror
        adds the keys of the full blocks it will compute to ``computing``."""
        target = seq.token_ids
        m = self._mirrors.get(seq.seq_id)
        if m is None:
            size, root = self.blocks.block_size, self.blocks.root_key
            blocks = chained_blocks(target, size, len(target) // size, root)
            if computing and self.blocks.first_miss([key for key, _ in blocks[: (len(target) - 1) // size]]) in computing:
                return False
            m = self._new_mirror(seq.seq_id, list(target))
            if m is None:
                return False
            self._mirrors[seq.seq_id] = m
            computing.update(key for key, _ in blocks[m.num_computed_tokens // size :])
        else:
            common = _common_prefix(m.token_ids, target)
            self._include(target[common:])
            self.blocks.truncate(m, max(common, 1))
            common = m.num_tokens
            m.token_ids.extend(target[common:])
        if m.num_uncomputed_tokens == 0:  # the target's last token is always recomputed
            self.blocks.truncate(m, m.num_tokens - 1)
            m.token_ids.append(target[-1])
        m.token_ids.extend(guess)
        need = m.num_uncomputed_tokens
        if not self.blocks.can_append(m, need):
            return False
        copy = self.blocks.append_slots(m, need)
        if copy is not None:
            self.runner.copy_blocks([(copy.src, copy.dst)])
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _draw(
    logits: torch.Tensor, params: SamplingParams, history: list[int], generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """The draft's token and (when sampling) the distribution it was drawn from: the same
    filters as the target's, so verification compares like with like."""
    row = apply_repeat_penalty(logits, history, params)
    if params.greedy:
        return int(row.argmax()), None
    q = filtered_probs(row, params)
    return draw(q, generator), q
