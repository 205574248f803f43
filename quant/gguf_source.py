"""A GGUF file as the source of a conversion: metadata copied key for key, tensors by row range.

The tensors are already in llama.cpp's layout (names, Q/K order), so nothing is renamed or
permuted. Metadata values are copied as raw bytes and numbers, so a vocabulary with
unusual bytes survives unchanged. Tensor data is memory-mapped and released as it is used,
like safetensors shards.
"""

from __future__ import annotations

import mmap
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from llmlocal.models import read_gguf_header
from llmlocal.models.tensor_names import ENGINE_ARCHS

from .errors import CheckpointError
from .gguf_writer import KV
from .source import ModelSource, SourceTensor

ARCHITECTURES = ENGINE_ARCHS  # what calibration runs through the engine's own decoder
# Keys the converter writes itself (or that describe the old file's layout, not the model).
_REPLACED = ("general.file_type", "general.quantization_version", "general.alignment")

_FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


class _MappedFile:
    """The GGUF file mapped once; rows are views, released page by page after use."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "rb")
        self.mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def release(self, lo: int, hi: int) -> None:
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = lo // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min((hi + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE, len(self.mm))
        if hi > lo:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced; the mapping goes with it
            pass
        self._file.close()


@dataclass(frozen=True)
class _GGUFRows:
    file: _MappedFile
    offset: int  # absolute offset of the tensor's first byte
    row_length: int
    ggml_type: str

    @property
    def _row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[self.ggml_type]]
        return self.row_length // block * type_size

    def rows(self, start: int, stop: int) -> np.ndarray:
        n = self._row_bytes
        if self.ggml_type in _FLOAT_DTYPES:
            dtype = np.dtype(_FLOAT_DTYPES[self.ggml_type])
            flat = np.frombuffer(self.file.mm, dtype, (stop - start) * self.row_length, self.offset + start * n)
            return flat.reshape(stop - start, self.row_length)
        flat = np.frombuffer(self.file.mm, np.uint8, (stop - start) * n, self.offset + start * n)
        return flat.reshape(stop - start, n)  # (rows, bytes per row) of blocks

    def release(self, start: int, stop: int) -> None:
        self.file.release(self.offset + start * self._row_bytes, self.offset + stop * self._row_bytes)


def _copy_field(field: Any) -> KV:
    """A GGUFReader field -> the same key, type and value for our writer."""
    main = GGUFValueType(field.types[0])
    if main == GGUFValueType.STRING:
        return KV(field.name, bytes(field.parts[-1]), main)
    if main != GGUFValueType.ARRAY:
        return KV(field.name, field.parts[-1][0].item(), main)
    elem = GGUFValueType(int(field.parts[3][0]))  # parts: key len, key, type, elem type, count, ...
    if elem == GGUFValueType.STRING:
        return KV.array(field.name, [bytes(field.parts[i]) for i in field.data], elem)
    if elem == GGUFValueType.ARRAY:
        raise CheckpointError(f"The GGUF key '{field.name}' holds nested arrays, which llmlocal does not copy.")
    values = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)
    return KV.array(field.name, values, elem)


def open_gguf(path: Path) -> ModelSource:
    """Open a GGUF model file as a source (any tensor types; the caller decides what it accepts)."""
    header = read_gguf_header(path)  # raises a one-sentence error for non-GGUF / truncated files
    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path} is a '{arch}' model; llmlocal quantize converts llama, mistral, qwen2, qwen3, gemma3 and phi3 models only."
        )
    if int(md.get("split.count", 1) or 1) > 1:
        raise CheckpointError(
            f"{path} is one part of a split GGUF: merge the parts first with llama.cpp's `llama-gguf-split --merge`."
        )
    reader = GGUFReader(path)
    metadata = [
        _copy_field(f) for name, f in reader.fields.items()
        if not name.startswith("GGUF.") and name not in _REPLACED and not name.startswith("split.")
    ]
    mapped = _MappedFile(os.fspath(path))
    tensors = []
    weights: Counter[str] = Counter()
    for t in reader.tensors:
        type_name = GGMLQuantizationType(t.tensor_type).name
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order
        tensors.append(SourceTensor(t.name, shape, type_name, _GGUFRows(mapped, int(t.data_offset), shape[-1], type_name)))
        if len(shape) > 1:
            weights[type_name] += t.n_elements
    del reader  # its own memory map of the file is no longer needed
    name = md.get("general.name")
    source = ModelSource(
        kind="gguf",
        path=os.fspath(path),
        name=name if isinstance(name, str) else Path(path).stem,
        architecture=arch,
        metadata=metadata,
        tensors=tensors,
        storage_type=weights.most_common(1)[0][0] if weights else "F32",
    )
    source.on_close(mapped.close)
    return source
