"""GGUF tensor data -> numpy: dequantized floats, or exact INT4 codes for the 4-bit formats.

Tensor data is memory-mapped; each tensor is read when asked for, so loading streams.

GGUF shapes list the fastest-varying dimension first: a weight with ne = (K, N) is N rows of
K values, numpy shape (N, K). Quantized rows are sequences of blocks (byte layouts below,
all little-endian, fp16 scales):

    Q4_0  18 B / 32 values: d, qs[16]             value i: (nibble_i - 8) * d
    Q4_1  20 B / 32 values: d, m, qs[16]          value i: nibble_i * d + m
          nibble_i = qs[i] & 15 for i < 16, qs[i - 16] >> 4 otherwise
    Q4_K 144 B / 256 values: d, dmin, scales[12], qs[128]
          8 sub-blocks of 32 with a 6-bit scale sc_j and min m_j packed in `scales`;
          value: d * sc_j * nibble - dmin * m_j. qs holds 4 chunks of 32 bytes; chunk c
          gives sub-block 2c its low nibbles and sub-block 2c + 1 its high nibbles.
"""

from __future__ import annotations

import contextlib
import mmap

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmlocal.models import ModelSpec, TensorInfo, read_gguf_header

Q4_0, Q4_1, Q4_K = 2, 3, 12  # ggml type ids
INT4_TYPES = frozenset({Q4_0, Q4_1, Q4_K})


@dataclass(frozen=True)
class Int4Codes:
    """W = (codes - 8) * scale + zero, per group of 32 along each row."""

    codes: np.ndarray  # (N, K) uint8 in [0, 15]
    scale: np.ndarray  # (N, K // 32) float32
    zero: np.ndarray  # (N, K // 32) float32
    group_size: int = 32


class QuantEmbedding:
    """A token embedding looked up in the file's own bytes: the rows asked for are dequantized
    as they are read (gguf-py, every GGUF type), so no float copy of the table is ever built
    (on Qwen2.5-1.5B that copy was 0.9 GB of RAM and seconds of every load)."""

    def __init__(self, raw: np.ndarray, qtype: int, width: int) -> None:
        self.raw = raw  # (vocab, row bytes) uint8, memory-mapped
        self.qtype = qtype
        self.width = width

    def __call__(self, ids: Any) -> Any:
        """(N,) token ids -> (N, width) float32 rows (a new tensor the caller may overwrite)."""
        import torch
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = self.raw[ids.cpu().numpy()]
        out = dequantize(rows, GGMLQuantizationType(self.qtype)).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(out).reshape(len(rows), self.width))

    def weight_bytes(self) -> int:
        return 0  # a token reads one row: nothing per token worth counting


class GGUFTensors:
    """Random access to the tensors of one GGUF file."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._data_offset = read_gguf_header(spec.path).data_offset
        self._infos = {t.name: t for t in spec.tensors}
        self._mmap = np.memmap(spec.path, dtype=np.uint8, mode="r")

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def raw(self, name: str) -> np.ndarray:
        """(rows, row_bytes) uint8 view of the stored bytes."""
        t = self._infos[name]
        start = self._data_offset + t.offset
        rows = t.n_elements // t.shape[0]
        return self._mmap[start : start + t.n_bytes].reshape(rows, t.n_bytes // rows)

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape (slowest dimension first)."""
        return tuple(reversed(self._infos[name].shape))

    def release_pages(self, names: Iterable[str] | None = None) -> None:
        """Take the file's pages (of the tensors ``names``; None: all) out of this process's
        resident memory once the load has copied what it keeps: they stay in the page cache, and
        a later read maps them back (token embedding rows are read so). Loading then holds the
        packed copy and the pages of the layers being packed, not the whole file twice (the
        1.5B: 1.9 GiB resident after loading, 0.9 GiB of it the file's pages)."""
        mm = getattr(self._mmap, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        with contextlib.suppress(OSError, ValueError):
            if names is None:
                mm.madvise(mmap.MADV_DONTNEED)
                return
            page = mmap.PAGESIZE
            for name in names:
                t = self._infos[name]
                start = self._data_offset + t.offset
                first, last = -(-start // page) * page, (start + t.n_bytes) // page * page  # whole pages of its own
                if last > first:
                    mm.madvise(mmap.MADV_DONTNEED, first, last - first)

    def names(self) -> list[str]:
        return list(self._infos)

    def embedding(self, name: str) -> QuantEmbedding:
        """Row lookups of a quantized (vocab, width) tensor in its own bytes."""
        return QuantEmbedding(self.raw(name), self._infos[name].ggml_type, self.shape(name)[1])

    def float32(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._infos[name]
        raw = self.raw(name)
        qtype = GGMLQuantizationType(t.ggml_type)
        if qtype == GGMLQuantizationType.F32:
            out = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            out = raw.view(np.float16).astype(np.float32)
        else:
            out = dequantize(raw, qtype).astype(np.float32, copy=False)
        return out.reshape(self.shape(name))

    def int4(self, name: str) -> Int4Codes:
        """Exact INT4 codes, scales and zeros of a Q4_0 / Q4_1 / Q4_K tensor."""
        t = self._infos[name]
        raw = self.raw(name)
        n = raw.shape[0]
        if t.ggml_type in (Q4_0, Q4_1):
            blocks = raw.reshape(n, -1, 18 if t.ggml_type == Q4_0 else 20)  # (N, K/32, bytes)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., -16:]
            codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # (N, K/32, 32)
            if t.ggml_type == Q4_0:
                zero = np.zeros_like(d)
            else:
                m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                zero = m + 8.0 * d
            return Int4Codes(codes.reshape(n, -1), d, zero)
        if t.ggml_type == Q4_K:
            blocks = raw.reshape(n, -1, 144)  # (N, K/256, 144)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            sc, mn = _unpack_q4k_scales(blocks[..., 4:16])  # (N, K/256, 8) each
            qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # (N, K/256, chunk, 32)
            # sub-block 2c = low nibbles of chunk c, 2c + 1 = high nibbles
            codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1)  # (N, K)
            scale = d[..., None] * sc  # (N, K/256, 8)
            zero = 8.0 * scale - dmin[..., None] * mn
            return Int4Codes(codes, scale.reshape(n, -1), zero.reshape(n, -1))
        raise ValueError(f"{name} is {t.type_name}, not a 4-bit format with an exact INT4 form")


def _unpack_q4k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins (float32), per super-block.

    Sub-blocks 0-3: scale = s[j] & 63, min = s[j + 4] & 63. Sub-blocks 4-7 keep their low
    4 bits in s[j + 4] (scale low nibble, min high nibble) and their top 2 bits in the top
    bits of s[j - 4] (scale) and s[j] (min).
    """
    s = s.astype(np.uint8)
    lo_sc = s[..., 0:4] & 63
    lo_mn = s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = np.concatenate([lo_sc, hi_sc], axis=-1).astype(np.float32)
    mn = np.concatenate([lo_mn, hi_mn], axis=-1).astype(np.float32)
    return sc, mn
