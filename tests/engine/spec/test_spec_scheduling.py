"""The scheduler's side of speculative decoding: draft tokens are verified in one item, trimmed
to the budget and the pool (never split, never a cause of preemption), and rolled back by
truncating block tables, with no block leaked."""

from __future__ import annotations

import random

from llmlocal.engine.core.block_manager import BlockManager
from llmlocal.engine.core.scheduler import Scheduler
from llmlocal.engine.core.sequence import Sequence, SequenceStatus, blocks_for

BS = 4


def shape(out) -> list[tuple[int, int, int, bool]]:
    return [(i.seq.seq_id, i.start, i.num_tokens, i.samples) for i in out.items]


def prefilled(sched: Scheduler, seq_id: int, prompt: list[int], first: int, max_tokens: int | None = None) -> Sequence:
    """Add a sequence and run its prefill alone (call before other sequences are running)."""
    assert not sched.running
    seq = Sequence(seq_id, prompt, max_tokens=max_tokens)
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, {i.seq.seq_id: first for i in out.items if i.samples})
    return seq


def prefilled_pair(sched: Scheduler, a: list[int], b: list[int]) -> tuple[Sequence, Sequence]:
    sa, sb = Sequence(1, a), Sequence(2, b)
    sched.add(sa)
    sched.add(sb)
    out = sched.schedule()
    assert all(i.samples for i in out.items)
    sched.update(out, {1: 100, 2: 200})
    return sa, sb


def test_accepted_prefix_is_kept_and_the_rest_rolled_back() -> None:
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    seq = prefilled(sched, 1, [1, 2, 3, 4, 5], first=6)  # 6 tokens, 5 computed
    seq.add_draft([7, 8, 9, 10])
    out = sched.schedule()
    assert shape(out) == [(1, 5, 5, True)]  # the last real token and 4 drafts, one item
    assert len(seq.block_table) == blocks_for(10, BS)
    sched.update(out, {1: 50}, accepted={1: 2})
    bm.check_invariants()
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 50]
    assert seq.num_computed_tokens == 8 and seq.num_draft_tokens == 0
    assert len(seq.block_table) == blocks_for(8, BS)  # the block of tokens 9-10 went back
    out = sched.schedule()
    assert shape(out) == [(1, 8, 1, True)]  # an ordinary decode of the resampled token


def test_all_rejected_and_all_accepted() -> None:
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    seq = prefilled(sched, 1, [1, 2, 3], first=4)
    seq.add_draft([5, 6])
    sched.update(sched.schedule(), {1: 40}, accepted={1: 0})
    assert seq.token_ids == [1, 2, 3, 4, 40] and seq.num_computed_tokens == 4
    seq.add_draft([41, 42, 43])
    sched.update(sched.schedule(), {1: 44}, accepted={1: 3})  # the bonus token after all 3
    assert seq.token_ids == [1, 2, 3, 4, 40, 41, 42, 43, 44] and seq.num_computed_tokens == 8
    bm.check_invariants()


def test_drafts_are_trimmed_to_the_budget_and_dropped_when_left_out() -> None:
    bm = BlockManager(32, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    a, b = prefilled_pair(sched, [1, 2], [9, 9])
    a.add_draft([10, 11, 12, 13, 14])  # 6 uncomputed tokens, budget 4
    b.add_draft([20])
    out = sched.schedule()
    assert shape(out) == [(1, 2, 4, True)]  # a keeps 3 drafts; b's turn is the next step
    assert a.num_draft_tokens == 3 and a.token_ids[-3:] == [10, 11, 12]
    assert b.num_draft_tokens == 0 and b.token_ids == [9, 9, 200]  # left out: drafts dropped
    sched.update(out, {1: 60}, accepted={1: 3})
    assert a.token_ids == [1, 2, 100, 10, 11, 12, 60]
    bm.check_invariants()


def test_drafts_never_preempt_another_sequence() -> None:
    bm = BlockManager(4, BS)  # 16 slots
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    a, b = prefilled_pair(sched, [1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 1, 1])  # 2 blocks each: full
    a.add_draft([9, 10, 11])  # would need a third block for a
    out = sched.schedule()
    assert not out.preempted and b.status is SequenceStatus.RUNNING
    assert a.num_draft_tokens == 0  # token 100 fills a's second block: no room for drafts
    assert shape(out) == [(1, 7, 1, True), (2, 6, 1, True)]
    sched.update(out, {1: 30, 2: 31})
    bm.check_invariants()


def test_random_speculation_keeps_tables_exact_and_leaks_nothing() -> None:
    rng = random.Random(7)
    bm = BlockManager(48, BS)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=80)
    expected: dict[int, list[int]] = {}
    seqs: list[Sequence] = []
    for i in range(10):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(2, 20))]
        seq = Sequence(i, prompt, max_tokens=rng.randrange(5, 40))
        sched.add(seq)
        seqs.append(seq)
        expected[i] = list(prompt)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 2000
        for seq in sched.running:
            if seq.num_uncomputed_tokens == 1 and rng.random() < 0.8:
                room = sched.token_limit(seq) - seq.num_tokens - 1
                k = min(rng.randrange(1, 6), room)
                if k > 0:
                    seq.add_draft([rng.randrange(50) for _ in range(k)])
        out = sched.schedule()
        sampled, accepted = {}, {}
        for item in out.items:
            seq = item.seq
            if not item.samples:
                continue
            k = seq.num_draft_tokens
            a = rng.randrange(k + 1)
            accepted[seq.seq_id] = a
            sampled[seq.seq_id] = 100 + rng.randrange(50)
            base = seq.num_tokens - k
            expected[seq.seq_id] = seq.token_ids[: base + a] + [sampled[seq.seq_id]]
        for seq_id in out.preempted:
            expected[seq_id] = sched.get(seq_id).token_ids[:]  # type: ignore[union-attr]
        sched.update(out, sampled, accepted=accepted)
        bm.check_invariants()
        for seq in sched.running:
            assert seq.token_ids == expected[seq.seq_id]
            assert seq.num_draft_tokens == 0
            # a block table holds exactly the slots of the tokens computed or to compute
            assert len(seq.block_table) == blocks_for(max(seq.num_computed_tokens, 1), BS) or (
                len(seq.block_table) == blocks_for(seq.num_tokens, BS)
            )
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.token_ids == expected[seq.seq_id]
        assert seq.num_completion_tokens <= seq.max_tokens  # type: ignore[operator]
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
