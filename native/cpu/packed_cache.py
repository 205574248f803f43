"""Packed weights kept on disk: a model's projections in the kernels' layout, written once
after a load that packed them and memory-mapped by the next load instead of packing again.

Packing the 1.5B (Q4_K_M) costs a core 1.6-2.0 s at every load, most of it the kernel zeroing
the fresh pages it writes; a mapped file costs nothing until its pages are read, and its pages
are shared by every process that runs the model. One file per model and layout:

    magic "LLMPACK1" | u64 index length | index (JSON) | 32-byte blake2b of the index
    padding to 4096 | each array's bytes at the offset the index names (4096-aligned)

The index names the model file's fingerprint and the layout version; a file whose magic,
checksum, fingerprint, layout or length disagrees is removed and the model packed again. It is
written to a temporary file and renamed, so a reader never sees half of one; the directory is
kept under a size bound, least recently used files removed first. The arrays' bytes are not
checksummed (that would read the whole file at every load): like the model file itself, they
are trusted once complete.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from llmlocal.models.fingerprint import cache_dir, model_fingerprint, remove_file

from .qlayout import PackedQuant

MAGIC = b"LLMPACK1"
LAYOUT_VERSION = 1  # bump when pack_rows' arrays change
SUFFIX = ".packed"
ALIGN = 4096
DEFAULT_MAX_BYTES = 16 << 30
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died
_FIELDS = ("codes", "d", "m", "sc", "mn")
_writers: list[threading.Thread] = []


def default_dir() -> Path:
    """$LLMLOCAL_PACKED_CACHE_DIR, else $XDG_CACHE_HOME/llmlocal/packed (~/.cache/llmlocal/packed)."""
    return cache_dir("LLMLOCAL_PACKED_CACHE_DIR", "packed")


def has_packed(root: str | os.PathLike[str], model_path: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds packed weights of this model file (for the memory planner: a load
    that maps them reads none of the file's projection pages)."""
    try:
        return PackedCache(Path(root)).path(model_fingerprint(model_path)).is_file()
    except OSError:
        return False


class PackedCache:
    """The directory of packed weights (``root``), at most ``max_bytes`` over all models."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, fingerprint: bytes) -> Path:
        return self.root / f"{fingerprint.hex()}-v{LAYOUT_VERSION}{SUFFIX}"

    def load(self, fingerprint: bytes) -> dict[str, PackedQuant] | None:
        """The model's packed projections by run key, mapped read-only; None where there is no
        usable file (one that does not check out is removed)."""
        path = self.path(fingerprint)
        try:
            f = open(path, "rb")
        except OSError:
            return None
        with f:
            try:
                index = _read_index(f, os.fstat(f.fileno()).st_size, fingerprint)
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError, KeyError, TypeError):
                index = None
        if index is None:
            remove_file(path)
            return None
        if hasattr(mmap, "MADV_WILLNEED"):
            buf.madvise(mmap.MADV_WILLNEED)  # read ahead from disk while torch is imported
        whole = np.frombuffer(buf, dtype=np.uint8)
        out: dict[str, PackedQuant] = {}
        for key, e in index["runs"].items():
            arrays = [None if a is None else _view(whole, *a) for a in e["arrays"]]
            out[key] = PackedQuant(e["qtype"], e["n"], e["k"], *arrays, interleaved=e["interleaved"])
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass  # a directory this user may read but not write
        return out

    def save_behind(self, fingerprint: bytes, runs: Mapping[str, PackedQuant], about: Mapping[str, object]) -> None:
        """Write the file on a thread of its own (the load has returned; the process waits for it
        at exit), then trim the directory to its bound. Failures (a full or read-only disk) only
        leave no file."""
        worker = threading.Thread(target=self._save, args=(fingerprint, dict(runs), dict(about)),
                                  name="llmlocal-packed-cache")
        _writers.append(worker)
        worker.start()

    def _save(self, fingerprint: bytes, runs: dict[str, PackedQuant], about: dict[str, object]) -> None:
        path = self.path(fingerprint)
        size = sum(-(-p.nbytes // ALIGN) * ALIGN + ALIGN * 5 for p in runs.values())
        if size > self.max_bytes:
            return
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            _write(tmp, fingerprint, runs, about)
            os.replace(tmp, path)
        except OSError:
            remove_file(tmp)
            return
        self.trim(keep=path)

    def trim(self, keep: Path | None = None) -> None:
        """Remove the least recently used files until the rest fit the bound (``keep`` last), and
        temporary files an hour old (their writer died)."""
        for p in self.root.glob(f"*{SUFFIX}.*.tmp"):
            try:
                if p.stat().st_mtime < time.time() - STALE_TMP_S:
                    remove_file(p)
            except OSError:
                continue
        files = []
        for p in self.root.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((p == keep, st.st_mtime, st.st_size, p))
        files.sort()
        total = sum(f[2] for f in files)
        for _, _, size, p in files:
            if total <= self.max_bytes:
                break
            if remove_file(p):
                total -= size

    def entries(self) -> list[dict[str, object]]:
        """What each file holds (for `llmlocal cache`): model, path, bytes, last used."""
        out = []
        for p in self.root.glob(f"*{SUFFIX}"):
            try:
                with open(p, "rb") as f:
                    about = _read_index(f, os.fstat(f.fileno()).st_size, None)["about"]
                st = p.stat()
            except (OSError, ValueError, TypeError, KeyError):
                continue
            out.append({"file": str(p), "model": about.get("model", "?"), "path": about.get("path", ""),
                        "bytes": st.st_size, "last_used": st.st_mtime})
        out.sort(key=lambda e: -float(e["last_used"]))  # type: ignore[arg-type]
        return out

    def clear(self, entries: list[dict[str, object]] | None = None) -> tuple[int, int]:
        """Remove the files of ``entries`` (every file by default): (files, bytes)."""
        files = size = 0
        for e in self.entries() if entries is None else entries:
            if remove_file(Path(str(e["file"]))):
                files, size = files + 1, size + int(e["bytes"])  # type: ignore[call-overload]
        return files, size


def wait_for_writers(timeout: float | None = None) -> None:
    """Wait until every file being written has been written (tests; the process's exit waits too)."""
    while _writers:
        _writers.pop().join(timeout)


def _write(path: Path, fingerprint: bytes, runs: dict[str, PackedQuant], about: dict[str, object]) -> None:
    index: dict[str, object] = {"fingerprint": fingerprint.hex(), "layout": LAYOUT_VERSION, "about": about}
    entries: dict[str, object] = {}
    blobs: list[tuple[int, np.ndarray]] = []
    offset = 0
    for key, p in runs.items():
        arrays: list[object] = []
        for name in _FIELDS:
            a = getattr(p, name)
            if a is None:
                arrays.append(None)
                continue
            arrays.append([offset, list(a.shape), a.dtype.str])
            blobs.append((offset, a))
            offset += -(-a.nbytes // ALIGN) * ALIGN
        entries[key] = {"qtype": p.qtype, "n": p.n, "k": p.k, "interleaved": p.interleaved, "arrays": arrays}
    index["runs"] = entries
    text = json.dumps(index).encode()
    head = MAGIC + len(text).to_bytes(8, "little") + text + hashlib.blake2b(text, digest_size=32).digest()
    data_start = -(-len(head) // ALIGN) * ALIGN
    with open(path, "wb") as f:
        f.write(head)
        for off, a in blobs:
            f.seek(data_start + off)
            f.write(np.ascontiguousarray(a).data)  # a buffer: no copy, the GIL released while written
        f.truncate(data_start + offset)
        f.flush()
        os.fsync(f.fileno())


def _read_index(f, size: int, fingerprint: bytes | None) -> dict:
    """The checked index of an open file, with each array's offset made absolute; ValueError
    where anything disagrees (``fingerprint`` None: any model's)."""
    head = f.read(16)
    if len(head) != 16 or head[:8] != MAGIC:
        raise ValueError("not a packed-weights file")
    n = int.from_bytes(head[8:], "little")
    if n > min(size, 64 << 20):
        raise ValueError("index length")
    text, digest = f.read(n), f.read(32)
    if len(text) != n or hashlib.blake2b(text, digest_size=32).digest() != digest:
        raise ValueError("index checksum")
    index = json.loads(text)
    if index.get("layout") != LAYOUT_VERSION or (fingerprint is not None and index.get("fingerprint") != fingerprint.hex()):
        raise ValueError("another model or layout")
    start = -(-(16 + n + 32) // ALIGN) * ALIGN
    end = start
    for e in index["runs"].values():
        for a in e["arrays"]:
            if a is not None:
                a[0] += start
                end = max(end, a[0] + int(np.prod(a[1])) * np.dtype(a[2]).itemsize)
    if size != -(-end // ALIGN) * ALIGN:
        raise ValueError("length")
    return index


def _view(whole: np.ndarray, offset: int, shape: list[int], dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    return whole[offset: offset + count * dt.itemsize].view(dt).reshape(shape)


__all__ = ["DEFAULT_MAX_BYTES", "LAYOUT_VERSION", "PackedCache", "default_dir", "has_packed", "wait_for_writers"]
