"""`BlockManager`: the paged KV cache's blocks, as integers.

The cache is one pool of ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns
a block table (block ids in position order); the model runner turns it into slot numbers
(``slot = block_id * block_size + position % block_size``) and never asks how blocks move.

Rules this file keeps:

* Reference counts. A block's ``ref_count`` is the number of sequence tables holding it.
  Prefix-cache hits and ``fork`` share blocks; a shared block is read-only. Writing into a
  shared, partly filled block first copies it (copy-on-write, ``CopyOnWrite`` tells the runner
  which rows to copy).
* Prefix caching. A block full of *computed* tokens gets a key that names the whole prefix
  up to its end: ``key = H(parent_key, its token ids)``, chained from the previous block's
  key, the first block's parent being the manager's root key. A later sequence whose tokens
  produce the same key reuses the block instead of computing it again (two requests with a
  common system prompt, or the next turn of a chat, whose prompt extends the last one).
* A lower tier (the disk, `kv_disk`) may hold full blocks that this pool does not. A key
  found there is a hit too: `allocate` gives it a fresh block and lists a `BlockLoad`, which
  the runner fills before the step computes anything. Blocks keyed by computing them are
  listed for the lower tier to keep (`take_new_full`); loaded ones are not.
* Free blocks. A block whose ``ref_count`` drops to 0 is free. If it has a key it stays in
  the cache, reusable by key, until its id is needed for something else.
* Hand-out order. Free blocks without a key are handed out first, oldest-freed first (a fresh
  pool gives 0, 1, 2, ...): they hold nothing anyone can reuse. Only when none is left is a
  cached block evicted, least recently freed first. A sequence frees its blocks tail first,
  so its deepest blocks are evicted before the blocks they extend (a block is only reachable
  through its parents, so evicting a parent first would strand its descendants).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from .sequence import Sequence, blocks_for

# The default parent key of a sequence's first block. A pool whose keys outlive the process
# (the disk tier) roots its chains in a key that names the model and its numerics instead.
ROOT_KEY = 0x6C6C6D6C6F63616C


def block_key(parent_key: int, token_ids: list[int]) -> int:
    """The prefix-cache key of a full block whose tokens follow the prefix ``parent_key``.

    NOTE: keys are 128-bit BLAKE2b digests of (parent key, token ids), the same in every
    process, so keys on disk stay valid across restarts. A collision between two prefixes
    (about n^2 / 2^128 for n blocks) is accepted rather than storing whole prefixes.
    """
    data = parent_key.to_bytes(16, "little") + array("I", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def prefix_blocks(token_ids: list[int], block_size: int, root_key: int = ROOT_KEY) -> list[tuple[int, list[int]]]:
    """(key, tokens) of each full block a sequence of ``token_ids`` may find cached: every
    block before the one holding the last token (see `BlockManager._find_hits`)."""
    return chained_blocks(token_ids, block_size, (len(token_ids) - 1) // block_size, root_key)


def chained_blocks(token_ids: list[int], block_size: int, count: int,
                   root_key: int = ROOT_KEY) -> list[tuple[int, list[int]]]:
    """(key, tokens) of the first ``count`` full blocks of ``token_ids``, each key chained from the last."""
    out: list[tuple[int, list[int]]] = []
    key = root_key
    for i in range(count):
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        key = block_key(key, tokens)
        out.append((key, tokens))
    return out


class LowerTier(Protocol):
    """Full blocks kept outside the pool (the disk tier), found by key."""

    def has(self, key: int) -> bool: ...


class BlockAllocationError(RuntimeError):
    """A block operation was asked for more blocks than are free (check ``can_*`` first)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # set once the block is full of computed tokens (prefix caching)


@dataclass(frozen=True)
class CopyOnWrite:
    """Copy the K/V rows of block ``src`` into block ``dst`` before this step writes to ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True)
class BlockLoad:
    """Fill block ``block_id`` with the lower tier's rows of ``key`` before this step runs."""

    block_id: int
    key: int


@dataclass(frozen=True)
class FullBlock:
    """A block that computing just filled, for the lower tier to keep: its key and tokens."""

    block_id: int
    key: int
    token_ids: tuple[int, ...]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 root_key: int = ROOT_KEY, lower: LowerTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, no key: handed out first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, keyed: LRU first
        self._cache: dict[int, int] = {}  # key -> block id
        self._holders: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks
        self.root_key = root_key
        self.lower = lower if enable_prefix_caching else None
        self._new_full: list[FullBlock] = []  # keyed by computing them since the last take

    # ---- figures -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached free blocks included: they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks reachable by key, in use or free."""
        return len(self._cache)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block(self, block_id: int) -> Block:
        return self._blocks[block_id]

    def lookup(self, key: int) -> int | None:
        """The block cached under ``key``, if any."""
        return self._cache.get(key)

    def uncached_prefix(self, token_ids: list[int]) -> list[tuple[int, list[int]]]:
        """(key, tokens) of the full blocks a sequence of ``token_ids`` could find cached, from
        the first one this pool lacks on: what a lower tier may hold."""
        blocks = prefix_blocks(token_ids, self.block_size, self.root_key)
        first = 0
        while first < len(blocks) and blocks[first][0] in self._cache:
            first += 1
        return blocks[first:]

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they will be handed out (keyless, then LRU cached)."""
        return list(self._free_plain) + list(self._free_cached)

    # ---- admission -----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` would succeed now."""
        self._check_unheld(seq)
        in_pool = [b for b, _ in self._find_hits(seq.token_ids) if b is not None]
        new = seq.num_blocks_needed(self.block_size) - len(in_pool)  # lower-tier hits need a block too
        revived = sum(1 for b in in_pool if self._blocks[b].ref_count == 0)  # hits taken off the free list
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> list[BlockLoad]:
        """Give a sequence without blocks a table for all its current tokens.

        Leading full blocks found in the prefix cache are shared; those found in the lower tier
        get fresh blocks, returned as the loads to do before the step runs. ``seq.num_computed_tokens``
        and ``seq.num_cached_tokens`` count the tokens both cover. The rest are fresh blocks.
        """
        # NOTE: hits are revived before fresh blocks are taken, or taking a fresh block could
        # evict a cached free block this very sequence is about to reuse.
        if not self.can_allocate(seq):
            raise BlockAllocationError(
                f"sequence {seq.seq_id} needs {seq.num_blocks_needed(self.block_size)} blocks and "
                f"only {self.num_free_blocks} are free; call can_allocate() first"
            )
        hits = self._find_hits(seq.token_ids)
        for block_id, _ in hits:
            if block_id is None:
                continue
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        loads: list[BlockLoad] = []
        table: list[int] = []
        for block_id, key in hits:
            if block_id is None:  # in the lower tier: a fresh block, keyed now, filled before the step
                block_id = self._take_free_block()
                self._blocks[block_id].key = key
                self._cache[key] = block_id
                loads.append(BlockLoad(block_id, key))
            table.append(block_id)
        fresh = [self._take_free_block() for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))]
        seq.block_table = table + fresh
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self._holders[seq.seq_id] = seq
        return loads

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Tokens a sequence of ``token_ids`` would find computed at `allocate` (pool or lower tier)."""
        return len(self._find_hits(token_ids)) * self.block_size

    def first_miss(self, keys: list[int]) -> int | None:
        """Of the keys a sequence looks up at `allocate` (its `prefix_blocks`' keys, in order),
        the first it would compute rather than find (None: none, or caching is off)."""
        hits = len(self._find_hits([], keys)) if self.enable_prefix_caching else len(keys)
        return keys[hits] if hits < len(keys) else None

    def _find_hits(self, token_ids: list[int], keys: list[int] | None = None) -> list[tuple[int | None, int]]:
        """The leading full blocks found (of ``token_ids``' `prefix_blocks`, or of their ``keys``
        where given), with their keys: a pool block id, or None where only the lower tier has it."""
        # NOTE: when every token lies in cached full blocks, the last block is treated as a
        # miss: the runner must compute at least one token to get logits to sample from, and
        # computing it in place would write into a shared block. Recomputing the last block
        # (at most block_size tokens) keeps shared blocks read-only and allocate copy-free.
        # Hence only the blocks before the one holding the last token are looked up.
        if not self.enable_prefix_caching:
            return []
        if keys is None:
            keys = [key for key, _ in prefix_blocks(token_ids, self.block_size, self.root_key)]
        hits: list[tuple[int | None, int]] = []
        for key in keys:
            block_id = self._cache.get(key)
            if block_id is None and (self.lower is None or not self.lower.has(key)):
                break
            hits.append((block_id, key))
        return hits

    # ---- growth --------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether ``append_slots(seq, num_new_tokens)`` would succeed now."""
        self._check_write(seq, num_new_tokens)
        missing = max(0, seq.num_blocks_needed(self.block_size) - len(seq.block_table))
        copy = 1 if self._write_block_is_shared(seq, num_new_tokens) else 0
        return missing + copy <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> CopyOnWrite | None:
        """Make room for the last ``num_new_tokens`` of ``seq.token_ids`` (already appended).

        After the call the table holds a slot for every token and the block the first new
        token goes to is the sequence's own. Returns the copy the runner must do first, if the
        block was shared and had to be copied.
        """
        # NOTE: the new tokens are positions [num_tokens - n, num_tokens), not yet computed.
        # Only the block holding the first of them can be shared (a shared partly filled last
        # block, after fork or a truncate); every later block is fresh. So at most one copy.
        if not self.can_append(seq, num_new_tokens):
            raise BlockAllocationError(
                f"sequence {seq.seq_id} needs a block for new tokens and none is free; "
                "call can_append() first"
            )
        copy: CopyOnWrite | None = None
        index = (seq.num_tokens - num_new_tokens) // self.block_size
        if index < len(seq.block_table):
            block = self._blocks[seq.block_table[index]]
            if block.ref_count > 1:
                dst = self._take_free_block()
                block.ref_count -= 1  # stays >= 1: the other holders keep it, key and all
                seq.block_table[index] = dst
                copy = CopyOnWrite(src=block.block_id, dst=dst)
            elif block.key is not None:
                self._drop_key(block)  # about to be overwritten past its computed rows
        while len(seq.block_table) < seq.num_blocks_needed(self.block_size):
            seq.block_table.append(self._take_free_block())
        return copy

    def append_slot(self, seq: Sequence) -> CopyOnWrite | None:
        """``append_slots(seq, 1)``: room for the one token just appended (a decode step)."""
        return self.append_slots(seq, 1)

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that the next ``num_new_tokens`` tokens' K/V are now in the cache.

        Advances ``seq.num_computed_tokens`` and gives every block that is now full of
        computed tokens its prefix key, so later sequences can reuse it.
        """
        # NOTE: keys are registered here, when the K/V are written, and not when token ids
        # fill a block: a chunked prompt fills its blocks with ids long before the runner has
        # computed them, and a hit must never point at rows that hold nothing yet.
        self._check_held(seq)
        if not 0 <= num_new_tokens <= seq.num_uncomputed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}: cannot mark {num_new_tokens} tokens computed, "
                f"{seq.num_uncomputed_tokens} are not"
            )
        end = seq.num_computed_tokens + num_new_tokens
        if end > len(seq.block_table) * self.block_size:
            raise ValueError(f"sequence {seq.seq_id}: tokens up to {end} have no slots; append_slots first")
        seq.num_computed_tokens = end
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        # NOTE: within one table the keyed blocks form a prefix (a key is only ever computed
        # from its parent's key), so scanning back from the last full block to the first
        # keyed one finds the blocks still to key, usually none or one.
        size = self.block_size
        table = seq.block_table
        num_full = seq.num_computed_tokens // size
        first = num_full
        while first > 0 and self._blocks[table[first - 1]].key is None:
            first -= 1
        previous = self._blocks[table[first - 1]].key if first > 0 else None
        parent = self.root_key if previous is None else previous  # the scan stopped at a keyed block
        for i in range(first, num_full):
            block = self._blocks[table[i]]
            tokens = seq.token_ids[i * size : (i + 1) * size]
            key = block_key(parent, tokens)
            block.key = key
            # A block computed twice (two sequences with the same prefix admitted before
            # either finished it) keeps its key for chaining; the first one stays the entry.
            self._cache.setdefault(key, block.block_id)
            if self.lower is not None:
                self._new_full.append(FullBlock(block.block_id, key, tuple(tokens)))
            parent = key

    def take_new_full(self) -> list[FullBlock]:
        """The blocks keyed by computing them since the last call (for the lower tier to keep).
        Take them before the next ``allocate``/``append_slots``, which may reuse freed blocks."""
        out, self._new_full = self._new_full, []
        return out

    # ---- release -------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence (tail first) and clear its table.

        Freeing a sequence that holds no blocks does nothing.
        """
        if seq.seq_id not in self._holders:
            return
        self._check_held(seq)
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        del self._holders[seq.seq_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (e.g. n parallel samples of a prompt).

        The child must hold no blocks and start with the parent's computed tokens; it gets the
        parent's ``num_computed_tokens``. Writes into the shared last block copy it first.
        """
        self._check_held(parent)
        self._check_unheld(child)
        computed = parent.num_computed_tokens
        if parent.num_uncomputed_tokens > 1:
            raise ValueError(f"sequence {parent.seq_id} is still in prefill and cannot be forked")
        if child.num_tokens < computed or child.token_ids[:computed] != parent.token_ids[:computed]:
            raise ValueError(f"sequence {child.seq_id} does not start with the computed tokens of {parent.seq_id}")
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        self._holders[child.seq_id] = child

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll the sequence back to its first ``num_tokens`` tokens (rejected draft tokens).

        Blocks past the new end are released; the new last block, if no longer full and held
        by this sequence alone, loses its key because the next tokens overwrite its rows.
        Nothing is copied.
        """
        seq.truncate(num_tokens)
        if seq.seq_id not in self._holders:
            return
        keep = blocks_for(num_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        if num_tokens % self.block_size and len(seq.block_table) == keep:
            last = self._blocks[seq.block_table[-1]]
            if last.key is not None and last.ref_count == 1:
                self._drop_key(last)

    # ---- slots ---------------------------------------------------------------------------
    def slot(self, seq: Sequence, position: int) -> int:
        """The cache row of token ``position``: block id * block_size + offset in the block."""
        if not 0 <= position < len(seq.block_table) * self.block_size:
            raise IndexError(f"sequence {seq.seq_id} has no slot for position {position}")
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache rows of positions [start, end)."""
        return [self.slot(seq, p) for p in range(start, end)]

    # ---- internals -----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        # Keyless blocks first; only then evict the least recently freed cached block, whose
        # key must go with it (its rows are about to hold something else).
        if self._free_plain:
            block_id = self._free_plain.popleft()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)  # least recently freed
            self._drop_key(self._blocks[block_id])
        else:
            raise BlockAllocationError("no free KV block")
        self._blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.key is not None and self._cache.get(block.key) == block_id:
            self._free_cached[block_id] = None  # most recently used end
        else:
            block.key = None  # a duplicate of a cached block: nothing to find it by
            self._free_plain.append(block_id)

    def _drop_key(self, block: Block) -> None:
        if block.key is not None and self._cache.get(block.key) == block.block_id:
            del self._cache[block.key]
        block.key = None

    def _write_block_is_shared(self, seq: Sequence, num_new_tokens: int) -> bool:
        index = (seq.num_tokens - num_new_tokens) // self.block_size
        return index < len(seq.block_table) and self._blocks[seq.block_table[index]].ref_count > 1

    def _check_held(self, seq: Sequence) -> None:
        if self._holders.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks of this manager")

    def _check_unheld(self, seq: Sequence) -> None:
        if seq.seq_id in self._holders or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")

    def _check_write(self, seq: Sequence, num_new_tokens: int) -> None:
        self._check_held(seq)
        if not 1 <= num_new_tokens <= seq.num_uncomputed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}: {num_new_tokens} new tokens requested, "
                f"{seq.num_uncomputed_tokens} are not computed"
            )

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken rule (for tests and debugging)."""

        def fail(message: str) -> None:
            raise RuntimeError(f"block manager invariant broken: {message}")

        holds = [0] * self.num_blocks
        for seq_id, seq in self._holders.items():
            if seq.seq_id != seq_id:
                fail(f"holder {seq_id} is sequence {seq.seq_id}")
            if seq.num_computed_tokens > min(seq.num_tokens, len(seq.block_table) * self.block_size):
                fail(f"sequence {seq_id} has {seq.num_computed_tokens} computed tokens without slots")
            for block_id in seq.block_table:
                holds[block_id] += 1
            if self.enable_prefix_caching:
                for i in range(seq.num_computed_tokens // self.block_size):
                    if self._blocks[seq.block_table[i]].key is None:
                        fail(f"sequence {seq_id}: full computed block {seq.block_table[i]} has no key")
        for block in self._blocks:
            if block.ref_count != holds[block.block_id]:
                fail(f"block {block.block_id} has ref_count {block.ref_count}, held by {holds[block.block_id]} tables")
        plain, cached = list(self._free_plain), list(self._free_cached)
        free = plain + cached
        if len(set(free)) != len(free):
            fail("a block is on the free lists twice")
        if set(free) != {b.block_id for b in self._blocks if b.ref_count == 0}:
            fail("the free lists are not exactly the blocks with ref_count 0")
        for block_id in plain:
            if self._blocks[block_id].key is not None:
                fail(f"keyless free list holds keyed block {block_id}")
        for block_id in cached:
            key = self._blocks[block_id].key
            if key is None or self._cache.get(key) != block_id:
                fail(f"cached free block {block_id} is not the cache entry of its key")
        for key, block_id in self._cache.items():
            if self._blocks[block_id].key != key:
                fail(f"key {key} maps to block {block_id} whose key is {self._blocks[block_id].key}")
        if not self.enable_prefix_caching and (self._cache or cached):
            fail("prefix caching is off but blocks are cached")
