"""Packing ahead: a model's projections packed for the kernels by worker threads before
anyone asks for them (the C packer releases the GIL), handed over once to whoever builds each
one; and `type_runs`, how stacked parts split into one matrix per run of one type."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
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
    ``packed``: called in the worker with each run once it is packed."""

    def __init__(self, groups: Iterable[list[QuantRows]], workers: int = 2,
                 packed: Callable[[list[QuantRows]], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="llmlocal-pack")
        self._lock = threading.Lock()
        self._packed = packed
        self._jobs: dict[tuple[object, ...], Future[PackedQuant | None]] = {}
        for group in groups:
            for run in type_runs(group):
                key = _rows_key(run)
                if key is not None and key not in self._jobs:
                    self._jobs[key] = self._pool.submit(self._pack, run)

    def _pack(self, run: list[QuantRows]) -> PackedQuant | None:
        out = pack_rows(run)
        if self._packed is not None:
            self._packed(run)
        return out

    def take(self, run: list[QuantRows]) -> PackedQuant | None:
        """The arrays of these rows (the same tensors, types and row orders) if they were
        packed ahead (waiting for them if need be), else None; each run is taken once."""
        key = _rows_key(run)
        with self._lock:
            job = self._jobs.pop(key, None) if key is not None else None
        if job is None:
            return None
        if job.cancel():  # the workers have not reached it: pack it here instead of waiting idle
            return self._pack(run)
        return job.result()

    def untaken(self) -> int:
        """Runs packed (or packing) that nobody has taken."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Drop what was not taken: jobs not started never run."""
        with self._lock:
            jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.cancel()
        self._pool.shutdown(wait=False)


def _rows_key(run: list[QuantRows]) -> tuple[object, ...] | None:
    """What makes two runs the same rows: each part's tensor, type, shape and row order (None
    for a part without a name)."""
    if any(not p.name for p in run):
        return None
    return tuple((p.name, p.qtype, p.raw.shape, None if p.rows is None else np.asarray(p.rows).tobytes()) for p in run)


__all__ = ["PackAhead", "type_runs"]
