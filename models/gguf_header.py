"""Read a GGUF file's header — metadata and tensor directory — without touching tensor data.

Byte layout (GGUF v2/v3, little-endian; v1 used 32-bit counts and is not supported):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, value_type u32, value)
    n_tensors x (name: str, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data

where ``str`` is a u64 byte length followed by UTF-8 bytes and an array value is
``elem_type u32 | count u64 | count x elem``. The file is memory-mapped and parsed in place,
so a multi-gigabyte model costs only the pages of its header. Large arrays other than the
token list (merges, scores, token types) are skipped, keeping only their length.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from .errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value_type -> struct format of one scalar
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B",  # UINT8
    1: "<b",  # INT8
    2: "<H",  # UINT16
    3: "<h",  # INT16
    4: "<I",  # UINT32
    5: "<i",  # INT32
    6: "<f",  # FLOAT32
    7: "<?",  # BOOL
    10: "<Q",  # UINT64
    11: "<q",  # INT64
    12: "<d",  # FLOAT64
}
_STRING, _ARRAY = 8, 9

# Arrays whose elements we keep; other arrays are recorded as ArrayInfo (type and length).
_KEPT_ARRAYS = {"tokenizer.ggml.tokens"}
# Scalar arrays shorter than this are kept (per-layer head counts, sparsity thresholds...).
_SMALL_ARRAY = 4096


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array that was skipped: its element type and length."""

    elem_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the data section
    n_bytes: int

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    file_size: int


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reader over a buffer; raises on reading past its end."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFormatError(
                f"{self.path} is truncated (its header ends early): download or convert it again."
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int, keep: bool) -> list[str] | None:
        """``count`` strings in a row (a vocabulary: 150k of them), decoded when ``keep``, else
        skipped; one tight loop, 3-4x faster than `string` per item."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out: list[str] | None = [] if keep else None
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self._need(8)
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > end:
                self.pos = pos
                self._need(n)
            if out is not None:
                out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        elem_type = cur.scalar("<I")
        length = cur.scalar("<Q")
        if elem_type == _STRING:
            kept = cur.strings(length, key in _KEPT_ARRAYS)
            return kept if kept is not None else ArrayInfo(elem_type, length)
        if elem_type not in _SCALAR_FORMATS:
            raise ModelFormatError(
                f"{cur.path} has a nested or unknown array type in '{key}': it is not a GGUF "
                "file llmlocal can read."
            )
        fmt = _SCALAR_FORMATS[elem_type]
        size = struct.calcsize(fmt)
        cur._need(size * length)
        if length <= _SMALL_ARRAY:
            values = list(struct.unpack_from(f"<{length}{fmt[1]}", cur.buf, cur.pos))
            cur.pos += size * length
            return values
        cur.pos += size * length
        return ArrayInfo(elem_type, length)
    raise ModelFormatError(
        f"{cur.path} has an unknown metadata type {vtype} for '{key}': it is not a GGUF file "
        "llmlocal can read."
    )


def _tensor_bytes(shape: tuple[int, ...], ggml_type: int, name: str, path: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFormatError(
            f"{path}: tensor '{name}' has tensor type {ggml_type}, which this version of gguf "
            "does not know; upgrade llmlocal's gguf package or convert the model again."
        ) from None
    n = 1
    for d in shape:
        n *= d
    if shape and shape[0] % block_size:
        raise ModelFormatError(
            f"{path}: tensor '{name}' has a row of {shape[0]} values, not a multiple of its "
            f"block size {block_size}: the file is corrupt; convert it again."
        )
    return n // block_size * type_size


_PARSED: dict[tuple[str, int, int], GGUFHeader] = {}  # (path, size, mtime) -> header, the last few


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path``; check that all tensor data is present.
    A file parsed before and unchanged since (same size and mtime) is not parsed again: a
    vocabulary of 150k tokens takes a second in Python, and a load reads the header twice."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _PARSED:
        return _PARSED[key]
    header = _read(path)
    if key is not None:
        if len(_PARSED) >= 4:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = header
    return header


def _read(path: str) -> GGUFHeader:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ModelFormatError(f"{path} does not exist: check the path.") from None
    except IsADirectoryError:
        raise ModelFormatError(f"{path} is a directory, not a GGUF file: pass the .gguf file inside it.") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ModelFormatError(f"{path} is not a GGUF file (it is {size} bytes): pass a .gguf model file.")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise ModelFormatError(
                    f"{path} is not a GGUF file (it does not start with 'GGUF'): pass a .gguf "
                    "model, or convert a Hugging Face checkpoint with `llmlocal quantize`."
                )
            return _parse(_Cursor(buf, path), size)


def _parse(cur: _Cursor, file_size: int) -> GGUFHeader:
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFormatError(
            f"{cur.path} is GGUF version {version}; llmlocal reads versions 2 and 3: convert it "
            "again with a current llama.cpp or `llmlocal quantize`."
        )
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise ModelFormatError(f"{cur.path} has an implausible GGUF header: the file is corrupt.")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.scalar("<I")
        metadata[key] = _read_value(cur, vtype, key)

    infos: list[TensorInfo] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise ModelFormatError(f"{cur.path}: tensor '{name}' has {n_dims} dimensions: the file is corrupt.")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        ggml_type = cur.scalar("<I")
        offset = cur.scalar("<Q")
        infos.append(TensorInfo(name, shape, ggml_type, offset, _tensor_bytes(shape, ggml_type, name, cur.path)))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    data_end = max((t.offset + t.n_bytes for t in infos), default=0)
    if data_offset + data_end > file_size:
        missing = data_offset + data_end - file_size
        raise ModelFormatError(
            f"{cur.path} is truncated ({missing:,} bytes of tensor data are missing): download "
            "or convert it again."
        )
    return GGUFHeader(version, metadata, tuple(infos), data_offset, file_size)
