"""`PackAhead`: projections packed by worker threads before anyone asks, handed over once to
whoever builds them, and only for the very rows asked for."""

from __future__ import annotations

import numpy as np
import pytest
from llmlocal.native.cpu.bench_kernels import random_rows
from llmlocal.native.cpu.pack_ahead import PackAhead, run_key, type_runs
from llmlocal.native.cpu.qlayout import Q4_K, Q6_K, Q8_0, QuantRows, pack_rows

pytestmark = pytest.mark.skipif(pack_rows([random_rows(Q8_0, 32, 256, np.random.default_rng(0))]) is None,
                                reason="the native extension is not built")


def named(rows: QuantRows, name: str, order: np.ndarray | None = None) -> QuantRows:
    return QuantRows(rows.qtype, rows.raw, order, name=name)


def same_arrays(a, b) -> bool:
    return all((x is None and y is None) or np.array_equal(x, y) for x, y in
               ((a.codes, b.codes), (a.d, b.d), (a.m, b.m), (a.sc, b.sc), (a.mn, b.mn))) and (a.n, a.k) == (b.n, b.k)


def test_a_taken_run_is_what_pack_rows_makes_of_it_and_is_taken_once() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (named(random_rows(t, 64, 512, rng), f"blk.0.attn_{n}.weight") for t, n in ((Q4_K, "q"), (Q4_K, "k"), (Q6_K, "v")))
    down = named(random_rows(Q8_0, 96, 512, rng), "blk.0.ffn_down.weight")
    ahead = PackAhead([[q, k, v], [down]], workers=2, packed=None)
    try:
        assert ahead.untaken() == 3  # q and k share a matrix (one type), v another, down a third
        for run in type_runs([q, k, v]) + [[down]]:
            got = ahead.take(run)
            assert got is not None and same_arrays(got, pack_rows(run))
            assert ahead.take(run) is None  # handed over once: a second builder packs its own
        assert ahead.untaken() == 0
    finally:
        ahead.close()


def test_other_rows_of_the_same_tensor_are_not_taken() -> None:
    rng = np.random.default_rng(2)
    q = named(random_rows(Q4_K, 64, 256, rng), "blk.0.attn_q.weight")
    order = np.arange(64)[::-1].copy()
    ahead = PackAhead([[q]], workers=1)
    try:
        assert ahead.take([named(q, q.name, order)]) is None  # another row order
        assert ahead.take([QuantRows(q.qtype, q.raw)]) is None  # no name: nothing to match by
        assert ahead.take([named(q, "blk.1.attn_q.weight")]) is None
        assert ahead.untaken() == 1
        permuted = PackAhead([[named(q, q.name, order)]], workers=1)
        try:
            got = permuted.take([named(q, q.name, order.copy())])  # equal orders match
            assert got is not None and same_arrays(got, pack_rows([named(q, q.name, order)]))
        finally:
            permuted.close()
    finally:
        ahead.close()


def test_each_run_is_reported_packed_and_close_drops_the_rest() -> None:
    rng = np.random.default_rng(3)
    parts = [named(random_rows(Q8_0, 32, 256, rng), f"blk.{i}.ffn_down.weight") for i in range(6)]
    seen: list[str] = []
    ahead = PackAhead([[p] for p in parts], workers=1, packed=lambda run: seen.append(run[0].name))
    got = ahead.take([parts[5]])  # waits for its turn: every earlier run is packed by then
    assert got is not None and same_arrays(got, pack_rows([parts[5]]))
    assert seen[: len(parts)] == [p.name for p in parts]
    assert ahead.packed_anew == 1 and list(ahead.handed.values()) == [got]
    ahead.close()
    assert ahead.untaken() == 0 and ahead.take([parts[0]]) is None


def test_saved_runs_are_handed_out_without_packing() -> None:
    rng = np.random.default_rng(4)
    a, b = (named(random_rows(Q4_K, 32, 256, rng), f"blk.{i}.ffn_up.weight") for i in range(2))
    first = PackAhead([[a], [b]], workers=1)
    packed = {run_key([p]): first.take([p]) for p in (a, b)}
    first.close()
    seen: list[str] = []
    again = PackAhead([[a], [b]], workers=1, packed=lambda run: seen.append(run[0].name),
                      saved={run_key([a]): packed[run_key([a])]})
    try:
        assert again.take([a]) is packed[run_key([a])] and again.packed_anew == 0
        got = again.take([b])  # not saved: packed as before
        assert got is not None and same_arrays(got, packed[run_key([b])]) and again.packed_anew == 1
        assert seen == [b.name] and again.untaken() == 0
    finally:
        again.close()
