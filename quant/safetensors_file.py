"""One `.safetensors` file: its header checked, its tensors memory-mapped row range by row range.

Byte layout:

    n u64 little-endian | n bytes of JSON header | tensor data
    header = {name: {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]},
              "__metadata__": {...}}          offsets are relative to the start of tensor data

Tensors are row-major. Reading a row range maps only its pages; `release` hands them back
(``MADV_DONTNEED``), so converting a checkpoint tensor by tensor keeps resident memory at a
few chunks, not the size of the file. BF16 has no numpy dtype: its rows come back as uint16
bit patterns (the top half of a float32).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CheckpointError

# safetensors dtype -> (numpy storage dtype, GGML type name of the same bits)
DTYPES: dict[str, tuple[str, str]] = {
    "F32": ("<f4", "F32"),
    "F16": ("<f2", "F16"),
    "BF16": ("<u2", "BF16"),
}
_ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_MAX_HEADER = 100 * 1024 * 1024  # a header larger than this is corruption, not a model


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors spelling: "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_length(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.row_length if self.row_length else 0


class SafetensorsFile:
    """An open, validated safetensors file (use as a context manager or call `close`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} does not exist: download the checkpoint again.") from None
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self.entries, self.metadata = self._read_header()
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self._file.close()
            raise
        if self._mmap is not None and hasattr(mmap, "MADV_SEQUENTIAL"):
            self._mmap.madvise(mmap.MADV_SEQUENTIAL)

    def _corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path} is not a valid safetensors file ({what}): download or save it again."
        )

    def _read_header(self) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
        head = self._file.read(8)
        if len(head) < 8:
            raise self._corrupt(f"it is only {self.size} bytes long")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > self.size:
            raise self._corrupt("its header length is impossible")
        try:
            header = json.loads(self._file.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._corrupt("its header is not JSON") from None
        if not isinstance(header, dict):
            raise self._corrupt("its header is not a JSON object")
        data_start = 8 + n
        metadata = header.pop("__metadata__", None) or {}
        entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            try:
                dtype = str(info["dtype"])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"the entry of tensor '{name}' is malformed") from None
            entry = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
            item = _ITEM_SIZES.get(dtype)
            if item is None or any(d < 0 for d in shape) or begin < 0 or end - begin != entry.n_elements * item:
                raise self._corrupt(f"tensor '{name}' has inconsistent dtype, shape and offsets")
            if entry.end > self.size:
                raise self._corrupt(f"tensor '{name}' runs past the end of the file, which is truncated")
            entries[name] = entry
        return entries, metadata

    # ---- data -----------------------------------------------------------------------------
    def rows(self, entry: TensorEntry, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of a tensor as a read-only view, shape (stop - start, row_length),
        in the storage dtype (BF16 as uint16)."""
        if entry.dtype not in DTYPES:
            raise CheckpointError(
                f"Tensor '{entry.name}' in {self.path} is stored as {entry.dtype}, which llmlocal does "
                "not convert: use the checkpoint's BF16, F16 or F32 release."
            )
        dtype = np.dtype(DTYPES[entry.dtype][0])
        row_bytes = entry.row_length * dtype.itemsize
        assert self._mmap is not None
        flat = np.frombuffer(
            self._mmap, dtype=dtype, count=(stop - start) * entry.row_length, offset=entry.begin + start * row_bytes
        )
        return flat.reshape(stop - start, entry.row_length)  # (rows, row_length)

    def release(self, entry: TensorEntry, start: int, stop: int) -> None:
        """Drop the resident pages of rows ``start:stop`` (they stay in the page cache)."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        row_bytes = entry.row_length * np.dtype(DTYPES.get(entry.dtype, ("<u1",))[0]).itemsize
        lo = entry.begin + start * row_bytes
        hi = entry.begin + stop * row_bytes
        # Whole pages covering the range. Dropping a page that a neighbouring chunk still reads
        # is harmless: a file-backed page faults back in from the page cache.
        lo = lo // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min((hi + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE, len(self._mmap))
        if hi > lo:
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
            self._mmap = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
