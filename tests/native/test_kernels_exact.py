"""Every native GEMV against the exact product: float64 W x', W dequantized by gguf-py (the GGUF
types) or from its int8 codes and row scales (the output head), x' the float32 input with the
threshold applied (|x_j| <= t zeroed), not quantized. No emulation of the kernels' arithmetic is
involved (`test_qmat.py` and `test_int8_gemv.py` keep that as a second, tighter check).

The bound, per output n of an activation row (derivation):

    The kernels round x' to int8 per block b of 32 inputs, as llama.cpp's Q8_0:
    dx_b = fl(m_b / 127), m_b = max_{j in b} |x'_j|, qx_j = round(fl(x'_j * fl(1 / dx_b))),
    x^_j = dx_b qx_j. With u = 2^-24 (float32's unit roundoff), dx_b >= (m_b / 127)(1 - u) and
    the product x' * (1 / dx) errs by at most 2.01 u relatively, so |x'_j / dx_b| <= 127 (1 + 2u)
    and |x'_j / dx_b - qx_j| <= 1/2 + 127 (1 + 2u) 2.01 u < 1/2 + 2^-15; hence

        |x'_j - x^_j| <= e_b = (m_b / 127)(1 + u)(1/2 + 2^-15) <= (m_b / 127)(1/2 + 2^-14).   (1)

    Then the kernels compute sum_j W_nj x^_j in float32. For a GGUF type, W_nj = D_ng q_nj + M_ng
    exactly in float32 (fp16 d times an integer scale of <= 8 bits: <= 19 significant bits; the
    same values gguf-py dequantizes to, bit for bit), and per group g of inputs the kernel forms
    t1 = D dx sum(q qx), t2 = M dx sum(qx) from exact integer sums, each with a few (<= 4: two
    products, an int -> float conversion above 2^24, an FMA) roundings, and adds the 2G terms in
    float32 in some order (lanes, chunks, threads' partial sums). For any order of summing n terms
    with that many roundings each, |fl(sum t) - sum t| <= gamma_{n+4} sum |t|, gamma_m =
    m u / (1 - m u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.: Lemma 3.1
    for gamma, section 4.2 for a sum in any order); and dx |qx_j| <= |x'_j| + dx_b by (1), so

        sum |t| <= S_n = sum_j (|D_ng(j)| |q_nj| + |M_ng(j)|) (|x'_j| + dx_b(j)).

    In all (gamma_{2G + 4} by this count; 2G + 8 leaves room for a miscounted rounding):

        |y_n - (W x')_n| <= sum_j |W_nj| e_b(j) + gamma_{2G + 8} S_n.                          (2)

    The INT8 head (W_nj = s_n w_nj, int8 w) sums products in int32 runs of 4 to 32 and at most
    ceil(K / 4) partial sums in float32, each scaled by s_n dx_b: the same with
    gamma_{ceil(K/4) + 8} and S_n = |s_n| sum_j |w_nj| (|x'_j| + dx_b(j)). Torch's GEMM (prefill
    of the column layout) sums K products of x^ and W: gamma_{K + 8}, S_n = sum_j |W_nj|
    (|x'_j| + dx_b(j)) >= sum_j |W_nj| |x^_j|.

The first term dominates, and it is a worst case: rounding errors of independent inputs add up
like a random walk, so the error is typically ~sqrt(K) times smaller. Hence a second check, over
all outputs of a test: the mean of err^2 / V_n stays <= 1.3, where V_n = sum_j W_nj^2 e_b(j)^2 / 3
is the variance of the error if each x - x^ were uniform on [-e_b, e_b] (round to nearest gives
that or less: the block's largest input is exact). Measured: 0.65-0.68 for every type and
variant. Rounding toward zero quadruples it (error uniform on [0, dx]: dx^2 / 3 against
dx^2 / 12), a skipped block or a misread scale breaks (2): test_the_bound_catches_what_it_should.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType
from llmlocal.native.cpu import Int8RowsLinear, kernels, runtime
from llmlocal.native.cpu import qlayout as ql
from llmlocal.native.cpu.linear import MATMUL_MIN_ROWS, QuantLinear

from cpu_flags import QMAT_VARIANTS, missing
from qmat_cases import gguf_blocks

U = 2.0**-24  # float32 unit roundoff
TYPES = sorted(ql.FORMATS)
NAMES = [ql.FORMATS[t].name for t in TYPES]
# (rows, inputs): odd row counts (padded chunks), one row, K of 1 to 8 super-blocks
SHAPES = [(1, 256), (33, 512), (130, 768), (64, 2048)]
# 2-4: the decode passes of a verification; 7, 13: a pass of 8 rows and the rest; 16, 40: one and
# two AMX blocks of 16 (and 8); 64: a whole call
BATCHES = (1, 2, 3, 4, 7, 8, 13, 16, 40, 64)
MEAN_SQUARED_RATIO_MAX = 1.3


def gamma(m: int) -> float:
    return m * U / (1 - m * U)


@pytest.fixture(params=list(QMAT_VARIANTS))
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """The GGUF-type kernels set to one variant: skipped where /proc/cpuinfo lacks its
    instructions, failed where the CPU has them but the build or dispatch does not run them."""
    name = request.param
    isa, vnni, amx, flags = QMAT_VARIANTS[name]
    lacking = missing(flags)
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)} (the {name} kernels)")
    before = runtime.isa()
    try:
        runtime.set_isa(isa)
        runtime.set_qmat_vnni(vnni)
        runtime.set_qmat_amx(amx)
        assert runtime.qmat_kernel() == name, f"the CPU has {name}'s instructions, the kernels run {runtime.qmat_kernel()}"
        yield name
    finally:
        runtime.set_qmat_vnni(True)
        runtime.set_qmat_amx(True)
        runtime.set_isa(before)


def thresholded(x: np.ndarray, t: float | None) -> np.ndarray:
    return x if t is None else np.where(np.abs(x) > np.float32(t), x, np.float32(0))


def block_error(xt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e, dx), each (B, K) float64: the rounding bound (1) and the block's scale per input
    (K padded to blocks of 32 with zeros, as the INT8 head does)."""
    b, k = xt.shape
    nblk = -(-k // 32)
    pad = np.zeros((b, nblk * 32))
    pad[:, :k] = np.abs(xt)
    m = pad.reshape(b, nblk, 32).max(axis=-1) / 127  # (B, blocks)
    dx = np.repeat(m, 32, axis=1)[:, :k] * (1 + 2 * U)  # >= the kernels' fl(m / 127)
    return dx * (0.5 + 2.0**-14) / (1 + 2 * U), dx


@dataclass
class Noise:
    """The second check's sums over a test's outputs: how many, and the sum of err^2 / V_n."""

    count: int = 0
    total: float = 0.0

    def check(self) -> None:
        assert self.count > 500
        mean = self.total / self.count
        assert mean <= MEAN_SQUARED_RATIO_MAX, f"mean squared error / rounding variance {mean:.3f}"


class Exact:
    """A weight (N, K) float64 as the reference takes it, with what bound (2) needs: |W|, the
    coefficients of S_n (N, K), W^2 for the noise check, and gamma."""

    def __init__(self, w: np.ndarray, mag: np.ndarray, g: float) -> None:
        self.wt = np.ascontiguousarray(w.T)
        self.abs_t = np.abs(self.wt)
        self.mag_t = np.ascontiguousarray(mag.T)
        self.sq_t = self.wt**2
        self.g = g

    def check(self, y: np.ndarray, x: np.ndarray, t: float | None, noise: Noise, msg: str) -> None:
        """y (B, N) against float64 W x' within bound (2)."""
        xt = thresholded(x, t).astype(np.float64)
        e, dx = block_error(xt)
        bound = e @ self.abs_t + self.g * ((np.abs(xt) + dx) @ self.mag_t)
        err = np.abs(y.astype(np.float64) - xt @ self.wt)
        assert np.isfinite(y).all(), msg
        worst = np.unravel_index(np.argmax(err / np.maximum(bound, 1e-300)), err.shape)
        assert np.all(err <= bound), f"{msg}: error {err[worst]:.3g} over the bound {bound[worst]:.3g} at {worst}"
        var = (e**2) @ self.sq_t / 3  # (B, N)
        live = var > 0
        noise.count += int(live.sum())
        noise.total += float((err[live] ** 2 / var[live]).sum())


def exact_weight(raw: np.ndarray, qtype: int, n: int, k: int) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType(qtype)).reshape(n, k).astype(np.float64)


def coefficients(c: ql.QuantCodes) -> np.ndarray:
    """(N, K) |D| q + |M| per weight, from the decoded codes (bit-exact against gguf-py:
    test_qmat.test_decode_matches_gguf_dequantize, and asserted below)."""
    f = ql.FORMATS[c.qtype]
    d, m = (np.repeat(a.astype(np.float64), f.group, axis=1) for a in c.factors())
    return np.abs(d) * np.abs(c.signed_codes().astype(np.float64)) + np.abs(m)


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_qmatrix_against_float64(variant: str, qtype: int, interleaved: bool) -> None:
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(100 + qtype)
    noise = Noise()
    for n, k in SHAPES:
        raw = gguf_blocks(qtype, n, k, seed=n + k)
        w = exact_weight(raw, qtype, n, k)
        c = ql.decode(raw, qtype)
        np.testing.assert_array_equal(c.dequantize(), w)  # the factors of the bound are the file's
        ref = Exact(w, coefficients(c), gamma(2 * (k // f.group) + 8))
        p = ql.pack(c, interleaved)
        m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, interleaved)
        for batch in BATCHES if k < 2048 else (1, 13, 64):
            x = (rng.standard_normal((batch, k)) * rng.exponential(1.0, (batch, k))).astype(np.float32)
            x[:, :32] = 0.0  # a whole block of zeros: dx = 0
            for t in (None, 0.0, 0.6) if batch == 3 else (None, 0.6):
                y = np.full((batch, n), np.nan, dtype=np.float32)
                m.gemv(x, y, batch, k, n, 0.0 if t is None else t, t is None, None)
                ref.check(y, x, t, noise, f"{variant} {f.name} {n}x{k} batch {batch} threshold {t}")
                if batch in (13, 64):  # a row alone: the same exactness (the 1-row kernels)
                    r = batch - 1
                    y1 = np.full((1, n), np.nan, dtype=np.float32)
                    m.gemv(np.ascontiguousarray(x[r : r + 1]), y1, 1, k, n, 0.0 if t is None else t, t is None, None)
                    ref.check(y1, x[r : r + 1], t, noise, f"{variant} {f.name} {n}x{k} row {r} alone")
    noise.check()


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", [ql.Q4_K, ql.Q6_K, ql.Q8_0, ql.Q5_0], ids=["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_quant_linear_layer_against_float64(variant: str, qtype: int, interleaved: bool) -> None:
    """The layer as the engine calls it: stacked tensors, chunks of 64 rows, and prefill (torch,
    48+ rows) through the kernel or torch's GEMM on the dequantized weight, whichever it takes."""
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(200 + qtype)
    k = 512
    raws = [gguf_blocks(qtype, n, k, seed=n) for n in (45, 19)]
    w = np.concatenate([exact_weight(r, qtype, r.shape[0], k) for r in raws])
    codes = [ql.decode(r, qtype) for r in raws]
    kernel = Exact(w, np.concatenate([coefficients(c) for c in codes]), gamma(2 * (k // f.group) + 8))
    gemm = Exact(w, np.abs(w), gamma(k + 8))  # torch's GEMM: K products of x^ (<= |x'| + dx) and W, any order
    lin = QuantLinear(codes, interleaved=interleaved)
    noise = Noise()
    for batch in (1, 5, 47, MATMUL_MIN_ROWS, 70, 130):
        x = (rng.standard_normal((batch, k)) * rng.exponential(1.0, (batch, k))).astype(np.float32)
        for t in (None, 0.4):
            y = lin(torch.from_numpy(x), t).numpy()
            ref = gemm if batch >= MATMUL_MIN_ROWS and lin.prefill_matmul else kernel
            ref.check(y, x, t, noise, f"{variant} batch {batch} threshold {t}")
    noise.check()


@pytest.mark.parametrize("n, k", [(1, 64), (7, 33), (37, 70), (258, 96), (1030, 576)])
def test_int8_head_against_float64(isa: str, n: int, k: int) -> None:
    rng = np.random.default_rng(n + k)
    w8 = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scale = ((rng.random(n, dtype=np.float32) + 0.5) / 100).astype(np.float32)
    w = w8.astype(np.float64) * scale.astype(np.float64)[:, None]  # exact: 8 x 24 significant bits
    lin = Int8RowsLinear(w8, scale)
    ref = Exact(w, np.abs(w), gamma(-(-k // 4) + 8))
    noise = Noise()
    for batch in (1, 3, 11, 64):
        x = (rng.standard_normal((batch, k)) * rng.exponential(1.0, (batch, k))).astype(np.float32)
        x[:, : min(k, 5)] = 0.0
        y = lin(torch.from_numpy(x)).numpy()
        ref.check(y, x, None, noise, f"{isa} {n}x{k} batch {batch}")
    if n * k >= 2000:
        noise.check()


def test_the_bound_catches_what_it_should() -> None:
    """The checks above could fail: on the same data, outputs with a block of inputs skipped, or
    x rounded toward zero instead of to nearest, break bound (2) or the noise check."""
    qtype, n, k = ql.Q4_K, 130, 768
    raw = gguf_blocks(qtype, n, k, seed=3)
    w = exact_weight(raw, qtype, n, k)
    c = ql.decode(raw, qtype)
    ref = Exact(w, coefficients(c), gamma(2 * (k // 32) + 8))
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((8, k)) * rng.exponential(1.0, (8, k))).astype(np.float32)
    skipped = x.copy()
    skipped[:, 64:96] = 0.0
    with pytest.raises(AssertionError, match="over the bound"):
        ref.check((skipped.astype(np.float64) @ w.T).astype(np.float32), x, None, Noise(), "skipped")
    xb = x.reshape(8, -1, 32)
    dx = np.abs(xb).max(-1, keepdims=True) / 127
    truncated = (np.trunc(xb / dx) * dx).reshape(8, k)
    noise = Noise()
    ref.check((truncated @ w.T).astype(np.float32), x, None, noise, "truncated")  # within (2)
    with pytest.raises(AssertionError, match="rounding variance"):
        noise.check()
    nearest = (np.rint(xb / dx) * dx).reshape(8, k)  # and the correct rounding passes both
    noise = Noise()
    ref.check((nearest @ w.T).astype(np.float32), x, None, noise, "nearest")
    noise.check()


REAL = Path(os.environ.get("LLMLOCAL_DEV_MODELS", Path.home() / ".cache" / "llmlocal-dev")) / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.fixture(scope="module")
def real_tensors() -> list[tuple[int, str, np.ndarray]]:
    """(type, name, the first 160 rows' bytes) of one tensor of each type the kernels read in
    the real 0.5B file (reading its header is slow: once per module)."""
    if os.environ.get("LLMLOCAL_REAL_MODELS") != "1":
        pytest.skip("set LLMLOCAL_REAL_MODELS=1 to run")
    if not REAL.is_file():
        pytest.skip("run ../shared/models/fetch-real-models.sh --small")
    from gguf import GGUFReader

    out: dict[int, tuple[int, str, np.ndarray]] = {}
    for t in GGUFReader(REAL).tensors:
        qtype = int(t.tensor_type)
        if qtype in ql.FORMATS and qtype not in out and len(t.shape) == 2:
            raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)[:160]
            out[qtype] = (qtype, t.name, np.ascontiguousarray(raw))
    return [out[q] for q in sorted(out)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
def test_real_tensors_against_float64(variant: str, interleaved: bool, real_tensors: list) -> None:
    """A real file's tensors (Qwen2.5-Coder 0.5B Q4_K_M: Q8_0, Q5_0, Q6_K and Q4_K), 160 rows of
    each, on heavy-tailed activations (Student's t, 3 degrees of freedom, as a language
    model's): the bound and the noise check as above."""
    assert {ql.Q8_0, ql.Q5_0, ql.Q6_K, ql.Q4_K} <= {q for q, _, _ in real_tensors}
    rng = np.random.default_rng(0)
    noise = Noise()
    for qtype, name, raw in real_tensors:
        f = ql.FORMATS[qtype]
        n, k = raw.shape[0], raw.shape[1] // f.block_bytes * f.block_values
        w = exact_weight(raw, qtype, n, k)
        c = ql.decode(raw, qtype)
        np.testing.assert_array_equal(c.dequantize(), w)
        ref = Exact(w, coefficients(c), gamma(2 * (k // f.group) + 8))
        p = ql.pack(c, interleaved)
        m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, interleaved)
        for batch in (1, 8, 40):
            x = rng.standard_t(3, size=(batch, k)).astype(np.float32)
            for th in (None, 0.5):
                y = np.full((batch, n), np.nan, dtype=np.float32)
                m.gemv(x, y, batch, k, n, 0.0 if th is None else th, th is None, None)
                ref.check(y, x, th, noise, f"{variant} {name} ({f.name}) batch {batch} threshold {th}")
    noise.check()
