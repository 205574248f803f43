"""Write a GGUF file in one pass: header, metadata, tensor directory, then tensor data in chunks.

Byte layout (GGUF v3, little-endian), the mirror of `llmlocal.models.gguf_header`:

    "GGUF" | version u32 = 3 | n_tensors u64 | n_kv u64
    n_kv x      (key: str, value_type u32, value)
    n_tensors x (name: str, n_dims u32, ne u64 x n_dims, ggml_type u32, offset u64)
    zero padding to ALIGNMENT | tensor data, each tensor starting at a multiple of ALIGNMENT

``str`` is a u64 byte length then UTF-8 bytes; an array is ``elem_type u32 | count u64 |
elems``. ``ne`` lists dimensions fastest-varying first, so a numpy (rows, cols) weight is
written as (cols, rows). Every offset is known before the first byte of data is written, so
the data can stream in as each tensor is converted, and nothing is ever held whole in memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_VERSION = 3
ALIGNMENT = 32

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class KV:
    """One metadata entry. Strings may be given as bytes (copied verbatim from another GGUF)."""

    key: str
    value: Any
    type: GGUFValueType
    elem_type: GGUFValueType | None = None  # for arrays

    @classmethod
    def string(cls, key: str, value: str | bytes) -> KV:
        return cls(key, value, GGUFValueType.STRING)

    @classmethod
    def u32(cls, key: str, value: int) -> KV:
        return cls(key, int(value), GGUFValueType.UINT32)

    @classmethod
    def i32(cls, key: str, value: int) -> KV:
        return cls(key, int(value), GGUFValueType.INT32)

    @classmethod
    def f32(cls, key: str, value: float) -> KV:
        return cls(key, float(value), GGUFValueType.FLOAT32)

    @classmethod
    def boolean(cls, key: str, value: bool) -> KV:
        return cls(key, bool(value), GGUFValueType.BOOL)

    @classmethod
    def array(cls, key: str, values: Sequence[Any], elem_type: GGUFValueType) -> KV:
        return cls(key, values, GGUFValueType.ARRAY, elem_type)


def _pack_string(value: str | bytes) -> bytes:
    raw = value if isinstance(value, bytes) else value.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(value: Any, vtype: GGUFValueType, elem_type: GGUFValueType | None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _pack_string(value)
    if vtype in _SCALAR_FORMATS:
        return struct.pack(_SCALAR_FORMATS[vtype], value)
    if vtype == GGUFValueType.ARRAY:
        assert elem_type is not None, "an array needs an element type"
        head = struct.pack("<IQ", int(elem_type), len(value))
        if elem_type == GGUFValueType.STRING:
            return head + b"".join(_pack_string(v) for v in value)
        if elem_type in _SCALAR_FORMATS:
            # One numpy conversion instead of 150k struct calls for a vocabulary's token types.
            return head + np.asarray(value, dtype=np.dtype(_SCALAR_FORMATS[elem_type])).tobytes()
        raise ValueError(f"nested GGUF arrays are not written ({elem_type!r})")
    raise ValueError(f"unknown GGUF value type {vtype!r}")


def pack_kv(kv: KV) -> bytes:
    return _pack_string(kv.key) + struct.pack("<I", int(kv.type)) + _pack_value(kv.value, kv.type, kv.elem_type)


def tensor_nbytes(shape: Sequence[int], ggml_type: str) -> int:
    """Bytes of a tensor of numpy ``shape`` stored as ``ggml_type`` (rows must hold whole blocks)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    n = 1
    for d in shape:
        n *= d
    assert (shape[-1] if shape else 1) % block == 0, f"row of {shape} does not hold whole {ggml_type} blocks"
    return n // block * type_size


@dataclass(frozen=True)
class TensorSlot:
    """A tensor's entry in the directory: where its data will go."""

    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: str
    nbytes: int
    offset: int  # from the start of the data section


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class GGUFStreamWriter:
    """Writes to an open binary file: `write_header` once, then for each tensor in directory
    order, `write` its bytes (in as many pieces as convenient) and `end_tensor`."""

    def __init__(self, out: BinaryIO, metadata: Sequence[KV], tensors: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
        self._out = out
        self._metadata = list(metadata)
        keys = [kv.key for kv in self._metadata]
        duplicates = {k for k in keys if keys.count(k) > 1}
        assert not duplicates, f"duplicate metadata keys {duplicates}"
        self.slots: list[TensorSlot] = []
        offset = 0
        for name, shape, ggml_type in tensors:
            nbytes = tensor_nbytes(shape, ggml_type)
            self.slots.append(TensorSlot(name, tuple(shape), ggml_type, nbytes, offset))
            offset = _pad(offset + nbytes)
        self.data_bytes = offset
        self._index = 0  # next tensor to receive data
        self._written = 0  # bytes of it so far
        self._header: bytes | None = None

    def header_bytes(self) -> bytes:
        if self._header is None:
            self._header = self._pack_header()
        return self._header

    def _pack_header(self) -> bytes:
        parts = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(self.slots), len(self._metadata))]
        parts += [pack_kv(kv) for kv in self._metadata]
        for slot in self.slots:
            ne = tuple(reversed(slot.shape)) or (1,)
            parts.append(_pack_string(slot.name))
            parts.append(struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, int(GGMLQuantizationType[slot.ggml_type]), slot.offset))
        header = b"".join(parts)
        return header + bytes(_pad(len(header)) - len(header))

    @property
    def total_bytes(self) -> int:
        return len(self.header_bytes()) + self.data_bytes

    def write_header(self) -> None:
        self._out.write(self.header_bytes())

    def write(self, data: np.ndarray | bytes | memoryview) -> None:
        """Append bytes of the current tensor (C-contiguous arrays are written without a copy)."""
        view = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        slot = self.slots[self._index]
        if self._written + view.nbytes > slot.nbytes:
            raise AssertionError(f"{slot.name}: {self._written + view.nbytes} bytes written, {slot.nbytes} expected")
        self._out.write(view)
        self._written += view.nbytes

    def end_tensor(self) -> None:
        slot = self.slots[self._index]
        if self._written != slot.nbytes:
            raise AssertionError(f"{slot.name}: {self._written} bytes written, {slot.nbytes} expected")
        self._out.write(bytes(_pad(slot.nbytes) - slot.nbytes))
        self._index += 1
        self._written = 0

    def finish(self) -> None:
        if self._index != len(self.slots):
            raise AssertionError(f"{len(self.slots) - self._index} tensors were not written")
