"""GGUF quantized tensors in the column-major layout of the int8-activation kernels (csrc/qmat.h).

A tensor's blocks are decoded once at load into unsigned codes q and per-row factors, then
repacked column-major: every weight keeps its own bits (no expansion to INT8 or floats), and
the kernels compute with it directly:

    w = D * q + M,   D = d * sc,   M = -dmin * mn (K-quants) | m (Q4_1, Q5_1) | -off * D

GGUF block layouts decoded here (little-endian, fp16 d / m / dmin; value index i in a block):

    Q4_0   18 B / 32:  d, qs[16]              q_i = nibble i (qs[i] & 15 for i < 16, qs[i-16] >> 4), off 8
    Q4_1   20 B / 32:  d, m, qs[16]           q_i = nibble i
    Q5_0   22 B / 32:  d, qh (u32), qs[16]    q_i = nibble i | bit i of qh << 4, off 16
    Q5_1   24 B / 32:  d, m, qh, qs[16]       as Q5_0, no offset
    Q8_0   34 B / 32:  d, qs[32] int8         w = d * qs (signed codes)
    Q4_K  144 B / 256: d, dmin, scales[12], qs[128]: sub-block s of 32 has 6-bit (sc, mn) packed
                       in `scales`; qs chunk c (32 bytes) gives sub-block 2c its low nibbles and
                       2c + 1 its high ones;  w = d sc q - dmin mn
    Q5_K  176 B / 256: d, dmin, scales[12], qh[32], qs[128]: as Q4_K, and bit s of qh[l] is the
                       fifth bit of value l of sub-block s
    Q6_K  210 B / 256: ql[128], qh[64], sc[16] int8, d: in each half h (128 values), value
                       32t + l takes ql[64h + l + 32 (t & 1)] (low nibble for t < 2, high
                       otherwise) and bits 2t..2t+1 of qh[32h + l]; sub-blocks of 16 with sc,
                       w = d sc (q - 32)

Chunk layout (one column, 32 rows r, cb = 4 * bits bytes; chosen so that the AVX2 kernel's
interleave of four columns gives rows in natural order). Each column is its own run of bytes,
so the sparse kernels skip the runs of zeroed inputs:

    low nibbles  bytes 0..15   row r at byte 8 (r // 16) + r % 8, high nibble when (r % 16) >= 8
    5-bit plane  bytes 16..19  bit 4 of row r at byte r % 4, bit 2 (r // 8) + (r % 8) // 4
    6-bit plane  bytes 16..23  bits 4..5 of row r at byte r % 8, bits 2 (r // 8) .. + 1
    8-bit        bytes 0..31   row r at byte 4 (r // 8) + r % 4 + 16 ((r % 8) // 4)

Interleaved (dense decoding): the four columns 4i .. 4i + 3 of a chunk are stored together, in
4 cb bytes already in the order that interleave produces: byte c of column t's chunk at 4 c + t
(8-bit: row r's four codes at 4 r .. 4 r + 3; 6-bit: the byte of row r < 16's four codes at
4 (r % 8) + t in bytes 0..31 (r < 8) or 32..63, its low 6 bits the code and its top 2 the top
bits of row r + 16's code, whose low 4 bits are in bytes 64..95, nibble r // 8 of byte
4 (r % 8) + t: rows 0..15 need one mask, rows 16..31 a nibble and two bits); and the quads of a group are tiled by chunk,
tile (chunk c, group g) = the group's quads in order, tiles in the order (c, g): the codes of
32 rows over every input are one run. The kernel then loads instead of shuffling (measured
1.5-2x fewer instructions per weight), sums a row over all of K in registers, and reads one
sequential stream per thread; a column can no longer be skipped alone, so thresholds only
zero values there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import ALIGN, CHUNK_ROWS, _aligned_empty

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14


@dataclass(frozen=True)
class QFormat:
    """One GGUF type as the kernels see it (the table of qmat.h)."""

    name: str
    bits: int
    group: int  # inputs per (D, M) factor
    dgroup: int  # inputs per d (and m / dmin)
    off: int
    block_values: int
    block_bytes: int
    has_m: bool = False
    has_sc: bool = False
    has_mn: bool = False


FORMATS: dict[int, QFormat] = {
    Q4_0: QFormat("Q4_0", 4, 32, 32, 8, 32, 18),
    Q4_1: QFormat("Q4_1", 4, 32, 32, 0, 32, 20, has_m=True),
    Q5_0: QFormat("Q5_0", 5, 32, 32, 16, 32, 22),
    Q5_1: QFormat("Q5_1", 5, 32, 32, 0, 32, 24, has_m=True),
    Q8_0: QFormat("Q8_0", 8, 32, 32, 0, 32, 34),
    Q4_K: QFormat("Q4_K", 4, 32, 256, 0, 256, 144, has_m=True, has_sc=True, has_mn=True),
    Q5_K: QFormat("Q5_K", 5, 32, 256, 0, 256, 176, has_m=True, has_sc=True, has_mn=True),
    Q6_K: QFormat("Q6_K", 6, 16, 256, 32, 256, 210, has_sc=True),
}
QUANT_TYPES = frozenset(FORMATS)


@dataclass(frozen=True)
class QuantCodes:
    """A decoded tensor, rows in natural order: codes (N, K) uint8 (Q8_0: int8 bits), and per
    row d / m (N, K // dgroup) fp16 bits, sc / mn (N, K // group) uint8 (Q6_K: int8 bits)."""

    qtype: int
    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None
    sc: np.ndarray | None = None
    mn: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    @staticmethod
    def concat(parts: list[QuantCodes]) -> QuantCodes:
        """Row-wise concatenation of tensors of one type (fused projections)."""
        if len({p.qtype for p in parts}) != 1:
            raise ValueError("only tensors of one type concatenate")
        if len(parts) == 1:
            return parts[0]

        def cat(name: str) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            return None if arrays[0] is None else np.concatenate(arrays)

        return QuantCodes(parts[0].qtype, cat("codes"), cat("d"), cat("m"), cat("sc"), cat("mn"))  # type: ignore[arg-type]

    def factors(self) -> tuple[np.ndarray, np.ndarray]:
        """(D, M), each (N, K // group) float32, as the kernels compute them."""
        f = FORMATS[self.qtype]
        per = f.dgroup // f.group
        d = np.repeat(self.d.view(np.float16).astype(np.float32), per, axis=1)
        if self.sc is not None:
            sc = self.sc.view(np.int8) if self.qtype == Q6_K else self.sc
            d = d * sc.astype(np.float32)
        if self.mn is not None:
            assert self.m is not None
            m = -(np.repeat(self.m.view(np.float16).astype(np.float32), per, axis=1) * self.mn.astype(np.float32))
        elif self.m is not None:
            m = self.m.view(np.float16).astype(np.float32)
        else:
            m = np.float32(-f.off) * d
        return d.astype(np.float32), m.astype(np.float32)

    def signed_codes(self) -> np.ndarray:
        return self.codes.view(np.int8) if self.qtype == Q8_0 else self.codes

    def dequantize(self) -> np.ndarray:
        """(N, K) float32 weight, w = D q + M per element."""
        f = FORMATS[self.qtype]
        d, m = self.factors()
        q = self.signed_codes().astype(np.float32)
        n, k = q.shape
        q = q.reshape(n, k // f.group, f.group)
        return (d[..., None] * q + m[..., None]).reshape(n, k).astype(np.float32)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) uint16 fp16 bits."""
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) values: low nibbles first, then high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes -> eight 6-bit scales and mins (uint8) of a Q4_K / Q5_K super-block:
    sub-blocks 0-3 keep theirs in the low 6 bits of s[j] (scale) and s[j + 4] (min); 4-7 keep
    the low 4 bits in s[j + 4] (scale low nibble, min high) and the top 2 in s[j - 4] and s[j]."""
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], axis=-1), np.concatenate([lo_mn, hi_mn], axis=-1)


def _native_codes(raw: np.ndarray, n: int, nb: int, qtype: int) -> np.ndarray | None:
    """(N, values nb) codes of the blocks decoded in C, or None without the kernels."""
    kernels = _kernels()
    if kernels is None:
        return None
    out = np.empty((n, FORMATS[qtype].block_values * nb), dtype=np.uint8)
    kernels.decode_codes(raw, n, nb, qtype, out)
    return out


def decode(raw: np.ndarray, qtype: int, native: bool = True) -> QuantCodes:
    """(N, row_bytes) uint8 of one GGUF tensor -> its codes and factors; the codes in one C pass
    where the kernels are built (`native`; the numpy here is its reference)."""
    if qtype not in FORMATS:
        raise ValueError(f"ggml type {qtype} has no native kernel")
    f = FORMATS[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    blk = raw.reshape(n, -1, f.block_bytes)  # (N, blocks, bytes)
    nb = blk.shape[1]
    m = sc = mn = None
    if qtype in (Q4_0, Q4_1, Q5_0, Q5_1):
        d = _f16(blk[..., 0:2])
        at = 2
        if qtype in (Q4_1, Q5_1):
            m, at = _f16(blk[..., 2:4]), 4
        q = _native_codes(raw, n, nb, qtype) if native else None
        if q is None:
            q = _nibbles(blk[..., -16:])
            if qtype in (Q5_0, Q5_1):
                qh = np.ascontiguousarray(blk[..., at : at + 4]).view(np.uint32)  # (N, blocks, 1)
                q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    elif qtype == Q8_0:
        d = _f16(blk[..., 0:2])
        q = blk[..., 2:]
    elif qtype in (Q4_K, Q5_K):
        d, m = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _k_scales(blk[..., 4:16])  # (N, blocks, 8)
        q = _native_codes(raw, n, nb, qtype) if native else None
        if q is None:
            qs = blk[..., -128:].reshape(n, nb, 4, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
            q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, nb, 256)
            if qtype == Q5_K:
                qh = blk[..., 16:48]  # (N, blocks, 32): bit s of byte l -> sub-block s, value l
                bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1  # (N, nb, 8, 32)
                q = q | (bits.reshape(n, nb, 256) << 4)
        sc, mn = sc.reshape(n, -1), mn.reshape(n, -1)
    else:  # Q6_K
        sc = np.ascontiguousarray(blk[..., 192:208]).reshape(n, -1)
        d = _f16(blk[..., 208:210])
        q = _native_codes(raw, n, nb, qtype) if native else None
        if q is None:
            ql = blk[..., 0:128].reshape(n, nb, 2, 2, 32)  # (half, +32, l)
            qh = blk[..., 128:192].reshape(n, nb, 2, 1, 32)  # (half, -, l)
            low = np.concatenate([ql & 15, ql >> 4], axis=3)  # (N, nb, half, t, l): t = 0..3
            high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
            q = (low | (high << 4)).reshape(n, nb, 256)
    return QuantCodes(qtype, q if q.ndim == 2 else np.ascontiguousarray(q.reshape(n, -1)).astype(np.uint8, copy=False),
                      np.ascontiguousarray(d.reshape(n, -1)),
                      None if m is None else np.ascontiguousarray(m.reshape(n, -1)),
                      None if sc is None else np.ascontiguousarray(sc), None if mn is None else np.ascontiguousarray(mn))


@dataclass(frozen=True)
class QuantRows:
    """Rows of one GGUF tensor as the file stores them, not yet decoded: raw (N, row_bytes) uint8
    (a view of the mapped file) and the indices of its rows in the order wanted (None: all, in
    order; a RoPE row permutation is such an order). `pack_rows` packs them for the interleaved
    kernels in one pass from the file's bytes; `decode` gives their codes for every other use."""

    qtype: int
    raw: np.ndarray
    rows: np.ndarray | None = None
    name: str = ""  # the tensor's name in the file (blk.3.ffn_down.weight), where known

    @property
    def shape(self) -> tuple[int, int]:
        f = FORMATS[self.qtype]
        n = self.raw.shape[0] if self.rows is None else len(self.rows)
        return n, self.raw.shape[1] // f.block_bytes * f.block_values

    def decode(self) -> QuantCodes:
        return decode(self.raw if self.rows is None else self.raw[self.rows], self.qtype)

    def addresses(self) -> np.ndarray:
        """(N,) uint64 address of each wanted row's first byte."""
        raw = self.raw
        if not raw.flags.c_contiguous:
            raise ValueError("QuantRows.raw must be C-contiguous")
        idx = np.arange(raw.shape[0], dtype=np.uint64) if self.rows is None else np.asarray(self.rows, dtype=np.uint64)
        return np.uint64(raw.ctypes.data) + idx * np.uint64(raw.shape[1])


@dataclass(frozen=True)
class PackedQuant:
    """The kernels' arrays: codes (K, colstride) uint8, d / m (K // dgroup, npad) uint16 (fp16),
    sc (K // group, npad) uint8 (Q6_K: int8 scales; Q4_K / Q5_K: the 6-bit scale and, above it,
    the top 2 bits of the 6-bit min), mn (K // 256, npad) uint32 (Q4_K / Q5_K: the low 4 bits of
    sub-block j's min at bit 4j); m, sc, mn None where the type has none. Interleaved, each
    array holds the same values chunk by chunk, (npad // 32, F, 32) for F factors a row. Every
    type reads the file's own bytes per weight, no more."""

    qtype: int
    n: int
    k: int
    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    sc: np.ndarray | None
    mn: np.ndarray | None
    interleaved: bool = False

    @property
    def format(self) -> QFormat:
        return FORMATS[self.qtype]

    @property
    def npad(self) -> int:
        return -(-self.n // CHUNK_ROWS) * CHUNK_ROWS

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.d, self.m, self.sc, self.mn) if a is not None)


def _kernels():  # type: ignore[no-untyped-def]
    """The native module when it is built (it packs the interleaved layout in C), else None."""
    from . import runtime

    return runtime.kernels() if runtime.built() else None


def _chunks(q: np.ndarray, bits: int) -> np.ndarray:
    """(K, nch, 32) codes of each column's chunks -> (K, nch, 4 * bits) bytes (module docstring)."""
    kk, nch, _ = q.shape
    if bits == 8:  # row 8v + 4w + e -> byte 16w + 4v + e
        return np.ascontiguousarray(q.reshape(kk, nch, 4, 2, 4).transpose(0, 1, 3, 2, 4)).reshape(kk, nch, 32)
    low = (q & 15).reshape(kk, nch, 2, 2, 8)  # (half, nibble, b)
    planes = [(low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(kk, nch, 16)]
    hi = q >> 4
    if bits == 5:  # row 8v + 4w + p -> bit 2v + w of byte p
        h = hi.reshape(kk, nch, 4, 2, 4).astype(np.uint8)
        shift = (2 * np.arange(4, dtype=np.uint8)[:, None] + np.arange(2, dtype=np.uint8)[None, :])[..., None]
        planes.append(np.bitwise_or.reduce(h << shift, axis=(2, 3)).astype(np.uint8))
    elif bits == 6:  # row 8c + p -> bits 2c of byte p
        h = hi.reshape(kk, nch, 4, 8)
        planes.append(np.bitwise_or.reduce(h << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2).astype(np.uint8))
    return np.concatenate(planes, axis=-1)


def _pack_codes(c: QuantCodes, f: QFormat, npad: int, interleaved: bool, codes: np.ndarray) -> None:
    """The codes array of `pack` in numpy (the reference of the C packer for the interleaved
    layout, and the column layout's only packer)."""
    n, k = c.shape
    for j0 in range(0, k, 256):  # in slabs of columns: bounded temporaries
        j1 = min(k, j0 + 256)
        q = np.zeros((j1 - j0, npad), dtype=np.uint8)
        q[:, :n] = c.codes[:, j0:j1].T
        q = q.reshape(j1 - j0, npad // 32, 32)
        if not interleaved:
            codes[j0:j1] = _chunks(q, f.bits).reshape(j1 - j0, -1)
            continue
        nq, nch = (j1 - j0) // 4, npad // 32
        if f.bits == 8:  # rows in natural order, each row's four codes together
            quads = q.reshape(nq, 4, nch, 32).transpose(0, 2, 3, 1)  # (quad, chunk, row, column)
        elif f.bits == 6:  # rows 0-7 and 8-15 whole, with the top bits of rows 16-23 / 24-31; their nibbles
            r = q.reshape(nq, 4, nch, 32).transpose(0, 2, 3, 1)  # (quad, chunk, row, column)
            quads = np.concatenate([(r[:, :, 0:8] & 63) | ((r[:, :, 16:24] >> 4) << 6),
                                    (r[:, :, 8:16] & 63) | ((r[:, :, 24:32] >> 4) << 6),
                                    (r[:, :, 16:24] & 15) | ((r[:, :, 24:32] & 15) << 4)], axis=2)
        else:  # byte c of column t's chunk at 4 c + t
            quads = _chunks(q, f.bits).reshape(nq, 4, nch, -1).transpose(0, 2, 3, 1)  # (quad, chunk, byte, column)
        qpg, qb = f.group // 4, 16 * f.bits  # tiles (chunk, group) of the group's quads
        tiles = codes.reshape(nch, k // f.group, qpg * qb)
        tiles[:, j0 // f.group : j1 // f.group] = quads.reshape(nq // qpg, qpg, nch, qb).transpose(2, 0, 1, 3).reshape(nch, nq // qpg, -1)


def pack(c: QuantCodes, interleaved: bool = False, native: bool = True) -> PackedQuant:
    """Repack decoded codes into the kernels' column-major arrays; `interleaved` stores the
    columns in quads (dense use only, see the module docstring), in C where the kernels are
    built (`native`; the numpy below is the reference it is tested against, 5x slower)."""
    f = FORMATS[c.qtype]
    n, k = c.shape
    if k % f.dgroup:
        raise ValueError(f"{f.name} needs rows of a multiple of {f.dgroup} values, not {k}")
    npad = -(-n // CHUNK_ROWS) * CHUNK_ROWS
    codes = _aligned_empty((k, npad * f.bits // 8), np.dtype(np.uint8))
    kernels = _kernels() if interleaved and native else None
    if kernels is not None:
        kernels.pack_interleaved(np.ascontiguousarray(c.codes), n, k, f.bits, f.group, codes)
    else:
        _pack_codes(c, f, npad, interleaved, codes)

    def cols(a: np.ndarray | None, dtype: type) -> np.ndarray | None:
        """(N, F) factors -> (F, npad), or interleaved (npad / 32, F, 32): a chunk's run."""
        if a is None:
            return None
        out = _aligned_empty((a.shape[1], npad), np.dtype(dtype), 64)
        out[...] = 0
        if not interleaved:
            out[:, :n] = a.T
            return out
        rows = np.zeros((npad, a.shape[1]), dtype=dtype)
        rows[:n] = a
        out.reshape(-1)[:] = rows.reshape(npad // 32, 32, -1).transpose(0, 2, 1).reshape(-1)
        return out

    sc, mn = c.sc, c.mn
    if mn is not None:  # K-quants: 6-bit (sc, mn), 12 bytes per super-block row as in the file
        assert sc is not None
        sc = ((sc & 63) | ((mn >> 4) << 6)).astype(np.uint8)  # (N, G): the scale, the min's top 2 bits
        low = (c.mn & 15).astype(np.uint32).reshape(n, -1, 8)  # (N, S, 8): the mins' low 4 bits
        mn = np.bitwise_or.reduce(low << (4 * np.arange(8, dtype=np.uint32)), axis=-1).astype(np.uint32)  # (N, S)
    return PackedQuant(c.qtype, n, k, codes, cols(c.d, np.uint16), cols(c.m, np.uint16),  # type: ignore[arg-type]
                       cols(sc, np.uint8), cols(mn, np.uint32), interleaved)


def pack_rows(parts: list[QuantRows]) -> PackedQuant | None:
    """The interleaved `PackedQuant` of the rows of ``parts`` (one type, stacked: a fused
    projection) straight from the file's bytes in one C pass: the same arrays as
    ``pack(QuantCodes.concat([p.decode() for p in parts]), interleaved=True)`` without the
    decoded codes in between (measured on the 1.5B: see docs/performance.md). None without the
    kernels."""
    kernels = _kernels()
    if kernels is None:
        return None
    qtype = parts[0].qtype
    if any(p.qtype != qtype for p in parts) or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("only rows of one type and width stack")
    f = FORMATS[qtype]
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if k % f.dgroup:
        raise ValueError(f"{f.name} needs rows of a multiple of {f.dgroup} values, not {k}")
    npad = -(-n // CHUNK_ROWS) * CHUNK_ROWS
    rows = np.concatenate([p.addresses() for p in parts])
    codes = _aligned_empty((k, npad * f.bits // 8), np.dtype(np.uint8))

    def factors(present: bool, per: int, dtype: type) -> np.ndarray | None:
        return _aligned_empty((k // per, npad), np.dtype(dtype), 64) if present else None

    d, m = factors(True, f.dgroup, np.uint16), factors(f.has_m, f.dgroup, np.uint16)
    sc, mn = factors(f.has_sc, f.group, np.uint8), factors(f.has_mn, 256, np.uint32)
    kernels.pack_rows(qtype, rows, n, k, codes, d, m, sc, mn)
    return PackedQuant(qtype, n, k, codes, d, m, sc, mn, interleaved=True)


def wider_than_q4_0(qtype: int) -> bool:
    """Whether a type reads more bytes a weight than Q4_0 (18 per 32): every other but Q4_K."""
    f = FORMATS[qtype]
    return f.block_bytes * FORMATS[Q4_0].block_values > FORMATS[Q4_0].block_bytes * f.block_values


def q4_0_nbytes(values: int) -> int:
    """Bytes of ``values`` weights (whole blocks of 32) as Q4_0."""
    return values // FORMATS[Q4_0].block_values * FORMATS[Q4_0].block_bytes


def requantize_q4_0(rows: QuantRows) -> QuantRows | None:
    """The rows as Q4_0 (4.5 bits a weight), dequantized and quantized again in one C pass: a
    draft model's projections, whose numbers only propose (the target checks every token), read
    fewer bytes so. Each block of 32 takes d = its value of largest magnitude / -8 (as fp16) and
    each value the nearest code (`qm_requant_q4_0`). None without the kernels."""
    kernels = _kernels()
    if kernels is None:
        return None
    n, k = rows.shape
    out = np.empty((n, q4_0_nbytes(k)), dtype=np.uint8)
    kernels.requant_q4_0(rows.qtype, rows.addresses(), n, k, out)
    return QuantRows(Q4_0, out, name=f"{rows.name}@Q4_0" if rows.name else "")


def quantize_activations(x: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' int8 activations: per row and block of 32 inputs, dx = max |kept x| / 127,
    qx = round-half-even(x / dx) (as x * (1 / dx) in float32) where kept, else 0."""
    x = np.asarray(x, dtype=np.float32)
    b, k = x.shape
    xb = np.where(keep, np.abs(x), np.float32(0)).reshape(b, k // 32, 32)
    dx = (xb.max(axis=-1) / np.float32(127)).astype(np.float32)  # (B, K/32)
    with np.errstate(divide="ignore"):
        inv = np.where(dx > 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    q = np.rint(x.reshape(b, k // 32, 32) * inv[..., None]).reshape(b, k)
    return np.where(keep, q, 0).astype(np.int8), dx


def reference_gemv(c: QuantCodes, x: np.ndarray, threshold: float | None = None) -> np.ndarray:
    """y (B, N) as the kernels compute it: int8 activations x^ = dx qx, integer sums per group,
    then y += D dx sum(q qx) + M dx sum(qx), in float64 (the kernels' float32 rounding is within the test
    tolerance)."""
    f = FORMATS[c.qtype]
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    keep = np.ones_like(x, dtype=bool) if threshold is None else np.abs(x) > threshold
    qx, dx = quantize_activations(x, keep)
    d, m = c.factors()  # (N, G)
    n, k = c.shape
    g = k // f.group
    q = c.signed_codes().astype(np.int64).reshape(n, g, f.group)
    sums = np.einsum("ngj,bgj->bng", q, qx.astype(np.int64).reshape(-1, g, f.group))  # (B, N, G)
    dxg = np.repeat(dx, 32 // f.group, axis=1) if f.group < 32 else dx  # (B, G)
    # the M term takes the quantized x too: sum_j w_j x^_j is what the kernels approximate
    xs = (qx.astype(np.float64).reshape(-1, g, f.group).sum(-1)) * dxg  # (B, G)
    y = (d[None] * dxg[:, None, :] * sums).sum(-1) + (m[None] * xs[:, None, :]).sum(-1)
    return y.astype(np.float32)


__all__ = ["ALIGN", "FORMATS", "QUANT_TYPES", "PackedQuant", "QFormat", "QuantCodes", "QuantRows", "decode", "pack", "pack_rows",
           "quantize_activations", "reference_gemv"]
