"""Scheduler: chunked prefill, admission, preemption and recompute, limits, and a random run
checked against a fake KV cache that records which prefix each slot was computed for."""

from __future__ import annotations

import random

import pytest
from llmlocal.engine.core.block_manager import BlockManager, CopyOnWrite
from llmlocal.engine.core.scheduler import RequestTooLargeError, ScheduledSeq, Scheduler, SchedulerOutput
from llmlocal.engine.core.sequence import Sequence, SequenceStatus

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def shape(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    return [(i.seq.seq_id, i.start, i.num_tokens, i.samples) for i in out.items]


def step(sched: Scheduler, tokens: dict[int, int], stopped: tuple[int, ...] = ()) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    sampled = {i.seq.seq_id: tokens[i.seq.seq_id] for i in out.items if i.samples}
    finished = sched.update(out, sampled, stopped)
    sched.block_manager.check_invariants()
    return out, finished


def test_long_prompt_is_chunked_and_decodes_run_in_the_same_steps() -> None:
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_num_batched_tokens=8)
    a = Sequence(1, toks(0, 3), max_tokens=10)
    sched.add(a)
    out = sched.schedule()
    assert shape(out) == [(1, 0, 3, True)] and out.num_batched_tokens == 3
    assert out.items[0].token_ids == [0, 1, 2]
    sched.update(out, {1: 100})

    b = Sequence(2, toks(100, 20), max_tokens=2)
    sched.add(b)
    out = sched.schedule()
    assert shape(out) == [(1, 3, 1, True), (2, 0, 7, False)] and out.num_batched_tokens == 8
    assert out.num_decodes == 1 and out.decodes[0].seq is a and out.prefills[0].seq is b
    sched.update(out, {1: 101})
    out, _ = step(sched, {1: 102})
    assert shape(out) == [(1, 4, 1, True), (2, 7, 7, False)]
    out, _ = step(sched, {1: 103, 2: 200})
    assert shape(out) == [(1, 5, 1, True), (2, 14, 6, True)] and out.num_batched_tokens == 7
    out, finished = step(sched, {1: 104, 2: 201})
    assert shape(out) == [(1, 6, 1, True), (2, 20, 1, True)]
    assert finished == [b] and b.finish_reason == "length" and b.status is SequenceStatus.FINISHED
    assert b.token_ids == toks(100, 20) + [200, 201] and b.block_table == []
    assert a.token_ids == toks(0, 3) + [100, 101, 102, 103, 104]


def test_tail_alone_computes_a_prompts_last_rows_as_a_prefix_cache_hit_would() -> None:
    # 11 tokens, blocks of 4: a hit covers the blocks before the one holding the last token (8
    # tokens), and computes 8..10; with tail_alone a cold prompt stops at 8 and runs 8..10 next
    for tail_alone, want in ((False, [[(1, 0, 11, True)]]), (True, [[(1, 0, 8, False)], [(1, 8, 3, True)]])):
        sched = Scheduler(BlockManager(64, BS), max_num_batched_tokens=64, tail_alone=tail_alone)
        sched.add(Sequence(1, toks(0, 11), max_tokens=4))
        got = [shape(step(sched, {1: 100})[0]) for _ in want]
        assert got == want
        assert shape(step(sched, {1: 101})[0]) == [(1, 11, 1, True)]  # then decoding as ever
    # the same tokens again: the hit's rows are the cold run's second chunk
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=64, tail_alone=True)
    sched.add(Sequence(1, toks(0, 11), max_tokens=1))
    while sched.running or sched.waiting:
        step(sched, {1: 100})
    sched.add(Sequence(2, toks(0, 11), max_tokens=1))
    assert shape(step(sched, {2: 100})[0]) == [(2, 8, 3, True)]
    # a prompt of whole blocks: a hit computes its last block; chunks cut by the budget keep to it
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=1, max_num_batched_tokens=6, tail_alone=True)
    sched.add(Sequence(3, toks(0, 12), max_tokens=1))
    assert [shape(step(sched, {3: 100})[0]) for _ in range(3)] == [[(3, 0, 6, False)], [(3, 6, 2, False)], [(3, 8, 4, True)]]


def test_waiting_request_is_admitted_when_blocks_free_up() -> None:
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_batched_tokens=64)
    a = Sequence(1, toks(0, 16), max_tokens=1)
    b = Sequence(2, toks(100, 12), max_tokens=1)
    sched.add(a)
    sched.add(b)
    out, finished = step(sched, {1: 7})
    assert shape(out) == [(1, 0, 16, True)]  # b needs 3 blocks, 2 are free
    assert finished == [a] and sched.num_waiting == 1
    assert bm.free_block_ids() == [4, 5, 3, 2, 1, 0]  # a's four blocks stay cached
    out, finished = step(sched, {2: 8})
    assert shape(out) == [(2, 0, 12, True)]
    assert finished == [b] and b.num_tokens == 13
    assert not sched.has_unfinished() and bm.num_free_blocks == 6


def test_a_request_waits_for_the_prompt_blocks_a_running_prefill_is_computing() -> None:
    # a and b share three blocks (a system prompt) and arrive together; c shares nothing
    a, b = Sequence(1, toks(0, 12) + [500, 501], max_tokens=2), Sequence(2, toks(0, 12) + [600, 601, 602], max_tokens=1)
    c = Sequence(3, toks(100, 5), max_tokens=1)
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_num_batched_tokens=8)
    for seq in (a, b, c):
        sched.add(seq)
    assert shape(step(sched, {})[0]) == [(1, 0, 8, False)]
    # a computes block 2 now, so b waits for it (it would compute 8..9 beside a); c goes ahead
    assert shape(step(sched, {1: 7, 3: 0})[0]) == [(1, 8, 6, True), (3, 0, 2, False)]
    assert b.status is SequenceStatus.WAITING
    out, _ = step(sched, {1: 7, 2: 8, 3: 0})
    assert shape(out) == [(1, 14, 1, True), (3, 2, 3, True), (2, 12, 3, True)]
    assert b.num_cached_tokens == 12  # every shared block computed once, by a

    # without the prefix cache there is nothing to wait for: b computes the shared rows itself
    a, b = Sequence(1, toks(0, 12) + [500, 501], max_tokens=2), Sequence(2, toks(0, 12) + [600, 601, 602], max_tokens=1)
    sched = Scheduler(BlockManager(64, BS, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched, {})
    assert shape(step(sched, {1: 7})[0]) == [(1, 8, 6, True), (2, 0, 2, False)]

    # the sharer cancelled: the waiting request is admitted with what it had computed
    a, b = Sequence(1, toks(0, 12) + [500, 501], max_tokens=2), Sequence(2, toks(0, 12) + [600, 601, 602], max_tokens=1)
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_num_batched_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched, {})
    sched.abort(1)
    assert shape(step(sched, {2: 8})[0]) == [(2, 8, 7, True)] and b.num_cached_tokens == 8


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=2, max_num_batched_tokens=16)
    seqs = [Sequence(i, toks(10 * i, 2), max_tokens=2) for i in (1, 2, 3)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched, {1: 0, 2: 0})
    assert [i.seq.seq_id for i in out.items] == [1, 2] and sched.num_running == 2
    out, finished = step(sched, {1: 0, 2: 0})
    assert [i.seq.seq_id for i in out.items] == [1, 2] and finished == seqs[:2]
    out, finished = step(sched, {3: 0})
    assert shape(out) == [(3, 0, 2, True)]


def test_preempts_the_newest_under_pressure_and_recomputes_it_later() -> None:
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    a = Sequence(1, toks(0, 4), max_tokens=8)
    b = Sequence(2, toks(100, 4), max_tokens=8)
    sched.add(a)
    sched.add(b)
    streams = {1: iter(range(1000, 2000)), 2: iter(range(2000, 3000))}

    def run() -> tuple[SchedulerOutput, list[Sequence]]:
        out = sched.schedule()
        finished = sched.update(out, {i.seq.seq_id: next(streams[i.seq.seq_id]) for i in out.items if i.samples})
        bm.check_invariants()
        return out, finished

    out, _ = run()
    assert shape(out) == [(1, 0, 4, True), (2, 0, 4, True)]
    assert (a.block_table, b.block_table) == ([0], [1])
    for _ in range(4):  # positions 4..7: each takes its second block, then fills it
        out, _ = run()
        assert out.preempted == []
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3]) and bm.num_free_blocks == 0

    out, _ = run()  # a needs a third block: b, the newest, gives its blocks back
    assert out.preempted == [2] and shape(out) == [(1, 8, 1, True)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.token_ids == toks(100, 4) + toks(2000, 5)
    assert a.block_table == [0, 2, 3]  # b's tail block was the least recently freed
    assert sched.waiting == [b]

    out, _ = run()  # b would need 3 blocks (one cached); only its cached block is free
    assert shape(out) == [(1, 9, 1, True)] and out.preempted == []
    out, finished = run()
    assert finished == [a] and a.finish_reason == "length"
    assert a.token_ids == toks(0, 4) + toks(1000, 8)

    out, _ = run()  # b is recomputed: its first block is still cached
    assert shape(out) == [(2, 4, 5, True)] and b.num_cached_tokens == 4
    assert b.block_table == [1, 3, 2]
    out, _ = run()
    out, finished = run()
    assert finished == [b] and b.token_ids == toks(100, 4) + toks(2000, 8)
    assert bm.num_free_blocks == 4 and not sched.has_unfinished()


def test_recomputed_prefill_follows_the_decodes_in_the_output() -> None:
    bm = BlockManager(5, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    a = Sequence(1, toks(0, 8), max_tokens=2)
    b = Sequence(2, toks(100, 8), max_tokens=5)
    c = Sequence(3, toks(200, 3), max_tokens=1)
    for s in (a, b):
        sched.add(s)
    step(sched, {1: 0, 2: 0})  # a [0, 1], b [2, 3] + token 8 each
    out, _ = step(sched, {1: 0, 2: 0})  # a takes block 4 and finishes; b preempted for it
    assert out.preempted == [2] and shape(out) == [(1, 8, 1, True)]
    sched.add(c)
    out, _ = step(sched, {2: 1, 3: 1})
    assert shape(out) == [(2, 0, 9, True), (3, 0, 3, True)]  # b first: preempted ones lead


def test_too_large_request_is_rejected_at_add_with_the_numbers() -> None:
    sched = Scheduler(BlockManager(32, 16))
    with pytest.raises(RequestTooLargeError, match="needs 40 KV blocks of 16 tokens .* has 32") as err:
        sched.add(Sequence(1, toks(0, 600), max_tokens=40))
    assert (err.value.blocks_needed, err.value.num_blocks, err.value.block_size) == (40, 32, 16)
    with pytest.raises(RequestTooLargeError, match="needs 38 KV blocks"):
        sched.add(Sequence(2, toks(0, 600)))  # no max_tokens: the prompt alone does not fit
    sched.add(Sequence(3, toks(0, 500), max_tokens=13))  # 512 slots: exactly the pool
    with pytest.raises(RequestTooLargeError):
        sched.add(Sequence(4, toks(0, 500), max_tokens=14))
    unbounded = Sequence(5, toks(0, 500))
    sched.add(unbounded)
    assert sched.token_limit(unbounded) == 513  # stops when its K/V fill the pool
    assert sched.has_unfinished() and sched.num_waiting == 2

    ctx = Scheduler(BlockManager(32, 16), max_model_len=100)
    with pytest.raises(RequestTooLargeError, match="prompt has 100 tokens and the context holds 100"):
        ctx.add(Sequence(1, toks(0, 100)))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(Sequence(3, [1]))


def test_stop_and_context_limits_finish_sequences() -> None:
    sched = Scheduler(BlockManager(16, BS), max_model_len=8)
    a = Sequence(1, toks(0, 6))
    b = Sequence(2, toks(100, 2), max_tokens=50)
    sched.add(a)
    sched.add(b)
    _, finished = step(sched, {1: 0, 2: 0}, stopped=(2,))
    assert finished == [b] and b.finish_reason == "stop" and b.num_tokens == 3
    _, finished = step(sched, {1: 1})
    assert finished == [a] and a.finish_reason == "context" and a.num_tokens == 8


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=8)
    a = Sequence(1, toks(0, 5), max_tokens=4)
    b = Sequence(2, toks(100, 5), max_tokens=4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert bm.num_used_blocks == 2
    assert sched.abort(2) is b and b.finish_reason == "cancelled" and sched.waiting == []
    assert sched.abort(1) is a and a.status is SequenceStatus.FINISHED and a.block_table == []
    assert bm.num_used_blocks == 0 and sched.abort(1) is None
    assert sched.update(out, {1: 9}) == []  # the step of an aborted sequence is dropped
    assert a.num_tokens == 5 and not sched.has_unfinished()
    bm.check_invariants()
    assert sched.schedule().is_empty


def test_update_checks_the_runner_answers() -> None:
    sched = Scheduler(BlockManager(8, BS))
    sched.add(Sequence(1, toks(0, 5)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})
    with pytest.raises(ValueError, match="not sampling"):
        sched.update(out, {1: 0, 7: 0})
    with pytest.raises(ValueError, match="without a sampled token"):
        sched.update(out, {}, stopped=(1,))
    sched.update(out, {1: 0})
    with pytest.raises(ValueError, match="already applied"):
        sched.update(out, {1: 0})
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        Scheduler(BlockManager(8, BS), max_num_seqs=8, max_num_batched_tokens=4)


def test_fork_runs_a_sibling_that_copies_the_shared_partial_block() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    parent = Sequence(1, toks(0, 6), max_tokens=3)
    sched.add(parent)
    step(sched, {1: 60})
    assert sched.can_fork(parent)
    child = parent.fork(2)
    child.token_ids[-1] = 61
    sched.fork(parent, child)
    assert child.block_table == parent.block_table == [0, 1]
    out = sched.schedule()
    assert shape(out) == [(1, 6, 1, True), (2, 6, 1, True)]
    assert out.copies == [CopyOnWrite(src=1, dst=2)] and parent.block_table == [0, 2]
    sched.update(out, {1: 70, 2: 71})
    _, finished = step(sched, {1: 80, 2: 81})
    assert finished == [parent, child]
    assert parent.completion_token_ids == [60, 70, 80] and child.completion_token_ids == [61, 71, 81]
    assert bm.num_free_blocks == 8


def test_kv_figures() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(bm)
    assert sched.kv_waste() == 0.0
    sched.add(Sequence(1, toks(0, 5)))
    sched.add(Sequence(2, toks(100, 4)))
    sched.schedule()
    assert (sched.kv_blocks_used, sched.kv_blocks_total) == (3, 8)
    assert sched.kv_waste() == pytest.approx(3 / 12)  # 12 slots hold 9 tokens


# ---- a random run against a fake KV cache ------------------------------------------------


class FakeKV:
    """Stands in for the runner: each slot records the prefix whose last token it was computed
    for, so a read that meets a wrong, stale or missing row is caught."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.rows: dict[int, tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput) -> None:
        size = self.bm.block_size
        for copy in out.copies:  # before any write, like the runner
            for r in range(size):
                if copy.src * size + r in self.rows:
                    self.rows[copy.dst * size + r] = self.rows[copy.src * size + r]
        for item in out.items:
            seq = item.seq
            for pos in range(item.start, item.end):
                self.rows[self.bm.slot(seq, pos)] = tuple(seq.token_ids[: pos + 1])
        for item in out.items:  # attention reads every earlier position of each sequence
            seq = item.seq
            for pos in range(item.end):
                assert self.rows.get(self.bm.slot(seq, pos)) == tuple(seq.token_ids[: pos + 1]), (
                    f"seq {seq.seq_id} reads a wrong row at position {pos}"
                )


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_batched_tokens == sum(i.num_tokens for i in out.items) <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    ids = [i.seq.seq_id for i in out.items]
    assert len(ids) == len(set(ids))
    sizes = [i.num_tokens for i in out.items]
    assert sizes == sorted(sizes, key=lambda n: n > 1)  # one-token items first
    for item in out.items:
        assert isinstance(item, ScheduledSeq) and item.seq.status is SequenceStatus.RUNNING
        assert item.start == item.seq.num_computed_tokens and item.num_tokens >= 1
        assert item.samples == (item.end == item.seq.num_tokens)
        assert len(item.seq.block_table) * sched.block_manager.block_size >= item.seq.num_tokens
    for seq_id in out.preempted:
        seq = sched.get(seq_id)
        assert seq is not None and seq.status is SequenceStatus.WAITING and seq.block_table == []


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_requests_all_finish_without_leaks(seed: int, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    bm = BlockManager(40, BS, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24)
    kv = FakeKV(bm)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    pending: list[Sequence] = []
    for seq_id in range(80):
        prompt = rng.choice(systems + [[]]) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        max_tokens = rng.choice([None, rng.randrange(1, 25)])
        pending.append(Sequence(seq_id, prompt, max_tokens=max_tokens))
    pending.append(Sequence(1000, [1] * (40 * BS - 20), max_tokens=20))  # the whole pool: waits for it
    rng.shuffle(pending)
    next_id = 2000
    done: list[Sequence] = []
    preemptions = hits = forks = 0

    for _ in range(5000):
        for _ in range(rng.randrange(3)):
            if pending:
                sched.add(pending.pop())
        if rng.random() < 0.02 and sched.running:
            victim = rng.choice(sched.running + sched.waiting)
            done.append(sched.abort(victim.seq_id))  # type: ignore[arg-type]
        out = sched.schedule()
        check_output(sched, out)
        if prefix_caching:  # no prompt block is computed by two sequences in one step
            written = [tuple(i.seq.token_ids[: (b + 1) * BS]) for i in out.items
                       for b in range(i.start // BS, min(i.end, i.seq.num_prompt_tokens) // BS)]
            assert len(written) == len(set(written)), "two sequences computed the same prompt block"
        preemptions += len(out.preempted)
        hits += sum(1 for i in out.items if i.seq.num_cached_tokens and i.start == i.seq.num_cached_tokens)
        kv.run(out)
        sampled = {i.seq.seq_id: rng.randrange(1000) for i in out.items if i.samples}
        stopped = [s for s in sampled if rng.random() < 0.05]
        done.extend(sched.update(out, sampled, stopped))
        bm.check_invariants()
        for item in out.items:  # now and then, a parallel sample of a freshly prefilled prompt
            parent = item.seq
            if item.samples and parent.num_completion_tokens == 1 and sched.can_fork(parent) and rng.random() < 0.3:
                child = parent.fork(next_id)
                child.token_ids[-1] = rng.randrange(1000)
                next_id += 1
                sched.fork(parent, child)
                forks += 1
        if not pending and not sched.has_unfinished():
            break
    else:
        pytest.fail("requests still unfinished after 5000 steps")

    assert bm.num_used_blocks == 0 and sched.kv_blocks_used == 0
    bm.check_invariants()
    for seq in done:
        assert seq.status is SequenceStatus.FINISHED and seq.block_table == []
        if seq.max_tokens is not None:
            assert seq.num_completion_tokens <= seq.max_tokens
        if seq.finish_reason == "length":
            assert seq.num_completion_tokens == seq.max_tokens
    assert any(s.seq_id == 1000 and s.finish_reason in ("length", "stop", "cancelled") for s in done)
    assert preemptions > 0 and forks > 0
    assert (hits > 0) == prefix_caching
