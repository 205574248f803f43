"""The column-major INT4 layout the sparse kernels read, built in numpy from exact INT4 codes.

Source: a weight W (N out, K in) as 4-bit codes with one (scale, zero) pair per row and group of
`g` inputs (GGUF Q4_0 / Q4_1 / Q4_K give g = 32, exactly):

    W[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g],   q in [0, 15]

Packed form (npad = N rounded up to 32; padding rows have q = 0 and zero factors):

    codes  (K, npad / 2) uint8    row j is input column j: one contiguous run of npad / 2 bytes,
                                  so a skipped column skips its bytes. Within the run, 16-byte
                                  chunk c holds rows 32c .. 32c + 31; its byte b carries row
                                  32c + b in the low nibble and row 32c + 16 + b in the high one.
                                  The array starts on a 4096-byte boundary.
    sz     (G, 2, npad)           per group, the two factors of every row, rows contiguous:
           float16  [g, 0] = d, [g, 1] = m,  w = q * d + m          (GGUF Q4_1's own form;
                    Q4_0 is m = -8 d). Chosen when d, m are fp16 values with m + 8 d == zero
                    exactly, which holds for every Q4_0 / Q4_1 tensor: 20 bytes per 32 weights,
                    as in Q4_1.
           float32  [g, 0] = scale, [g, 1] = zero, w = (q - 8) * scale + zero (the source form;
                    the kernel uses d = scale, m = zero - 8 scale). Used otherwise, e.g. for Q4_K,
                    whose d * sc and dmin * mn need up to 17 significant bits: 24 bytes / 32.
                    (scale_dtype="float16" forces 20 bytes; on Q4_K-form weights the weights
                    then err by ~2e-4 of their RMS, far below the 4-bit quantization error.)

Either way the packed matrix dequantizes bit-exactly to the source's W, and the kernels compute

    y_n = sum_g [ d_ng * sum_{j in g, kept} q_nj x_j  +  m_ng * sum_{j in g, kept} x_j ].

A group whose columns are all skipped is skipped with its factors. Threads split a call by
groups of columns (each thread streams whole column runs and the partial outputs are summed:
K >= 2048) or by rows in units of 128 (64 bytes of every column: smaller K).

Why whole columns rather than tiles of 64-256 rows: skipping a column saves memory traffic only
if the skipped bytes are a long enough run. Measured here, reading 50% of randomly chosen
chunks of 64 / 128 / 256 / 1024 / 4096 bytes takes 75% / 66% / 66% / 53% / 53% of the time of
reading them all (the hardware prefetchers fetch the neighbours of short chunks anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

CHUNK_ROWS = 32  # rows per 16-byte chunk of a column
ALIGN = 4096

ScaleDtype = Literal["auto", "float16", "float32"]


@dataclass(frozen=True)
class PackedInt4:
    codes: np.ndarray  # (K, npad // 2) uint8
    sz: np.ndarray  # (K // group_size, 2, npad) float16 (d, m) or float32 (scale, zero)
    n: int  # output features N
    k: int  # input features K
    group_size: int

    def __post_init__(self) -> None:
        g = self.k // self.group_size if self.group_size > 0 else 0
        npad = -(-self.n // CHUNK_ROWS) * CHUNK_ROWS
        if (
            g * self.group_size != self.k
            or self.codes.dtype != np.uint8
            or self.codes.shape != (self.k, npad // 2)
            or self.sz.dtype not in (np.float16, np.float32)
            or self.sz.shape != (g, 2, npad)
            or not (self.codes.flags.c_contiguous and self.sz.flags.c_contiguous)
        ):
            raise ValueError(
                f"not a packed INT4 matrix of {self.n} x {self.k} (group {self.group_size}): codes "
                f"{self.codes.dtype}{self.codes.shape}, sz {self.sz.dtype}{self.sz.shape}"
            )

    @property
    def npad(self) -> int:
        return self.codes.shape[1] * 2

    @property
    def n_groups(self) -> int:
        return self.k // self.group_size

    @property
    def sz_f16(self) -> bool:
        return self.sz.dtype == np.float16

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.sz.nbytes

    def bytes_read(self, keep: np.ndarray) -> int:
        """Bytes a GEMV reads when the columns where `keep` (K,) bool is true are kept:
        their code runs, plus both factors of every group with a kept column."""
        keep = np.asarray(keep, dtype=bool).reshape(self.n_groups, self.group_size)
        groups = int(keep.any(axis=1).sum())
        return int(keep.sum()) * self.codes.shape[1] + groups * 2 * self.npad * self.sz.itemsize

    def unpack_codes(self) -> np.ndarray:
        """(N, K) uint8 codes back in row-major order."""
        c = self.codes.reshape(self.k, self.npad // CHUNK_ROWS, 16)  # (K, chunk, byte)
        q = np.stack([c & 15, c >> 4], axis=2)  # (K, chunk, nibble, byte): row 32 chunk + 16 nibble + byte
        return np.ascontiguousarray(q.reshape(self.k, self.npad).T[: self.n])

    def factors(self) -> tuple[np.ndarray, np.ndarray]:
        """(d, m), each (N, G) float32, with w = q * d + m (m computed as the kernels do)."""
        a = self.sz[:, 0, : self.n].T.astype(np.float32)
        b = self.sz[:, 1, : self.n].T.astype(np.float32)
        return (a, b) if self.sz_f16 else (a, (b - np.float32(8.0) * a).astype(np.float32))

    def dequantize(self) -> np.ndarray:
        """(N, K) float32 weight; bit-exact to the source's (q - 8) * scale + zero."""
        q = self.unpack_codes().astype(np.float32)
        a = np.repeat(self.sz[:, 0, : self.n].T.astype(np.float32), self.group_size, axis=1)  # (N, K)
        b = np.repeat(self.sz[:, 1, : self.n].T.astype(np.float32), self.group_size, axis=1)
        if self.sz_f16:
            return q * a + b  # q * d is exact (4-bit times 11-bit): one rounding, as the source's
        return (q - np.float32(8.0)) * a + b


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _fp16_form(scale: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(d, m) as float16 if they represent scale and zero exactly, else None."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = scale.astype(np.float16)
        m = (zero - np.float32(8.0) * scale).astype(np.float16)
        # float64 sums of fp16 values are exact: the fp16 form is exact iff it rebuilds both factors
        ok = np.array_equal(d.astype(np.float64), scale.astype(np.float64)) and np.array_equal(
            m.astype(np.float64) + 8.0 * d.astype(np.float64), zero.astype(np.float64)
        )
    return (d, m) if ok else None


def pack_int4(
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    group_size: int = 32,
    scale_dtype: ScaleDtype = "auto",
) -> PackedInt4:
    """Repack (N, K) codes and (N, K // group_size) scale / zero into the kernels' layout.

    scale_dtype "auto" stores the factors as fp16 when that is exact (Q4_0, Q4_1) and fp32
    otherwise; "float16" forces fp16 (rounding the factors if needed), "float32" forces fp32.
    """
    codes = np.asarray(codes)
    scale = np.asarray(scale, dtype=np.float32)
    zero = np.asarray(zero, dtype=np.float32)
    if codes.ndim != 2:
        raise ValueError(f"codes must be (N, K), got shape {codes.shape}")
    n, k = codes.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"K = {k} is not a multiple of the group size {group_size}")
    g = k // group_size
    if scale.shape != (n, g) or zero.shape != (n, g):
        raise ValueError(f"scale {scale.shape} and zero {zero.shape} must both be {(n, g)}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes must lie in [0, 15]")
    if scale_dtype not in ("auto", "float16", "float32"):
        raise ValueError(f"scale_dtype must be auto, float16 or float32, not {scale_dtype!r}")

    npad = -(-n // CHUNK_ROWS) * CHUNK_ROWS
    q = np.zeros((npad, k), dtype=np.uint8)
    q[:n] = codes
    q = q.reshape(npad // CHUNK_ROWS, 2, 16, k)  # (chunk, nibble, byte, K): row 32 chunk + 16 nibble + byte
    nibbles = q[:, 1] << 4
    nibbles |= q[:, 0]  # (chunk, byte, K)
    nibbles = nibbles.reshape(npad // 2, k)
    packed = _aligned_empty((k, npad // 2), np.dtype(np.uint8))
    for r in range(0, npad // 2, 64):  # (K, npad / 2): column j's run of rows; in slabs, cache-friendly
        packed[:, r : r + 64] = nibbles[r : r + 64].T

    fp16 = None
    if scale_dtype == "auto":
        fp16 = _fp16_form(scale, zero)
    elif scale_dtype == "float16":
        fp16 = (scale.astype(np.float16), (zero - np.float32(8.0) * scale).astype(np.float16))
    if fp16 is not None:
        first, second, dtype = fp16[0], fp16[1], np.dtype(np.float16)
    else:
        first, second, dtype = scale, zero, np.dtype(np.float32)
    sz = _aligned_empty((g, 2, npad), dtype, 64)
    sz[...] = 0
    sz[:, 0, :n] = first.T  # (G, N)
    sz[:, 1, :n] = second.T
    return PackedInt4(packed, sz, n, k, group_size)
