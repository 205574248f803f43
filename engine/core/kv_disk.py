"""`DiskTier`: the paged engine's prefix cache on disk, under the pool in memory.

A reopened chat or a restarted server sends prompts whose beginnings this machine has computed
before. The full KV blocks of those prompts (and of the replies) are kept as files, one a block,
named by the block's prefix key (`block_manager.block_key`, a 128-bit hash chained from a root
that names the model file, the engine's numerics and this layout), so a prefix found on disk is
read instead of computed.

Rules this file keeps:

* Never on the decode's critical path for writes: the engine thread copies a new full block's
  rows out of the pool (a memory copy) and queues them; a writer thread writes each file to a
  temporary name and renames it complete. The queue is bounded: when the disk falls behind,
  blocks are dropped, never waited for.
* Read before admission, in the request's own thread: the blocks past those still in memory
  are read and checked (magic, namespace, key, the block's tokens, size, CRC-32) and staged in
  memory. The block manager only asks whether a key is staged, so a file that fails a check is
  a miss (and is removed), never KV.
* Bounded: the files of every model together stay under ``max_bytes``; the least recently used
  go first (a hit touches its files).
* Shared: several processes may use one directory. Files appear by atomic rename, so a reader
  sees a whole file or none; one removed by another process is a miss.
* A directory that cannot be written (read-only, full) costs one warning; generation goes on.

File layout (little-endian): magic ``LLMKVB01``, namespace (16 bytes), key (16 bytes), block
size (u32), payload bytes (u64), the block's token ids (u32 each), the payload (each layer's K
rows then V rows of the block, as `ModelRunner.read_blocks` gives them), CRC-32 of all before.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
import warnings
import zlib
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llmlocal.models.fingerprint import cache_dir, remove_file

from .block_manager import FullBlock

MAGIC = b"LLMKVB01"
LAYOUT_VERSION = 1  # of the payload: bump when the pool's rows change meaning
HEADER = struct.Struct("<8s16s16sIQ")
CRC = struct.Struct("<I")
SUFFIX = ".kv"
ABOUT = "model.json"
DEFAULT_MAX_BYTES = 4 << 30
PENDING_BYTES = 256 << 20  # blocks queued for writing at most; beyond it new ones are dropped
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died


def default_dir() -> Path:
    """$LLMLOCAL_KV_CACHE_DIR, else $XDG_CACHE_HOME/llmlocal/kv (~/.cache/llmlocal/kv)."""
    return cache_dir("LLMLOCAL_KV_CACHE_DIR", "kv")


def namespace(fingerprint: bytes, numerics: str, block_size: int, row_shape: tuple[int, ...]) -> bytes:
    """The 16-byte name of one model's blocks as one engine computes them: the files' fingerprint,
    what changes the numbers (backend, device, dtypes, kernels, RoPE), the block size, the rows'
    shape and the layout version. Two engines share blocks only when all of these agree."""
    text = f"llmlocal-kv/{LAYOUT_VERSION}|{numerics}|bs={block_size}|rows={row_shape}"
    return hashlib.blake2b(fingerprint + text.encode(), digest_size=16).digest()


@dataclass
class _Staged:
    payload: bytearray
    owners: int


class DiskTier:
    """One model's blocks in ``root/<namespace hex>/``; see the module docstring."""

    def __init__(self, root: Path, ns: bytes, block_size: int, block_nbytes: int,
                 max_bytes: int = DEFAULT_MAX_BYTES, about: dict[str, object] | None = None) -> None:
        self.root = Path(root)
        self.ns = ns
        self.dir = self.root / ns.hex()
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.max_bytes = max_bytes
        self.file_bytes = HEADER.size + 4 * block_size + block_nbytes + CRC.size
        self.root_key = int.from_bytes(ns, "little")
        self.warning: str | None = None  # the one warning given, if any
        self.counts = {"read": 0, "written": 0, "dropped": 0, "rejected": 0}
        self._staged: dict[int, _Staged] = {}
        self._owned: dict[int, list[int]] = {}  # seq_id -> the keys it staged
        self._stage_lock = threading.Lock()
        self._queue: deque[tuple[list[FullBlock], np.ndarray]] = deque()
        self._pending = 0  # bytes queued
        self._cv = threading.Condition()
        self._closing = False
        self._writable = self._prepare(about or {})
        self._thread = threading.Thread(target=self._write_loop, name="llmlocal-kv-disk", daemon=True)
        self._thread.start()

    # ---- reading (request threads) -------------------------------------------------------
    def has(self, key: int) -> bool:
        """Whether the block of ``key`` is staged (read, checked, waiting for its load)."""
        return key in self._staged

    def stage(self, seq_id: int, blocks: list[tuple[int, list[int]]]) -> int:
        """Read the blocks of ``blocks`` (key, tokens), in order, until one is not on disk or
        fails a check; keep them for sequence ``seq_id`` until `take` or `release`. Returns the
        number staged."""
        staged: list[int] = []
        for key, tokens in blocks:
            with self._stage_lock:
                entry = self._staged.get(key)
                if entry is not None:
                    entry.owners += 1
                    staged.append(key)
                    continue
            payload = self._read(key, tokens)
            if payload is None:
                break
            with self._stage_lock:
                entry = self._staged.setdefault(key, _Staged(payload, 0))
                entry.owners += 1
            staged.append(key)
        if staged:
            with self._stage_lock:
                self._owned.setdefault(seq_id, []).extend(staged)
        return len(staged)

    def take(self, keys: list[int]) -> list[bytearray]:
        """The staged payloads of ``keys`` (the block manager found them staged), unstaged."""
        with self._stage_lock:
            return [self._staged.pop(key).payload for key in keys]

    def release(self, seq_id: int) -> None:
        """Forget what ``seq_id`` staged and did not load (it finished, or found the blocks in memory)."""
        with self._stage_lock:
            for key in self._owned.pop(seq_id, []):
                entry = self._staged.get(key)
                if entry is not None:
                    entry.owners -= 1
                    if entry.owners <= 0:
                        del self._staged[key]

    def _path(self, key: int) -> Path:
        return self.dir / f"{key:032x}{SUFFIX}"

    def _read(self, key: int, tokens: list[int]) -> bytearray | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != self.file_bytes:
                    return self._reject(path)
                data = bytearray(self.file_bytes)
                if f.readinto(data) != self.file_bytes:
                    return self._reject(path)
        except OSError:
            return None  # not there (or not readable): a miss
        magic, ns, file_key, block_size, nbytes = HEADER.unpack_from(data)
        body = HEADER.size + 4 * self.block_size
        ok = (
            magic == MAGIC and ns == self.ns and file_key == key.to_bytes(16, "little")
            and block_size == self.block_size and nbytes == self.block_nbytes
            and CRC.unpack_from(data, self.file_bytes - CRC.size)[0] == zlib.crc32(memoryview(data)[: -CRC.size])
            and data[HEADER.size : body] == array("I", tokens).tobytes()
        )
        if not ok:
            return self._reject(path)
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        self.counts["read"] += 1
        return data[body : body + self.block_nbytes]

    def _reject(self, path: Path) -> None:
        """A file that is not what its name says (truncated, corrupted, foreign): removed."""
        self.counts["rejected"] += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # ---- writing (the engine thread queues, the writer thread writes) --------------------
    def put(self, blocks: list[FullBlock], rows: np.ndarray) -> None:
        """Queue blocks for writing; ``rows`` (n, block_nbytes) uint8 is their copy, owned now."""
        if not blocks or not self._writable:
            return
        with self._cv:
            if self._pending + rows.nbytes > PENDING_BYTES or self._closing:
                self.counts["dropped"] += len(blocks)
                return
            self._queue.append((blocks, rows))
            self._pending += rows.nbytes
            self._cv.notify()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the writer."""
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _write_loop(self) -> None:
        written_since_trim = 0
        self._trim()
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                blocks, rows = self._queue.popleft()
            for i, block in enumerate(blocks):
                try:
                    if self._writable and self._write(block, rows[i]):
                        written_since_trim += self.file_bytes
                except Exception as e:  # noqa: BLE001 - a bug here must not stop the queue draining (close waits on it)
                    self._give_up(f"the KV cache writer failed ({type(e).__name__}: {e}); prompts will not be kept "
                                  "across runs: please report it, and pass --no-kv-cache meanwhile.")
            with self._cv:
                self._pending -= rows.nbytes
                self._cv.notify_all()
            if written_since_trim > self.max_bytes // 16:
                self._trim()
                written_since_trim = 0

    def _write(self, block: FullBlock, row: np.ndarray) -> bool:
        path = self._path(block.key)
        if path.exists():
            return False  # written before (by this process or another)
        tmp = self.dir / f".{block.key:032x}.{os.getpid()}.{threading.get_ident()}.tmp"
        header = HEADER.pack(MAGIC, self.ns, block.key.to_bytes(16, "little"), self.block_size, self.block_nbytes)
        tokens = array("I", block.token_ids).tobytes()
        crc = zlib.crc32(row, zlib.crc32(tokens, zlib.crc32(header)))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(tokens)
                f.write(row)
                f.write(CRC.pack(crc))
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            self._give_up(f"cannot write the KV cache in {self.dir} ({e.strerror or e}): prompts will be "
                          "computed again next time; free space there, or pass --kv-cache-dir DIR or --no-kv-cache.")
            return False
        self.counts["written"] += 1
        return True

    def _give_up(self, message: str) -> None:
        self._writable = False
        if self.warning is None:
            self.warning = message
            warnings.warn(f"llmlocal: {message}", RuntimeWarning, stacklevel=2)

    def _prepare(self, about: dict[str, object]) -> bool:
        """Make the directory and its description; False (after the warning) if it cannot be."""
        try:
            # the files hold prompts' token ids: the cache is its owner's alone (as chats.db is)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.dir.mkdir(mode=0o700, exist_ok=True)
            target = self.dir / ABOUT
            if not target.exists():
                tmp = self.dir / f".{ABOUT}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps({**about, "layout": LAYOUT_VERSION, "block_size": self.block_size}, indent=1))
                os.replace(tmp, target)
        except OSError as e:
            self._give_up(f"cannot use {self.dir} for the KV cache ({e.strerror or e}): prompts will not be "
                          "kept across runs; pass --kv-cache-dir DIR or --no-kv-cache.")
            return False
        return True

    def _trim(self) -> None:
        """Remove the least recently used block files of every model until all fit ``max_bytes``
        (to 90% of it, so that trimming is not needed at every write), and dead writers' files."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for entry in scan(self.root):
            if entry.is_tmp:
                if now - entry.mtime > STALE_TMP_S:
                    remove_file(entry.path)
                continue
            files.append((entry.mtime, entry.size, entry.path))
        total = sum(size for _, size, _ in files)
        if total <= self.max_bytes:
            return
        files.sort()
        for _, size, path in files:
            if total <= 0.9 * self.max_bytes:
                break
            if remove_file(path) or not path.exists():  # gone either way: another trim (a process, or
                total -= size                         # close() beside the writer) took it first


@dataclass(frozen=True)
class CacheFile:
    path: Path
    size: int
    mtime: float
    is_tmp: bool


def scan(root: Path) -> list[CacheFile]:
    """Every block file (and leftover temporary file) under ``root``."""
    out: list[CacheFile] = []
    try:
        spaces = [d for d in os.scandir(root) if d.is_dir()]
    except OSError:
        return out
    for space in spaces:
        try:
            entries = list(os.scandir(space.path))
        except OSError:
            continue
        for e in entries:
            tmp = e.name.endswith(".tmp")
            if not (tmp or e.name.endswith(SUFFIX)):
                continue
            try:
                st = e.stat()
            except OSError:
                continue
            out.append(CacheFile(Path(e.path), st.st_size, st.st_mtime, tmp))
    return out


# ---- what `llmlocal cache` shows and clears ------------------------------------------------
@dataclass(frozen=True)
class CacheSpace:
    """One model's blocks as one engine computes them (a namespace's folder)."""

    namespace: str
    model: str  # the model's name when the blocks were written ("?" if its description is gone)
    path: str
    blocks: int
    tokens: int
    bytes: int
    last_used: float | None  # the newest file's time, or None when there is none

    def as_dict(self) -> dict[str, object]:
        return {"namespace": self.namespace, "model": self.model, "path": self.path, "blocks": self.blocks,
                "tokens": self.tokens, "bytes": self.bytes, "last_used": self.last_used}


def describe(root: Path) -> list[CacheSpace]:
    """The cache's namespaces, most recently used first."""
    per: dict[Path, list[CacheFile]] = {}
    for f in scan(root):
        if not f.is_tmp:
            per.setdefault(f.path.parent, []).append(f)
    try:
        dirs = [Path(d.path) for d in os.scandir(root) if d.is_dir()]
    except OSError:
        return []
    out = []
    for d in dirs:
        files = per.get(d, [])
        try:
            about = json.loads((d / ABOUT).read_text())
        except (OSError, ValueError):
            about = {}
        block_size = about.get("block_size", 0) if isinstance(about, dict) else 0
        out.append(CacheSpace(
            namespace=d.name, model=str(about.get("model", "?")), path=str(about.get("path", "")),
            blocks=len(files), tokens=len(files) * int(block_size or 0), bytes=sum(f.size for f in files),
            last_used=max((f.mtime for f in files), default=None),
        ))
    out.sort(key=lambda s: -(s.last_used or 0))
    return out


def clear(root: Path, spaces: list[CacheSpace] | None = None) -> tuple[int, int]:
    """Remove the given namespaces (all of them by default): (files, bytes) removed. A writer
    still running in another process may add files again."""
    import shutil

    files = size = 0
    for space in describe(root) if spaces is None else spaces:
        d = root / space.namespace
        files += space.blocks
        size += space.bytes
        shutil.rmtree(d, ignore_errors=True)
    return files, size
