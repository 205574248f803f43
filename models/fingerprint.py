"""The work kept on disk for a model file (KV blocks, packed weights): where it goes, and the
file's fingerprint that names it, so that a changed file never reuses any of it."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


def model_fingerprint(path: str | os.PathLike[str]) -> bytes:
    """16 bytes that change when the model's files do: each file's size, its first MiB (the
    header, metadata and tensor table) and 16 samples of 64 KiB across it. Cheap (about 2 MiB
    read a file) where hashing a whole GB file would cost seconds at every load; a single file
    is read once while its size and time stay (the planner, a load and its caches all ask)."""
    root = Path(path)
    if root.is_file():
        st = root.stat()
        return _file_fingerprint(str(root), st.st_size, st.st_mtime_ns)
    return _fingerprint(root)


@functools.lru_cache(maxsize=16)
def _file_fingerprint(path: str, size: int, mtime_ns: int) -> bytes:
    return _fingerprint(Path(path))


def _fingerprint(root: Path) -> bytes:
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    h = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        h.update(file.name.encode() + size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            h.update(f.read(1 << 20))
            for i in range(1, 17):
                f.seek(size * i // 17)
                h.update(f.read(1 << 16))
    return h.digest()


def cache_dir(env: str, name: str) -> Path:
    """$``env``, else $XDG_CACHE_HOME/llmlocal/``name`` (~/.cache/llmlocal/``name``)."""
    explicit = os.environ.get(env)
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmlocal" / name


def remove_file(path: Path) -> bool:
    """Remove a file kept on disk; False where it was already gone or cannot be removed."""
    try:
        path.unlink()
        return True
    except OSError:
        return False
