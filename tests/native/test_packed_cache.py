"""Packed weights on disk (`PackedCache`): what is read back is what was packed, byte for byte;
a damaged, truncated or foreign file is never used and is removed; the directory keeps its
size bound; a directory that cannot be written costs nothing but the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llmlocal.native.cpu.bench_kernels import random_rows
from llmlocal.native.cpu.pack_ahead import run_key
from llmlocal.native.cpu.packed_cache import PackedCache, wait_for_writers
from llmlocal.native.cpu.qlayout import Q4_K, Q6_K, Q8_0, QuantRows, pack_rows

pytestmark = pytest.mark.skipif(pack_rows([random_rows(Q8_0, 32, 256, np.random.default_rng(0))]) is None,
                                reason="the native extension is not built")

FP, OTHER = bytes(range(16)), bytes(range(1, 17))


def runs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (t, n, k) in enumerate(((Q4_K, 64, 512), (Q6_K, 40, 256), (Q8_0, 96, 256))):
        rows = [QuantRows(t, random_rows(t, n, k, rng).raw, name=f"blk.{i}.w")]
        out[run_key(rows)] = pack_rows(rows)
    return out


def saved(cache: PackedCache, packed: dict, fingerprint: bytes = FP) -> Path:
    cache.save_behind(fingerprint, packed, {"model": "m", "path": "/models/m.gguf"})
    wait_for_writers()
    return cache.path(fingerprint)


def same(a, b) -> bool:
    return (a.qtype, a.n, a.k, a.interleaved) == (b.qtype, b.n, b.k, b.interleaved) and all(
        (x is None and y is None) or (x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y))
        for x, y in ((a.codes, b.codes), (a.d, b.d), (a.m, b.m), (a.sc, b.sc), (a.mn, b.mn)))


def test_what_is_read_back_is_what_was_packed_and_is_mapped_read_only(tmp_path: Path) -> None:
    cache, packed = PackedCache(tmp_path), runs()
    path = saved(cache, packed)
    assert path.is_file() and not list(tmp_path.glob("*.tmp"))
    back = cache.load(FP)
    assert back is not None and back.keys() == packed.keys()
    for key, p in packed.items():
        assert same(back[key], p)
        assert not back[key].codes.flags.writeable  # the file's pages, not a copy
    assert cache.load(OTHER) is None  # another model's name: no file


@pytest.mark.parametrize("damage", ["truncated", "index byte flipped", "another model", "not ours", "padded"])
def test_a_damaged_or_foreign_file_is_not_used_and_is_removed(tmp_path: Path, damage: str) -> None:
    cache = PackedCache(tmp_path)
    path = saved(cache, runs())
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 4096]
    elif damage == "index byte flipped":
        data[40] ^= 0x01
    elif damage == "another model":  # a whole file written for OTHER, under FP's name
        data = bytearray(saved(cache, runs(1), OTHER).read_bytes())
    elif damage == "not ours":
        data[:8] = b"GGUF\x03\x00\x00\x00"
    else:
        data += b"\0" * 4096
    path.write_bytes(bytes(data))
    assert cache.load(FP) is None
    assert not path.exists()


def test_the_directory_keeps_its_bound_least_recently_used_first(tmp_path: Path) -> None:
    packed = runs()
    one = saved(PackedCache(tmp_path), packed, FP).stat().st_size
    cache = PackedCache(tmp_path, max_bytes=int(one * 2.5))
    saved(cache, packed, OTHER)
    os.utime(cache.path(FP), (1, 1))  # FP's file is the least recently used
    third = bytes(range(2, 18))
    saved(cache, packed, third)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cache.path(f).name for f in (OTHER, third))
    assert cache.load(OTHER) is not None  # a load counts as a use
    small = PackedCache(tmp_path / "small", max_bytes=one // 2)
    assert not saved(small, packed).exists()  # a model larger than the bound is not kept at all
    assert [e["model"] for e in cache.entries()] == ["m", "m"]
    assert cache.clear() == (2, 2 * one) and cache.entries() == []


def test_a_directory_that_cannot_be_written_leaves_no_file_and_raises_nothing(tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("")
    cache = PackedCache(tmp_path / "a file" / "packed")  # cannot be made
    assert not saved(cache, runs()).exists() and cache.load(FP) is None and cache.entries() == []


def test_a_writer_killed_mid_write_leaves_nothing_that_is_read(tmp_path: Path) -> None:
    """The file is renamed into place only once whole: a killed writer leaves a temporary file,
    which no reader opens."""
    script = (
        "import os, signal, sys; from pathlib import Path; import numpy as np\n"
        "import llmlocal.native.cpu.packed_cache as pc\n"
        "from llmlocal.native.cpu.bench_kernels import random_rows\n"
        "from llmlocal.native.cpu.qlayout import Q4_K, pack_rows\n"
        "p = pack_rows([random_rows(Q4_K, 32, 256, np.random.default_rng(0))])\n"
        "def die(a): os.kill(os.getpid(), signal.SIGKILL)  # as the first array is written\n"
        "pc.np.ascontiguousarray = die\n"
        f"pc.PackedCache(Path({str(tmp_path)!r}))._save(bytes(range(16)), {{'k': p}}, {{}})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert done.returncode == -9
    [tmp] = list(tmp_path.iterdir())
    assert tmp.suffix == ".tmp" and PackedCache(tmp_path).load(FP) is None
    PackedCache(tmp_path).trim()
    assert tmp.exists()  # its writer may still be at work
    os.utime(tmp, (1, 1))
    PackedCache(tmp_path).trim()
    assert not tmp.exists()  # an hour old: its writer died


def test_two_processes_writing_the_same_model_leave_one_whole_file(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; import numpy as np\n"
        "from llmlocal.native.cpu.bench_kernels import random_rows\n"
        "from llmlocal.native.cpu.qlayout import Q4_K, pack_rows\n"
        "from llmlocal.native.cpu.packed_cache import PackedCache, wait_for_writers\n"
        "p = pack_rows([random_rows(Q4_K, 256, 2048, np.random.default_rng(0))])\n"
        f"PackedCache(Path({str(tmp_path)!r})).save_behind(bytes(range(16)), {{'k': p}}, {{'model': 'm'}})\n"
        "wait_for_writers()\n"
    )
    writers = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    assert [p.name for p in tmp_path.iterdir()] == [PackedCache(tmp_path).path(FP).name]
    back = PackedCache(tmp_path).load(FP)
    expected = pack_rows([random_rows(Q4_K, 256, 2048, np.random.default_rng(0))])
    assert back is not None and same(back["k"], expected)
