"""Packing ahead: a model's projections packed for the kernels by worker threads before
anyone asks for them (the C packer releases the GIL), handed over once to whoever builds each
one; and `type_runs`, how stacked parts split into one matrix per run of one type."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from .qlayout import PackedQuant, QuantCodes, QuantRows, pack_rows

PartT = TypeVar("PartT", QuantCodes, QuantRows)


def type_runs(parts: list[PartT]) -> list[list[PartT]]:
    """Consecutive parts of one type: a stacked projection is one matrix per such run."""
    runs: list[list[PartT]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


class PackAhead:
    """`pack_rows` of projections known in advance, run by worker threads (the C packer
    releases the GIL) while the caller does other work; whoever builds a projection `take`s
    its arrays. ``groups``: each projection's stacked parts, in the order they will be taken;
    ``packed``: called with each run once it is packed; ``saved``: runs packed before (by
    `run_key`, from a `PackedCache`), handed out instead of packing them again."""

    def __init__(self, groups: Iterable[list[QuantRows]], workers: int = 2,
                 packed: Callable[[list[QuantRows]], None] | None = None,
                 saved: Mapping[str, PackedQuant] | None = None) -> None:
        self._lock = threading.Lock()
        self._packed = packed
        self._jobs: dict[str, Future[PackedQuant | None]] = {}
        self._saved: dict[str, PackedQuant] = {}
        self.handed: dict[str, PackedQuant] = {}  # every run taken, by key
        self.packed_anew = 0  # runs taken that were not saved
        todo: dict[str, list[QuantRows]] = {}
        for group in groups:
            for run in type_runs(group):
                key = run_key(run)
                if key is None or key in todo or key in self._saved:
                    continue
                if saved is not None and key in saved:
                    self._saved[key] = saved[key]
                else:
                    todo[key] = run
        self._pool: ThreadPoolExecutor | None = None
        if todo:
            pool = self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="llmlocal-pack")
            self._jobs = {key: pool.submit(self._pack, run) for key, run in todo.items()}

    def _pack(self, run: list[QuantRows]) -> PackedQuant | None:
        out = pack_rows(run)
        if self._packed is not None:
            self._packed(run)
        return out

    def take(self, run: list[QuantRows]) -> PackedQuant | None:
        """The arrays of these rows (the same tensors, types and row orders) if they were
        packed ahead or saved (waiting for them if need be), else None; each run is taken once."""
        key = run_key(run)
        if key is None:
            return None
        with self._lock:
            saved = self._saved.pop(key, None)
            job = self._jobs.pop(key, None) if saved is None else None
        if saved is not None:
            out: PackedQuant | None = saved
        elif job is None:
            return None
        else:  # waited for, not packed here too: a second run in flight would raise the load's peak
            out = job.result()
        if out is not None:
            with self._lock:
                self.handed[key] = out
                self.packed_anew += saved is None
        return out

    def untaken(self) -> int:
        """Runs packed, packing or saved that nobody has taken."""
        with self._lock:
            return len(self._jobs) + len(self._saved)

    def close(self) -> None:
        """Drop what was not taken: jobs not started never run."""
        with self._lock:
            jobs, self._jobs, self._saved = self._jobs, {}, {}
        for job in jobs.values():
            job.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def run_key(run: list[QuantRows]) -> str | None:
    """What makes two runs the same rows, as a short name: each part's tensor, type, shape and
    row order (None for a part without a name)."""
    key = _rows_key(run)
    return None if key is None else hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


def _rows_key(run: list[QuantRows]) -> tuple[object, ...] | None:
    """What makes two runs the same rows: each part's tensor, type, shape and row order (None
    for a part without a name)."""
    if any(not p.name for p in run):
        return None
    return tuple((p.name, p.qtype, p.raw.shape, None if p.rows is None else np.asarray(p.rows).tobytes()) for p in run)


__all__ = ["PackAhead", "run_key", "type_runs"]
