"""Stream a `ModelSource` into a GGUF file, chunk by chunk, with conversion on worker threads.

Each tensor is cut into chunks of whole rows (about `CHUNK_VALUES` values; whole heads for
q/k, whose rows are permuted within a head). A chunk is read from the memory-mapped source,
permuted, decoded to float32 and encoded to its output type on a worker thread (numpy
releases the GIL), while the main thread writes finished chunks in file order and then
releases their source pages. At most ``workers + 1`` chunks are in flight, so resident
memory is a few chunks and their temporaries, whatever the size of the model.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
import os
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from llmlocal.models.tensor_names import permute_qk

from .encode import decode, encode
from .errors import write_error
from .gguf_writer import KV, GGUFStreamWriter
from .progress import Progress
from .source import SourceTensor

CHUNK_VALUES = 4 * 1024 * 1024  # 16 MB of float32 per chunk: large enough to amortise numpy calls


@dataclass(frozen=True)
class _Chunk:
    tensor: SourceTensor
    out_type: str
    start: int  # rows
    stop: int
    last: bool  # the tensor's final chunk


def _chunks(tensor: SourceTensor, out_type: str) -> Iterator[_Chunk]:
    rows = tensor.n_rows
    step = max(1, CHUNK_VALUES // tensor.row_length)
    if tensor.permute_heads:
        head_rows = rows // tensor.permute_heads
        step = max(head_rows, step // head_rows * head_rows)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        yield _Chunk(tensor, out_type, start, stop, stop == rows)


def convert_chunk(tensor: SourceTensor, out_type: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``tensor`` as bytes of ``out_type`` (a C-contiguous array)."""
    raw = tensor.reader.rows(start, stop)  # (rows, row_length) or (rows, bytes_per_row)
    if tensor.permute_heads:
        head_rows = tensor.n_rows // tensor.permute_heads
        raw = permute_qk(raw, (stop - start) // head_rows)
    if tensor.ggml_type == out_type:
        return np.ascontiguousarray(raw)  # same bits: copied through, never rounded
    return encode(decode(raw, tensor.ggml_type), out_type)


def write_gguf_file(
    path: str | os.PathLike[str],
    metadata: Sequence[KV],
    planned: Sequence[tuple[SourceTensor, str]],
    *,
    workers: int = 2,
    progress: Progress | None = None,
    durable: bool = True,
) -> None:
    """`write_gguf` into a new file at ``path``; ``durable`` syncs it to disk (the file a
    rename will publish). A full disk or a denied write is one sentence (`write_error`)."""
    try:
        with open(path, "wb") as f:
            write_gguf(f, metadata, planned, workers=workers, progress=progress)
            if durable:
                f.flush()
                os.fsync(f.fileno())  # the rename must not publish a file whose data is still in flight
    except OSError as e:
        error = write_error(e, path)
        if error is None:
            raise
        raise error from None


def write_gguf(
    out: BinaryIO,
    metadata: Sequence[KV],
    planned: Sequence[tuple[SourceTensor, str]],
    *,
    workers: int = 2,
    progress: Progress | None = None,
) -> int:
    """Write the whole file to ``out``; returns its size in bytes."""
    writer = GGUFStreamWriter(out, metadata, [(t.name, t.shape, ggml_type) for t, ggml_type in planned])
    if progress is not None:
        progress.total = max(writer.total_bytes, 1)
        progress.items = len(planned)
    writer.write_header()
    if progress is not None:
        progress.advance(len(writer.header_bytes()))
    jobs = (chunk for tensor, ggml_type in planned for chunk in _chunks(tensor, ggml_type))
    pending: deque[tuple[_Chunk, Future[np.ndarray]]] = deque()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="llmlocal-quant") as pool:

        def submit_next() -> None:
            chunk = next(jobs, None)
            if chunk is not None:
                pending.append((chunk, pool.submit(convert_chunk, chunk.tensor, chunk.out_type, chunk.start, chunk.stop)))

        try:
            for _ in range(max(1, workers) + 1):
                submit_next()
            while pending:
                chunk, future = pending.popleft()
                data = future.result()
                writer.write(data)
                nbytes = data.nbytes
                del data  # drop any view into the source before its pages are released
                chunk.tensor.reader.release(chunk.start, chunk.stop)
                if chunk.last:
                    writer.end_tensor()
                if progress is not None:
                    progress.advance(nbytes, items=int(chunk.last))
                submit_next()
        finally:
            for _, future in pending:
                future.cancel()
            pending.clear()
    writer.finish()
    if progress is not None:
        progress.update(progress.total)
    return writer.total_bytes
