"""`ModelSource`: the model being converted, as GGUF metadata plus tensors readable by row range.

Both kinds of source — a Hugging Face checkpoint and a GGUF file — are opened into this one
shape, so the writer never knows where the rows come from. Tensors carry their GGUF names
and numpy shapes (rows first); q/k projections of llama checkpoints also carry the head count
their rows must be permuted with on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

import numpy as np

from .gguf_writer import KV


class RowReader(Protocol):
    def rows(self, start: int, stop: int) -> np.ndarray:
        """Stored rows ``start:stop``: (n, row_length) for float types, (n, bytes_per_row) uint8
        for block types."""
        ...

    def release(self, start: int, stop: int) -> None:
        """The rows are converted: their memory may go."""
        ...


@dataclass(frozen=True)
class ArrayRows:
    """Rows of an in-memory array (tensors the converter computes, such as rope_freqs)."""

    array: np.ndarray

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.array.reshape(-1, self.array.shape[-1])[start:stop]

    def release(self, start: int, stop: int) -> None:
        pass


@dataclass(frozen=True)
class SourceTensor:
    name: str  # GGUF name: "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # numpy order: (rows, row_length), or (n,) for vectors
    ggml_type: str  # how the source stores it: "BF16", "F32", "Q4_1", ...
    reader: RowReader = field(repr=False, compare=False)
    permute_heads: int = 0  # > 0: reorder rows with `permute_qk(rows, permute_heads)`

    @property
    def row_length(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n

    @property
    def n_elements(self) -> int:
        return self.n_rows * self.row_length


@dataclass
class ModelSource:
    kind: Literal["checkpoint", "gguf"]
    path: str  # the directory or file that was opened
    name: str  # model name (general.name)
    architecture: str  # GGUF architecture: "llama", "qwen2"
    metadata: list[KV]  # all keys except general.file_type and general.quantization_version
    tensors: list[SourceTensor]
    storage_type: str  # type of the source's 2-D weights: "BF16", "F16", "F32", or a quant type
    warnings: list[str] = field(default_factory=list)  # things the user should know, one line each
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def is_quantized(self) -> bool:
        return self.storage_type not in ("F32", "F16", "BF16")

    @property
    def gguf_path(self) -> str | None:
        """The source file itself when it is already a GGUF (llama.cpp can read it directly)."""
        return self.path if self.kind == "gguf" else None

    def on_close(self, closer: Callable[[], None]) -> None:
        self._closers.append(closer)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()

    def __enter__(self) -> ModelSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
