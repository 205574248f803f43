"""Prompt rows through AMX-BF16 tiles (csrc/qmat_tiles.c) against the exact product: float64
W x', W dequantized by gguf-py, x' the float32 input with the threshold applied. Skipped on
CPUs without AMX-BF16; failed where the CPU has it and the build or dispatch does not run it.

The bound, per output n of an activation row: the tiles round every x'_j and every W_nj to
bfloat16 (8 significant bits, round to nearest even: a relative error of at most u = 2^-8
each), multiply them exactly (16 significant bits fit float32) and sum the K products in
float32 with at most two roundings each, in some order. So

    |y_n - (W x')_n| <= sum_j |W_nj x'_j| ((1 + u)^2 - 1)  +  gamma_{K + 8} (1 + u)^2 sum_j |W_nj x'_j|

(gamma_m = m 2^-24 / (1 - m 2^-24), Higham's bound for a sum in any order, as in
test_kernels_exact.py; the tiles flush float32 subnormals, which these inputs never reach).
As there, the worst case is far above the typical error, so a second check over all outputs:
the mean of err^2 / V_n stays <= 1.3, V_n = sum_j (W_nj x'_j)^2 2 u^2 / 3 (each relative
rounding error uniform on [-u, u]; round to nearest gives at most that: about half, measured).
Rounding toward zero instead doubles the error and quadruples the ratio.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from cpu_flags import missing
from qmat_cases import gguf_blocks
from test_kernels_exact import exact_weight, gamma, thresholded
from llmlocal.native.cpu import kernels, runtime
from llmlocal.native.cpu import qlayout as ql
from llmlocal.native.cpu.linear import QuantLinear, prompt_rows

U_BF16 = 2.0**-8
TYPES = sorted(ql.FORMATS)
SHAPES = [(1, 256), (33, 512), (130, 768), (64, 2048), (40, 4352)]  # 4352: K in three blocks (46, 46, 44 steps)
MEAN_SQUARED_RATIO_MAX = 1.3


@pytest.fixture(autouse=True)
def tiles() -> Iterator[None]:
    lacking = missing(("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"))
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)} (the bfloat16 tiles)")
    before = runtime.isa()
    try:
        runtime.set_isa("avx512")
        runtime.set_qmat_tiles(True)
        assert runtime.qmat_tiles(), "the CPU has AMX-BF16, the kernels do not run the tiles"
        yield
    finally:
        runtime.set_isa(before)


class Noise:
    def __init__(self) -> None:
        self.count, self.total = 0, 0.0

    def check(self) -> float:
        assert self.count > 500
        mean = self.total / self.count
        assert mean <= MEAN_SQUARED_RATIO_MAX, f"mean squared error / rounding variance {mean:.3f}"
        return mean


def check(y: np.ndarray, w: np.ndarray, x: np.ndarray, t: float | None, noise: Noise, msg: str) -> None:
    """y (B, N) against float64 W x' within the bound above."""
    xt = thresholded(x, t).astype(np.float64)
    k = w.shape[1]
    mag = np.abs(xt) @ np.abs(w).T  # sum_j |W_nj x'_j|
    bound = mag * ((1 + U_BF16) ** 2 - 1 + gamma(k + 8) * (1 + U_BF16) ** 2)
    err = np.abs(y.astype(np.float64) - xt @ w.T)
    assert np.isfinite(y).all(), msg
    worst = np.unravel_index(np.argmax(err / np.maximum(bound, 1e-300)), err.shape)
    assert np.all(err <= bound), f"{msg}: error {err[worst]:.3g} over the bound {bound[worst]:.3g} at {worst}"
    var = (xt**2 @ (w**2).T) * 2 * U_BF16**2 / 3
    live = var > 0
    noise.count += int(live.sum())
    noise.total += float((err[live] ** 2 / var[live]).sum())


def matrix(qtype: int, n: int, k: int, interleaved: bool) -> tuple[object, np.ndarray]:
    raw = gguf_blocks(qtype, n, k, seed=n + k)
    c = ql.decode(raw, qtype)
    p = ql.pack(c, interleaved)
    return kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, interleaved), exact_weight(raw, qtype, n, k)


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", TYPES, ids=[ql.FORMATS[t].name for t in TYPES])
def test_tiles_against_float64(qtype: int, interleaved: bool) -> None:
    rng = np.random.default_rng(300 + qtype)
    noise = Noise()
    for n, k in SHAPES:
        m, w = matrix(qtype, n, k, interleaved)
        for batch in (1, 16, 37, 64) if k < 2048 else (40,):
            x = rng.standard_t(3, size=(batch, k)).astype(np.float32)
            x[:, :32] = 0.0
            for t in (None, 0.6) if batch == 37 else (None,):
                y = np.full((batch, n), np.nan, dtype=np.float32)
                kept = m.tiles(x, y, batch, k, n, 0.0 if t is None else t, t is None)
                assert kept == (batch * k if t is None else int((np.abs(x) > np.float32(t)).sum()))
                check(y, w, x, t, noise, f"{ql.FORMATS[qtype].name} {n}x{k} batch {batch} threshold {t}")
    noise.check()


def test_rounding_toward_zero_breaks_the_noise_check() -> None:
    """The noise check could fail: bfloat16 truncated instead of rounded (the same data)."""
    m, w = matrix(ql.Q4_K, 130, 768, True)
    x = np.random.default_rng(5).standard_t(3, size=(37, 768)).astype(np.float32)

    def bf16(a: np.ndarray, truncate: bool) -> np.ndarray:
        if not truncate:
            return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().float().numpy()
        return (np.ascontiguousarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)

    nearest = (bf16(x, False).astype(np.float64) @ bf16(w, False).astype(np.float64).T).astype(np.float32)
    noise = Noise()
    check(nearest, w, x, None, noise, "nearest")
    assert noise.check() < 0.8
    truncated = (bf16(x, True).astype(np.float64) @ bf16(w, True).astype(np.float64).T).astype(np.float32)
    noise = Noise()
    check(truncated, w, x, None, noise, "truncated")
    with pytest.raises(AssertionError, match="rounding variance"):
        noise.check()
    y = np.empty((37, 130), np.float32)
    m.tiles(x, y, 37, 768, 130, 0.0, True)  # the kernel: within both, as the test above says
    noise = Noise()
    check(y, w, x, None, noise, "tiles")
    noise.check()


@pytest.mark.parametrize("k", [768, 4352])  # 4352: K in blocks, the sums kept between them
@pytest.mark.parametrize("qtype", [ql.Q4_K, ql.Q6_K, ql.Q8_0], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_a_row_is_the_same_in_any_call(qtype: int, k: int) -> None:
    """A prompt row's outputs do not depend on the rows beside it, nor on the threads."""
    m, _ = matrix(qtype, 130, k, True)
    x = np.random.default_rng(6).standard_normal((70, k)).astype(np.float32)
    y = np.empty((70, 130), np.float32)
    m.tiles(x, y, 70, k, 130, 0.0, True)
    threads = runtime.num_threads()
    try:
        runtime.set_num_threads(1)
        for r in (0, 33, 69):
            y1 = np.empty((1, 130), np.float32)
            m.tiles(np.ascontiguousarray(x[r : r + 1]), y1, 1, k, 130, 0.0, True)
            np.testing.assert_array_equal(y1[0], y[r])
    finally:
        runtime.set_num_threads(threads)


def test_prompt_rows_take_the_tiles_and_decode_rows_the_int8_kernels() -> None:
    """Through the layer, as a step of the engine calls it: the decode rows first give what the
    int8 kernels give them alone, the prompt rows after them what the tiles give them alone,
    however few; with the tiles switched off every row takes the int8 kernels."""
    raws = [gguf_blocks(ql.Q4_K, n, 512, seed=n) for n in (45, 19)]  # stacked: two matrices
    lin = QuantLinear([ql.decode(r, ql.Q4_K) for r in raws], interleaved=True)
    rng = np.random.default_rng(7)
    decode, prompt = 3, 40
    x = torch.from_numpy(rng.standard_normal((decode + prompt, 512)).astype(np.float32))
    int8 = lin(x)  # no prompt rows: every row through the int8 kernels
    with prompt_rows(0):
        tiles = lin(x[decode:].contiguous())
    with prompt_rows(decode):
        y = lin(x)
    assert torch.equal(y[:decode], int8[:decode])
    assert torch.equal(y[decode:], tiles)
    assert not torch.equal(tiles, int8[decode:])  # a different rounding, so the test means something
    with prompt_rows(decode + prompt - 1):  # one prompt row: the tiles too
        assert torch.equal(lin(x)[-1], tiles[-1])
    runtime.set_qmat_tiles(False)
    try:
        with prompt_rows(0):
            assert torch.equal(lin(x), int8)
    finally:
        runtime.set_qmat_tiles(True)
