"""What the sparse INT4 kernels compute, in numpy (float64), and how far fp32 may stray from it.

Thresholding (TEAL-style): an input is kept when its magnitude exceeds the threshold,

    x'_bj = x_bj  if |x_bj| > t  else 0          (t = None: every input is kept)

and the GEMV is the exact product with the dequantized INT4 weight,

    y_b = W x'_b,   W[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g].

A column is read when any row of the batch keeps it; `n_kept` counts those columns.
"""

from __future__ import annotations

import numpy as np

from .layout import PackedInt4

FP32_EPS = float(np.finfo(np.float32).eps)


def sparsify(x: np.ndarray, threshold: float | None) -> np.ndarray:
    """x with the inputs at or below the threshold in magnitude set to 0 (same shape, float32)."""
    x = np.asarray(x, dtype=np.float32)
    if threshold is None:
        return x.copy()
    return np.where(np.abs(x) > np.float32(threshold), x, np.float32(0.0))


def kept_columns(x: np.ndarray, threshold: float | None) -> np.ndarray:
    """(K,) bool: the columns a call reads for x (K,) or (B, K), the union over rows."""
    x2 = np.atleast_2d(np.asarray(x, dtype=np.float32))
    if threshold is None:
        return np.ones(x2.shape[1], dtype=bool)
    return (np.abs(x2) > np.float32(threshold)).any(axis=0)


def dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, group_size: int) -> np.ndarray:
    """(N, K) float64 weight of the source form (exact: every factor is an fp32 value)."""
    s = np.repeat(np.asarray(scale, dtype=np.float64), group_size, axis=1)
    z = np.repeat(np.asarray(zero, dtype=np.float64), group_size, axis=1)
    return (np.asarray(codes, dtype=np.float64) - 8.0) * s + z


def gemv_reference(
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    group_size: int,
    x: np.ndarray,
    threshold: float | None,
) -> np.ndarray:
    """y (N,) or (B, N) float64 = W x' for x (K,) or (B, K)."""
    w = dequantize(codes, scale, zero, group_size)  # (N, K)
    xs = sparsify(x, threshold).astype(np.float64)
    return xs @ w.T


def error_bound(packed: PackedInt4, x: np.ndarray, threshold: float | None) -> np.ndarray:
    """Per-output bound on |y_kernel - y_exact|, shape of the output.

    The kernel sums, in fp32, at most `group_size` products q d x per group (one FMA each, in
    column order), adds m * (the group's fp32 sum of x) and d * that group sum to y, group after
    group. Recursive fp32 summation of n terms errs by at most about n * eps * sum |term|, so
    with the terms' magnitude  mag_n = sum_g sum_{kept j in g} (q_nj |d_ng| + |m_ng|) |x_j|
    the error is at most (2 group_size + G + 4) * eps * mag_n (2 group_size: the group sum of x
    and the products; 4: the factors m = zero - 8 scale and the two FMAs per group). The bound
    is loose by design (typical errors are ~sqrt of it) but tight enough to catch one column of
    a row read wrongly or skipped: that changes y_n by |w_nj x_j| ~ mag_n / K.
    """
    d, m = packed.factors()  # (N, G) each, float32
    q = packed.unpack_codes().astype(np.float64)  # (N, K)
    ax = np.abs(np.atleast_2d(sparsify(x, threshold)).astype(np.float64))  # (B, K)
    g = packed.group_size
    coef = q * np.repeat(np.abs(d.astype(np.float64)), g, axis=1) + np.repeat(np.abs(m.astype(np.float64)), g, axis=1)
    mag = ax @ coef.T  # (B, N)
    bound = (2 * g + packed.n_groups + 4) * FP32_EPS * mag
    return bound.reshape(-1) if np.ndim(x) == 1 else bound


INT8_BLOCK = 32


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the INT8 GEMV does to x (B, K) first: per block of 32 inputs, dx = max |x| / 127 and
    qx = round(x / dx), rounding halves away from zero, in float32 as the C code does. Returns
    qx (B, K) int8 and dx (B, ceil(K / 32)) float32."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    b, k = x.shape
    nblk = -(-k // INT8_BLOCK)
    pad = np.zeros((b, nblk * INT8_BLOCK), dtype=np.float32)
    pad[:, :k] = x
    blocks = pad.reshape(b, nblk, INT8_BLOCK)
    dx = np.abs(blocks).max(axis=2) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(dx > 0, np.float32(1.0) / dx, np.float32(0.0)).astype(np.float32)
    v = blocks * inv[:, :, None]
    q = np.trunc(v + np.copysign(np.float32(0.5), v))  # C's roundf
    return q.reshape(b, -1)[:, :k].astype(np.int8), dx.astype(np.float32)


def int8_gemv_reference(w: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y (B, N) float64 = scale_n * sum_blocks dx_b,blk * (exact integer block sums of W qx)."""
    qx, dx = quantize_activations(x)
    b, k = qx.shape
    nblk = dx.shape[1]
    w64 = np.asarray(w, dtype=np.int64)
    sums = np.zeros((b, w.shape[0], nblk), dtype=np.float64)
    for blk in range(nblk):
        j = slice(blk * INT8_BLOCK, min(k, (blk + 1) * INT8_BLOCK))
        sums[:, :, blk] = qx[:, j].astype(np.int64) @ w64[:, j].T
    return (sums * dx[:, None, :].astype(np.float64)).sum(axis=2) * np.asarray(scale, dtype=np.float64)
