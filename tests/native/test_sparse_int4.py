"""Sparse INT4 GEMV: the packed layout against the engine's INT4 form, the C kernels against the
numpy reference on every ISA path this machine has, with 1 and 2 threads.

Tolerance: the kernels accumulate in fp32, in an order (per group: column after column, then
group after group) that numpy does not reproduce, so they are compared with the float64
reference through `reference.error_bound`: (2 * 32 + K / 32 + 4) * eps_fp32 * sum |terms| per
output, the classic bound of recursive fp32 summation. One column read wrongly or skipped
moves an output by ~ sum |terms| / K, well above that bound for every K here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from llmlocal.engine.model.gguf_tensors import GGUFTensors
from llmlocal.engine.model.linear import int4_dequantize
from llmlocal.models import resolve
from llmlocal.native import cpu as si4
from llmlocal.native.cpu import PackedInt4, SparseInt4Linear, pack_int4
from llmlocal.native.cpu import linear as linear_module
from llmlocal.native.cpu.reference import (
    FP32_EPS,
    error_bound,
    gemv_reference,
    kept_columns,
)

# (N, K): N not a multiple of 32 / 128 (the chunk and the thread unit), K not of 128 / 256
SHAPES = [(1, 32), (33, 64), (100, 96), (200, 576), (576, 576), (1000, 1536)]
SPARSITY = [None, 0.0, 0.5, 0.95, 1.0]  # None: dense; else the quantile of |x| used as threshold


@pytest.fixture(params=["1", "2-by-groups", "2-by-rows"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """1 or 2 threads; 2 threads split a call by groups of columns or by rows."""
    n = int(request.param[0])
    before = si4.num_threads()
    si4.set_num_threads(n)
    k = si4.kernels()
    min_part = k.min_part_bytes()
    k.set_min_part_bytes(0)  # split even the smallest matrix between the threads
    k.set_split_mode(0 if request.param == "2-by-rows" else 1)
    yield n
    k.set_split_mode(2)
    k.set_min_part_bytes(min_part)
    si4.set_num_threads(before)


def q4_1_like(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scale, zero as GGUFTensors.int4 returns them for Q4_1: d, m fp16, zero = m + 8 d."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d = rng.uniform(0.002, 0.03, (n, k // 32)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0.0, 0.2, (n, k // 32)).astype(np.float16).astype(np.float32)
    return codes, d, m + np.float32(8.0) * d


def q4_k_like(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """As for Q4_K: scale = d * sc, zero = 8 scale - dmin * mn, 6-bit sc, mn per 32, fp16 d, dmin per 256."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    g = k // 32
    d = np.repeat(rng.uniform(1e-4, 1e-3, (n, -(-g // 8))).astype(np.float16).astype(np.float32), 8, axis=1)[:, :g]
    dmin = np.repeat(rng.uniform(1e-4, 1e-3, (n, -(-g // 8))).astype(np.float16).astype(np.float32), 8, axis=1)[:, :g]
    scale = d * rng.integers(1, 64, (n, g)).astype(np.float32)
    return codes, scale, np.float32(8.0) * scale - dmin * rng.integers(0, 64, (n, g)).astype(np.float32)


def activations(rng: np.random.Generator, batch: int, k: int) -> np.ndarray:
    """Heavy-tailed inputs with exact zeros and whole zero groups, so groups are ragged."""
    x = (rng.standard_normal((batch, k)) * rng.exponential(1.0, (batch, k))).astype(np.float32)
    x[rng.random((batch, k)) < 0.05] = 0.0
    if k >= 96:
        x[:, 32:64] = 0.0
    return x


def threshold_for(x: np.ndarray, sparsity: float | None) -> float | None:
    if sparsity is None:
        return None
    if sparsity == 1.0:
        return float(np.abs(x).max())
    return float(np.quantile(np.abs(x), sparsity)) if sparsity > 0 else 0.0


def check(lin: SparseInt4Linear, source: tuple[np.ndarray, ...], x: np.ndarray, t: float | None) -> None:
    y = lin(x, t)
    ref = gemv_reference(*source, 32, x, t)
    bound = error_bound(lin.packed, x, t)
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound), f"max error / bound = {np.max(err / np.maximum(bound, 1e-300)):.3g}"
    assert lin.kept_columns == int(kept_columns(x, t).sum())


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("form", ["q4_1", "q4_k"])
def test_repacked_weights_dequantize_exactly_to_int4_dequantize(n: int, k: int, form: str) -> None:
    rng = np.random.default_rng(n * k)
    codes, scale, zero = (q4_1_like if form == "q4_1" else q4_k_like)(rng, n, k)
    packed = pack_int4(codes, scale, zero)
    assert packed.sz.dtype == (np.float16 if form == "q4_1" else np.float32)
    assert packed.codes.ctypes.data % 4096 == 0 and packed.codes.shape == (k, -(-n // 32) * 16)
    np.testing.assert_array_equal(packed.unpack_codes(), codes)
    ref = int4_dequantize(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero), 32).numpy()
    np.testing.assert_array_equal(packed.dequantize(), ref)


def test_starter_model_q4_1_tensors_repack_exactly_in_fp16() -> None:
    tensors = GGUFTensors(resolve("smollm2-135m").spec)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_up.weight"):
        w = tensors.int4(name)
        packed = pack_int4(w.codes, w.scale, w.zero, w.group_size)
        assert packed.sz_f16, name  # Q4_1's d and m are fp16 values: 20 bytes per 32 weights
        assert packed.nbytes == w.codes.size // 2 + w.codes.size // 32 * 4
        ref = int4_dequantize(*(torch.from_numpy(a) for a in (w.codes, w.scale, w.zero)), 32).numpy()
        np.testing.assert_array_equal(packed.dequantize(), ref)
        np.testing.assert_array_equal(packed.dequantize(), tensors.float32(name))


def test_pack_rejects_malformed_input() -> None:
    codes = np.zeros((4, 64), dtype=np.uint8)
    ones = np.ones((4, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="multiple of the group size"):
        pack_int4(codes[:, :48], ones, ones)
    with pytest.raises(ValueError, match="must both be"):
        pack_int4(codes, ones[:, :1], ones)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(codes + 16, ones, ones)
    packed = pack_int4(codes, ones, ones)
    with pytest.raises(ValueError, match="not a packed INT4 matrix"):
        PackedInt4(packed.codes[:, :8], packed.sz, 4, 64, 32)


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("n, k", SHAPES)
def test_gemv_matches_reference(isa: str, threads: int, n: int, k: int) -> None:
    rng = np.random.default_rng(7 + n + k)
    for form in (q4_1_like, q4_k_like):
        source = form(rng, n, k)
        lin = SparseInt4Linear.from_codes(*source)
        x = activations(rng, 1, k)[0]
        for sparsity in SPARSITY:
            check(lin, source, x, threshold_for(x, sparsity))


@pytest.mark.parametrize("sparsity", [None, 0.5])
def test_batched_rows_equal_each_row_alone_on_every_isa(sparsity: float | None) -> None:
    """On every ISA path a row's y is the same floats whatever rows share its call (a decode row
    beside a prompt's tail, drafted tokens under verification): each code's term is one FMA at
    every batch size (a one-row table lookup on AVX-512 once rounded the product first)."""
    rng = np.random.default_rng(11)
    source = q4_k_like(rng, 200, 576)
    lin = SparseInt4Linear.from_codes(*source)
    x = activations(rng, 8, 576)
    t = threshold_for(x, sparsity)
    before = si4.isa()
    try:
        for path in si4.available_isas():
            si4.set_isa(path)
            alone = np.stack([lin(x[b], t) for b in range(8)])
            for batch in (2, 3, 5, 8):
                np.testing.assert_array_equal(lin(x[:batch], t), alone[:batch], err_msg=f"{path}, {batch} rows")
    finally:
        si4.set_isa(before)


def test_sparsity_is_reported_and_full_sparsity_gives_zero(isa: str) -> None:
    rng = np.random.default_rng(3)
    source = q4_1_like(rng, 200, 576)
    lin = SparseInt4Linear.from_codes(*source)
    x = activations(rng, 1, 576)[0]
    lin(x)
    assert lin.kept_columns == 576 and lin.sparsity == 0.0  # dense reads every column, zeros too
    lin(x, 0.0)
    assert lin.kept_columns == int(np.count_nonzero(x)) < 576 - 32
    y = lin(x, float(np.abs(x).max()))
    assert lin.kept_columns == 0 and lin.sparsity == 1.0
    np.testing.assert_array_equal(y, np.zeros(200, dtype=np.float32))


@pytest.mark.parametrize("batch", [2, 3, 5, 8, 11])
def test_batch_reads_the_union_of_the_rows_columns(isa: str, threads: int, batch: int) -> None:
    rng = np.random.default_rng(batch)
    n, k = 300, 576
    source = q4_k_like(rng, n, k)
    lin = SparseInt4Linear.from_codes(*source)
    x = activations(rng, batch, k)
    x[0] *= 4.0  # rows of different scales keep different numbers of inputs
    for sparsity in (None, 0.5, 0.95):
        t = threshold_for(x[1], sparsity)
        if batch <= 8:
            check(lin, source, x, t)  # kept_columns: the union over the rows
        else:  # in chunks of 8 rows
            err = np.abs(lin(x, t) - gemv_reference(*source, 32, x, t))
            assert np.all(err <= error_bound(lin.packed, x, t))
        last = x[(batch - 1) // 8 * 8 :]  # the last chunk of 8 rows
        expected = [k] * len(last) if t is None else (np.abs(last) > t).sum(axis=1).tolist()
        assert lin.kept_per_row() == expected
        kept = np.full(batch, k) if t is None else (np.abs(x) > t).sum(axis=1)
        assert lin.rows_kept == kept.sum()  # every row's own count, over all chunks
        chunks = [x[b : b + 8] for b in range(0, batch, 8)]
        union = [k if t is None else int((np.abs(c) > t).any(axis=0).sum()) for c in chunks]
        assert lin.columns_read == sum(union)


@pytest.mark.parametrize("form", ["q4_1", "q4_k"])
def test_dequantize_gives_the_packed_weight(isa: str, threads: int, form: str) -> None:
    rng = np.random.default_rng(11)
    n, k = 200, 96  # npad 224: the last rows are padding
    lin = SparseInt4Linear.from_codes(*(q4_1_like if form == "q4_1" else q4_k_like)(rng, n, k))
    w = lin.packed.dequantize()  # (n, k)
    out = np.full((k, 160), np.nan, dtype=np.float32)
    lin._matrix.dequantize(out, 32, 160, 160)  # rows 32 .. 159, transposed, 160 floats apart
    np.testing.assert_allclose(out[:, :128].T, w[32:160], rtol=0, atol=4 * FP32_EPS * np.abs(w).max())
    assert np.isnan(out[:, 128:]).all()
    lin._matrix.dequantize(out, 192, 224, 160)  # the last chunk: rows 192 .. 199 and padding
    np.testing.assert_allclose(out[:, :8].T, w[192:200], rtol=0, atol=4 * FP32_EPS * np.abs(w).max())
    with pytest.raises(ValueError, match="multiples of 32"):
        lin._matrix.dequantize(out, 16, 160, 160)


@pytest.mark.parametrize("batch", [48, 131])
def test_prefill_batches_take_the_matmul_and_keep_the_counts(
    isa: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From MATMUL_MIN_ROWS rows a torch batch goes through torch's GEMM on the weight
    dequantized in tiles (forced small here: several tiles and a partial last one); the sums
    run in another order, so the bound is that of any fp32 dot product of K terms."""
    monkeypatch.setattr(linear_module, "MATMUL_TILE_BYTES", 4 * 576 * 64)  # 64 rows a tile
    rng = np.random.default_rng(batch)
    n, k = 200, 576
    source = q4_k_like(rng, n, k)
    lin = SparseInt4Linear.from_codes(*source)
    x = activations(rng, batch, k)
    for sparsity in (None, 0.5):
        t = threshold_for(x[1], sparsity)
        y = lin(torch.from_numpy(x), t).numpy()
        xs = np.abs(np.where(np.abs(x) > (t or 0), x, 0) if t is not None else x).astype(np.float64)
        mag = xs @ np.abs(lin.packed.dequantize().astype(np.float64)).T
        assert np.all(np.abs(y - gemv_reference(*source, 32, x, t)) <= (k + 4) * FP32_EPS * mag)
        kept = np.full(batch, k) if t is None else (np.abs(x) > t).sum(axis=1)
        assert lin.rows_kept == kept.sum() and lin.columns_read == k


def test_torch_tensors_are_used_in_place(isa: str) -> None:
    rng = np.random.default_rng(5)
    source = q4_1_like(rng, 96, 128)
    lin = SparseInt4Linear.from_codes(*(torch.from_numpy(a) for a in source))
    x = torch.from_numpy(activations(rng, 2, 128))
    out = torch.full((2, 96), float("nan"))
    y = lin(x, 0.3, out=out)
    assert y is out and y.dtype == torch.float32
    np.testing.assert_allclose(y.numpy(), gemv_reference(*source, 32, x.numpy(), 0.3), rtol=0,
                               atol=error_bound(lin.packed, x.numpy(), 0.3).max())
    np.testing.assert_array_equal(lin(x[1]).numpy(), lin(x[1].numpy()))


def test_bad_inputs_raise() -> None:
    rng = np.random.default_rng(6)
    lin = SparseInt4Linear.from_codes(*q4_1_like(rng, 64, 64))
    with pytest.raises(ValueError, match="float32"):
        lin(torch.zeros(64, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        lin(torch.zeros(64, 2)[:, 0])
    with pytest.raises(TypeError, match="float32"):
        lin(np.zeros(64, dtype=np.float64))
    with pytest.raises(ValueError, match=r"\(64,\) or \(B, 64\)"):
        lin(np.zeros(32, dtype=np.float32))
    with pytest.raises(ValueError, match="out must have shape"):
        lin(np.zeros(64, dtype=np.float32), out=np.zeros(63, dtype=np.float32))


# ---------------------------------------------------------------- dispatch and the thread pool


def test_isa_can_be_forced_lower_by_environment() -> None:
    code = "from llmlocal.native import cpu as s; print(s.isa(), s.best_isa(), s.num_threads())"
    for name in si4.available_isas():
        env = dict(os.environ, LLMLOCAL_SPARSE_ISA=name, LLMLOCAL_SPARSE_THREADS="3")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [name, si4.best_isa(), "3"]
    with pytest.raises(ValueError, match="unknown ISA"):
        si4.set_isa("neon")


def _task_state(tid: str) -> tuple[str, int]:
    """(state, utime + stime in clock ticks) of thread ``tid`` of this process (proc(5): the
    fields after the parenthesised name are state, ppid, ..., utime at 12th, stime at 13th)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


def _poll_workers(workers: set[str], until: str, deadline_s: float = 10.0) -> None:
    """Poll every 2 ms until each of ``workers`` is in ``until`` state ('R': running or
    runnable, 'S': asleep), failing after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while True:
        states = {tid: _task_state(tid)[0] for tid in workers}
        if all(s == until for s in states.values()):
            return
        assert time.monotonic() < deadline, f"workers not {until!r} after {deadline_s} s: {states}"
        time.sleep(0.002)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the pool's threads from Linux's /proc")
def test_idle_workers_sleep(threads: int) -> None:
    """The pool's workers (threads - 1 of them: the threads the pool starts) spin for
    `spin_us` after a call and then sleep on the condition variable: each reaches state 'S'
    (polled, with a generous deadline) and stays there: asleep at each of 25 polls over a
    quarter of a second or more, its CPU time (utime + stime) unchanged meanwhile. A spinning
    worker is 'R' at each poll and gains a clock tick every 10 ms; the probe sees one: with a
    0.3 s spin, the worker is found running after a call."""
    k = si4.kernels()
    spin = k.spin_us()
    before = set(os.listdir("/proc/self/task"))
    si4.set_num_threads(threads)  # restarts the pool: its workers are the threads that appear
    workers = set(os.listdir("/proc/self/task")) - before
    assert len(workers) == threads - 1, workers
    rng = np.random.default_rng(8)
    lin = SparseInt4Linear.from_codes(*q4_1_like(rng, 1024, 1024))
    x = activations(rng, 1, 1024)[0]
    try:
        if workers:  # the probe can fail: a worker left spinning for 0.3 s is seen running
            k.set_spin_us(300_000)
            lin(x, 0.5)
            _poll_workers(workers, "R")
            k.set_spin_us(spin)
        for _ in range(50):
            lin(x, 0.5)
        _poll_workers(workers, "S")
        start = {tid: _task_state(tid)[1] for tid in workers}
        for _ in range(25):
            time.sleep(0.01)
            states = {tid: _task_state(tid) for tid in workers}
            assert all(state == "S" for state, _ in states.values()), states
        assert {tid: ticks for tid, (_, ticks) in states.items()} == start
    finally:
        k.set_spin_us(spin)


def test_calls_from_several_python_threads_are_serialised(threads: int) -> None:
    rng = np.random.default_rng(10)
    lins = [SparseInt4Linear.from_codes(*q4_1_like(rng, 700, 576)) for _ in range(3)]
    xs = [activations(rng, 1, 576)[0] for _ in lins]
    expected = [lin(x, 0.3) for lin, x in zip(lins, xs)]
    failures: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not np.array_equal(lins[i](xs[i], 0.3), expected[i]):
                failures.append(i)

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert failures == []


def test_kernels_work_in_a_forked_child(threads: int) -> None:
    rng = np.random.default_rng(9)
    source = q4_1_like(rng, 512, 256)
    lin = SparseInt4Linear.from_codes(*source)
    x = activations(rng, 1, 256)[0]
    expected = lin(x, 0.2)
    pid = os.fork()
    if pid == 0:  # the pool's threads did not survive the fork: they must be restarted
        ok = np.array_equal(lin(x, 0.2), expected)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
