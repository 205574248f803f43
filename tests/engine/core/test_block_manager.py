"""BlockManager: exact block ids, prefix hits, copy-on-write, LRU eviction, truncation."""

from __future__ import annotations

import random

import pytest
from llmlocal.engine.core.block_manager import ROOT_KEY, BlockAllocationError, BlockManager, CopyOnWrite, block_key
from llmlocal.engine.core.sequence import Sequence, SequenceStatus

BS = 4  # small blocks keep the ids easy to follow


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and compute every uncomputed token (what one or more prefill steps do)."""
    bm.allocate(seq)
    bm.mark_computed(seq, seq.num_uncomputed_tokens)
    bm.check_invariants()


def decode(bm: BlockManager, seq: Sequence, token: int) -> CopyOnWrite | None:
    """Append a sampled token, give it a slot and compute it (one decode step)."""
    seq.append_token(token)
    copy = bm.append_slot(seq)
    bm.mark_computed(seq, 1)
    bm.check_invariants()
    return copy


def keys_of(token_ids: list[int], n_blocks: int) -> list[int]:
    keys, parent = [], ROOT_KEY
    for i in range(n_blocks):
        parent = block_key(parent, token_ids[i * BS : (i + 1) * BS])
        keys.append(parent)
    return keys


def test_fresh_pool_hands_out_ids_in_order_and_grows_at_block_boundaries() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = Sequence(1, toks(0, 10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert (a.num_computed_tokens, a.num_cached_tokens) == (0, 0)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5 and bm.usage == 3 / 8
    bm.mark_computed(a, 10)

    assert decode(bm, a, 10) is None and a.block_table == [0, 1, 2]  # position 10: block 2 has room
    assert decode(bm, a, 11) is None and a.block_table == [0, 1, 2]  # position 11: fills block 2
    assert decode(bm, a, 12) is None and a.block_table == [0, 1, 2, 3]  # position 12: a new block

    assert bm.slot(a, 0) == 0 and bm.slot(a, 5) == 1 * BS + 1 and bm.slot(a, 12) == 3 * BS
    assert bm.slots(a, 6, 10) == [6, 7, 8, 9]
    with pytest.raises(IndexError):
        bm.slot(a, 16)

    b = Sequence(2, toks(100, 5))
    bm.allocate(b)
    assert b.block_table == [4, 5]

    bm.free(a)  # freed tail first: keyless blocks queue up behind the never-used ones
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.free_block_ids() == [6, 7, 3, 2, 1, 0]
    c = Sequence(3, toks(200, 9))
    bm.allocate(c)
    assert c.block_table == [6, 7, 3]
    bm.free(b)
    bm.free(c)
    bm.free(c)  # freeing twice is harmless
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_full_blocks_get_chained_keys_once_computed() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence(1, toks(0, 10))
    bm.allocate(a)
    assert bm.num_cached_blocks == 0  # token ids alone do not make a block reusable
    bm.mark_computed(a, 5)  # a chunk: block 0 is full of computed tokens, block 1 is not
    k0, k1 = keys_of(a.token_ids, 2)
    assert bm.block(0).key == k0 and bm.block(1).key is None
    assert bm.lookup(k0) == 0 and bm.lookup(k1) is None
    bm.mark_computed(a, 5)
    assert bm.block(1).key == k1 and bm.lookup(k1) == 1
    assert bm.block(2).key is None  # partial block: never keyed
    bm.check_invariants()


def test_prefix_hits_between_two_requests_sharing_a_system_prompt() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    system = toks(1000, 8)
    a = Sequence(1, system + [1, 2, 3])
    b = Sequence(2, system + [7, 8, 9, 10, 11])

    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    bm.allocate(b)  # a's blocks are not computed yet: nothing to share
    assert b.block_table == [3, 4, 5, 6] and b.num_cached_tokens == 0
    bm.free(b)
    bm.mark_computed(a, a.num_tokens)

    b2 = Sequence(3, system + [7, 8, 9, 10, 11])
    bm.allocate(b2)
    assert b2.block_table[:2] == [0, 1]
    assert (b2.num_cached_tokens, b2.num_computed_tokens) == (8, 8)
    assert bm.block(0).ref_count == 2 and bm.block(1).ref_count == 2 and bm.block(2).ref_count == 1
    bm.check_invariants()
    bm.free(a)
    bm.free(b2)
    bm.check_invariants()
    assert bm.num_free_blocks == 10


def test_prefix_hits_across_turns_of_one_chat() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    turn1 = Sequence(1, toks(0, 10))
    prefill(bm, turn1)
    for t in range(500, 505):
        turn1.append_token(t)  # the sampled token of the previous step...
        if t != 504:  # ...computed by the next one; the last reply token never is
            bm.append_slot(turn1)
            bm.mark_computed(turn1, 1)
    assert turn1.num_tokens == 15 and turn1.num_computed_tokens == 14
    first_blocks = turn1.block_table[:3]  # positions 0..11: full and computed
    bm.free(turn1)

    turn2 = Sequence(2, turn1.token_ids + [900, 901, 902, 903, 904, 905])
    bm.allocate(turn2)
    assert turn2.block_table[:3] == first_blocks
    assert (turn2.num_cached_tokens, turn2.num_computed_tokens) == (12, 12)
    bm.free(turn2)
    bm.check_invariants()


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence(1, toks(0, 8))
    prefill(bm, a)
    assert bm.num_cached_blocks == 2

    b = Sequence(2, toks(0, 8))  # every token is in cached blocks
    bm.allocate(b)
    # NOTE: the last block is a miss so the runner computes >= 1 token, in a block of b's own.
    assert b.block_table == [0, 2]
    assert (b.num_computed_tokens, b.num_uncomputed_tokens) == (4, 4)
    bm.mark_computed(b, 4)
    assert bm.block(2).key == bm.block(1).key and bm.lookup(bm.block(1).key) == 1  # a duplicate
    bm.check_invariants()
    bm.free(b)
    # A duplicate is not the cache entry of its key: freed, it joins the keyless blocks.
    assert bm.block(2).key is None and bm.free_block_ids() == [3, 4, 5, 6, 7, 2]
    assert bm.num_cached_blocks == 2
    bm.free(a)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_fork_shares_blocks_and_copies_the_partial_block_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = Sequence(1, toks(0, 6))
    prefill(bm, parent)
    parent.append_token(60)  # sampled from the prompt's logits, not computed yet
    child = parent.fork(2)
    child.token_ids[-1] = 61  # its own sample
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and child.num_computed_tokens == 6
    assert bm.block(0).ref_count == 2 and bm.block(1).ref_count == 2
    bm.check_invariants()

    assert bm.can_append(parent)
    copy = bm.append_slot(parent)  # position 6 lies in block 1, shared and partly filled
    assert copy == CopyOnWrite(src=1, dst=2)
    assert parent.block_table == [0, 2] and bm.block(1).ref_count == 1
    assert bm.append_slot(child) is None  # block 1 is now child's alone
    assert child.block_table == [0, 1]
    bm.mark_computed(parent, 1)
    bm.mark_computed(child, 1)
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = Sequence(1, toks(0, 8))
    prefill(bm, parent)
    parent.append_token(80)
    child = parent.fork(2)
    bm.fork(parent, child)
    assert bm.append_slot(parent) is None and parent.block_table == [0, 1, 2]
    assert bm.append_slot(child) is None and child.block_table == [0, 1, 3]
    bm.free(child)
    bm.free(parent)
    bm.check_invariants()


def test_fork_validates_its_inputs() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = Sequence(1, toks(0, 6))
    bm.allocate(parent)
    with pytest.raises(ValueError, match="prefill"):
        bm.fork(parent, parent.fork(2))
    bm.mark_computed(parent, 6)
    with pytest.raises(ValueError, match="computed tokens"):
        bm.fork(parent, Sequence(3, toks(1, 6)))
    with pytest.raises(ValueError, match="already holds"):
        bm.fork(parent, parent)


def test_cached_blocks_are_evicted_least_recently_freed_first_tail_first() -> None:
    bm = BlockManager(num_blocks=7, block_size=BS)
    a = Sequence(1, toks(0, 9))
    b = Sequence(2, toks(100, 9))
    prefill(bm, a)  # blocks 0, 1 keyed; 2 holds one token
    prefill(bm, b)  # blocks 3, 4 keyed; 5 holds one token
    a_keys = keys_of(a.token_ids, 2)
    bm.free(a)
    bm.free(b)
    # Keyless blocks first (6 never used, then 2 and 5), then cached ones by LRU: a freed
    # before b, each tail first.
    assert bm.free_block_ids() == [6, 2, 5, 1, 0, 4, 3]
    assert bm.num_cached_blocks == 4

    c = Sequence(3, toks(200, 16))
    bm.allocate(c)
    assert c.block_table == [6, 2, 5, 1]  # evicts a's tail block only
    assert bm.lookup(a_keys[1]) is None and bm.lookup(a_keys[0]) == 0
    assert bm.block(1).key is None

    again = Sequence(4, toks(0, 9))  # a's prompt: its first block survived
    bm.allocate(again)
    assert again.block_table == [0, 4, 3]  # hit on 0, then evicts b's blocks, tail first
    assert again.num_computed_tokens == 4
    bm.check_invariants()
    bm.free(c)
    bm.free(again)
    bm.check_invariants()
    assert bm.num_free_blocks == 7


def test_reusing_a_cached_block_makes_it_most_recently_used() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence(1, toks(0, 5))
    b = Sequence(2, toks(100, 5))
    prefill(bm, a)  # [0, 1]
    prefill(bm, b)  # [2, 3]
    bm.free(a)
    bm.free(b)
    assert bm.free_block_ids() == [1, 3, 0, 2]  # keyless 1, 3; cached 0 then 2
    a2 = Sequence(3, toks(0, 5))
    bm.allocate(a2)  # hit on 0: off the free list
    assert a2.block_table == [0, 1] and bm.free_block_ids() == [3, 2]
    bm.free(a2)
    assert bm.free_block_ids() == [3, 1, 2, 0]  # 0 is now the most recently freed
    bm.check_invariants()


def test_truncate_releases_blocks_and_drops_the_key_of_a_block_no_longer_full() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = Sequence(1, toks(0, 5))
    prefill(bm, seq)
    seq.token_ids.extend(toks(50, 6))  # six draft tokens
    assert bm.append_slots(seq, 6) is None
    bm.mark_computed(seq, 6)
    assert seq.block_table == [0, 1, 2] and seq.num_computed_tokens == 11
    k1 = bm.block(1).key
    assert k1 is not None and bm.lookup(k1) == 1

    bm.truncate(seq, 6)  # keep the prompt and one accepted token
    assert seq.token_ids == toks(0, 5) + [50]
    assert seq.block_table == [0, 1] and seq.num_computed_tokens == 6
    assert bm.block(1).key is None and bm.lookup(k1) is None  # block 1 holds 2 of 4 tokens now
    assert bm.block(0).key is not None  # still full
    assert bm.free_block_ids()[-1] == 2
    bm.check_invariants()

    assert decode(bm, seq, 70) is None and seq.block_table == [0, 1]  # overwrite in place
    bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 8

    with pytest.raises(ValueError, match="prompt"):
        bm.truncate(Sequence(2, toks(0, 5)), 4)


def test_truncate_keeps_the_key_of_a_shared_block_and_the_write_copies_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = Sequence(1, toks(0, 5))
    prefill(bm, parent)
    for t in (50, 51, 52):
        decode(bm, parent, t)
    parent.append_token(53)  # 9 tokens, 8 computed: blocks 0 and 1 keyed
    child = parent.fork(2)
    bm.fork(parent, child)
    k1 = bm.block(1).key

    bm.truncate(parent, 6)  # block 1 is still full for the child: its key stays
    assert parent.block_table == [0, 1] and bm.lookup(k1) == 1
    copy = decode(bm, parent, 99)
    assert copy == CopyOnWrite(src=1, dst=2) and parent.block_table == [0, 2]
    assert bm.lookup(k1) == 1 and child.block_table == [0, 1]

    # Same again, but the other holder leaves before the write: the key goes at write time.
    bm.free(parent)
    other = child.fork(3)
    bm.fork(child, other)
    bm.truncate(child, 6)
    bm.free(other)
    assert bm.block(1).ref_count == 1 and bm.lookup(k1) == 1
    assert decode(bm, child, 98) is None and child.block_table == [0, 1]
    assert bm.lookup(k1) is None and bm.block(1).key is None
    bm.free(child)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_allocation_beyond_the_pool_is_refused_with_a_clear_error() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = Sequence(1, toks(0, 8))
    bm.allocate(a)
    b = Sequence(2, toks(100, 8))
    assert not bm.can_allocate(b)
    with pytest.raises(BlockAllocationError, match="needs 2 blocks and only 1 are free"):
        bm.allocate(b)
    bm.mark_computed(a, 8)
    a.append_token(8)
    assert bm.can_append(a)
    bm.append_slot(a)
    bm.mark_computed(a, 1)
    for t in range(9, 12):
        a.append_token(t)
        bm.append_slot(a)
        bm.mark_computed(a, 1)
    a.append_token(12)
    assert not bm.can_append(a)
    with pytest.raises(BlockAllocationError):
        bm.append_slot(a)
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate(a)
    bm.check_invariants()


def test_prefix_caching_off_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = Sequence(1, toks(0, 9))
    prefill(bm, a)
    b = Sequence(2, toks(0, 9))
    bm.allocate(b)
    assert b.block_table == [3, 4, 5] and b.num_computed_tokens == 0
    assert bm.num_cached_blocks == 0
    bm.free(a)
    bm.free(b)
    bm.check_invariants()


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = Sequence(1, toks(0, 3))
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.append_slot(seq)
    bm.allocate(seq)
    with pytest.raises(ValueError, match="not computed"):
        bm.append_slots(seq, 4)
    with pytest.raises(ValueError, match="cannot mark"):
        bm.mark_computed(seq, 4)
    with pytest.raises(ValueError):
        Sequence(2, [])
    with pytest.raises(ValueError):
        Sequence(2, [1], max_tokens=0)
    assert seq.status is SequenceStatus.WAITING  # the block manager never moves status


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_every_row_right(seed: int) -> None:
    """Allocate, chunked prefill, decode with draft tokens and rollback, fork and free at
    random; every cache row read must hold the K/V of the reader's own prefix."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=BS)
    rows: dict[int, tuple[int, ...]] = {}  # slot -> the prefix its K/V were computed for
    live: list[Sequence] = []
    bases = [[rng.randrange(50) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    history: list[list[int]] = []  # computed prefixes, rejected drafts included: a stale key shows
    next_id = 0

    def compute(seq: Sequence, n: int) -> None:
        copy = bm.append_slots(seq, seq.num_uncomputed_tokens)
        if copy is not None:
            for r in range(BS):
                if copy.src * BS + r in rows:
                    rows[copy.dst * BS + r] = rows[copy.src * BS + r]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            rows[bm.slot(seq, pos)] = tuple(seq.token_ids[: pos + 1])
        bm.mark_computed(seq, n)
        history.append(seq.token_ids[: seq.num_computed_tokens])
        for pos in range(seq.num_computed_tokens):
            assert rows.get(bm.slot(seq, pos)) == tuple(seq.token_ids[: pos + 1]), (seq.seq_id, pos)

    for _ in range(3000):
        op = rng.random()
        if op < 0.2 and len(live) < 8:
            start = rng.choice(history) if history and rng.random() < 0.3 else rng.choice(bases)
            seq = Sequence(next_id, start + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
            next_id += 1
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
        elif op < 0.75 and live:
            seq = rng.choice(live)
            if seq.num_uncomputed_tokens > 1:  # the next chunk of a prefill
                compute(seq, rng.randrange(1, seq.num_uncomputed_tokens + 1))
            else:  # a decode, verifying k draft tokens, of which some are rejected
                if seq.num_uncomputed_tokens == 0:
                    seq.append_token(rng.randrange(50))
                drafts = rng.randrange(4)
                seq.token_ids.extend(rng.randrange(50) for _ in range(drafts))
                if bm.can_append(seq, seq.num_uncomputed_tokens):
                    compute(seq, seq.num_uncomputed_tokens)
                    bm.truncate(seq, seq.num_tokens - rng.randrange(drafts + 1))
                else:
                    bm.truncate(seq, seq.num_tokens - drafts)
        elif op < 0.85 and live:
            parent = rng.choice(live)
            if parent.num_uncomputed_tokens <= 1:
                child = parent.fork(next_id)
                next_id += 1
                if child.num_uncomputed_tokens == 1:
                    child.token_ids[-1] = rng.randrange(50)
                bm.fork(parent, child)
                live.append(child)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants()

    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_uncached_prefix_starts_at_the_first_full_block_the_pool_lacks() -> None:
    bm = BlockManager(16, BS)
    seq = Sequence(1, toks(0, 2 * BS + 1))  # two full blocks computed and cached
    prefill(bm, seq)
    longer = toks(0, 5 * BS + 2)  # the same two blocks, then three more full ones, then the last token's
    keys = keys_of(longer, 5)
    assert [k for k, _ in bm.uncached_prefix(longer)] == keys[2:]
    assert [t for _, t in bm.uncached_prefix(longer)] == [longer[i * BS : (i + 1) * BS] for i in range(2, 5)]
    assert bm.uncached_prefix(toks(0, 2 * BS + 1)) == []  # every full block before the last token's is cached
