"""Loading the compiled kernels, and the process-wide settings: ISA, threads, idle spin.

Environment (read when the kernels are first loaded):

    LLMLOCAL_SPARSE_ISA=scalar|avx2|avx512   force a path (at most the best this CPU supports)
    LLMLOCAL_SPARSE_THREADS=N                threads per GEMV, caller included
                                             (default: the CPUs this process may run on)
    LLMLOCAL_SPARSE_SPIN_US=US               how long idle workers spin before sleeping (200)
    LLMLOCAL_QMAT_VNNI=0                     GGUF-type kernels without VNNI dot products
                                             (for measuring them; the results are the same)
    LLMLOCAL_QMAT_AMX=0                      ... and prefill without AMX tiles (the same)
    LLMLOCAL_QMAT_TILES=0                    prompt rows without the AMX-BF16 tiles
    LLMLOCAL_ATTN_TILES=0                    ... their attention alone (torch's float32)
"""

from __future__ import annotations

import os
from types import ModuleType

ISAS = ("scalar", "avx2", "avx512")  # lowest first
_kernels: ModuleType | None = None
_attn_tiles = os.environ.get("LLMLOCAL_ATTN_TILES", "").strip() != "0"


class KernelsUnavailableError(ImportError):
    """The compiled extension is missing (llmlocal was installed without building it)."""


def built() -> bool:
    """Whether the extension was compiled at install (found without loading it)."""
    import importlib.util

    return importlib.util.find_spec(f"{__package__}._kernels") is not None


def kernels() -> ModuleType:
    """The `_kernels` extension, configured from the environment at first use."""
    global _kernels
    if _kernels is None:
        try:
            from . import _kernels as k
        except ImportError as e:
            raise KernelsUnavailableError(
                "The sparse INT4 kernels of llmlocal are not compiled; reinstall llmlocal on a "
                f"machine with a C compiler (pip install --force-reinstall --no-deps llmlocal). ({e})"
            ) from e
        _configure(k)
        _kernels = k
    return _kernels


def _configure(k: ModuleType) -> None:
    isa = os.environ.get("LLMLOCAL_SPARSE_ISA", "").strip().lower()
    if isa:
        if isa not in ISAS:
            raise ValueError(f"LLMLOCAL_SPARSE_ISA={isa!r}: use one of {', '.join(ISAS)}")
        k.set_isa(isa)
    threads = os.environ.get("LLMLOCAL_SPARSE_THREADS", "").strip()
    k.set_num_threads(int(threads) if threads else default_threads())
    if os.environ.get("LLMLOCAL_QMAT_VNNI", "").strip() == "0":
        k.set_qmat_vnni(False)
    if os.environ.get("LLMLOCAL_QMAT_AMX", "").strip() == "0":
        k.set_qmat_amx(False)
    if os.environ.get("LLMLOCAL_QMAT_TILES", "").strip() == "0":
        k.set_qmat_tiles(False)
    spin = os.environ.get("LLMLOCAL_SPARSE_SPIN_US", "").strip()
    if spin:
        k.set_spin_us(int(spin))


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def best_isa() -> str:
    """The best path this CPU and build support: avx512, avx2 or scalar."""
    return kernels().best_isa()


def available_isas() -> list[str]:
    """Every path that can run here, lowest first (tests run each)."""
    return list(ISAS[: ISAS.index(best_isa()) + 1])


def isa() -> str:
    """The path the kernels take now."""
    return kernels().isa()


def set_isa(name: str) -> None:
    """Take the `name` path (scalar, avx2, avx512); ValueError above best_isa()."""
    kernels().set_isa(name)


def qmat_kernel() -> str:
    """The GGUF-type kernel variant the current path runs: scalar, avx2, avxvnni, avx512vnni
    or avx512vnni-amx (prefill's sums by AMX tiles)."""
    return kernels().qmat_kernel()


def set_qmat_vnni(on: bool) -> None:
    """Let the GGUF-type kernels use VNNI dot products where the CPU has them (the default);
    off, they run the AVX2 variant, which computes the same numbers."""
    kernels().set_qmat_vnni(on)


def set_qmat_amx(on: bool) -> None:
    """Let prefill in the GGUF-type kernels use AMX tiles where the CPU has them and the OS
    grants them (the default); off, the VNNI kernel runs it, computing the same numbers."""
    kernels().set_qmat_amx(on)


def qmat_tiles() -> bool:
    """Whether prompt rows of the GGUF-type matrices run through AMX-BF16 tiles: a CPU with
    AMX-BF16 (Sapphire Rapids and later) on the AVX-512 path, unless switched off."""
    return bool(kernels().qmat_tiles())


def attn_tiles() -> bool:
    """Whether a prompt chunk's attention runs in the native kernel (`kernels().attn_tiles`)
    rather than torch's float32 attention: in bfloat16 on the AMX-BF16 tiles where its rows take
    them (`qmat_tiles`; csrc/attn_tiles.c) or on AVX512-BF16 where the CPU has no tiles
    (attn_bf16.c), else in float32 on AVX2 and FMA (attn_fma.c)."""
    return _attn_tiles and kernels().attn_kernel() != ""


def attn_without_tiles() -> bool:
    """Whether that is AVX512-BF16 or AVX2 (a CPU without AMX: its projections keep the int8 kernels)."""
    return _attn_tiles and kernels().attn_kernel() in ("bf16", "fma")


def set_attn_tiles(on: bool) -> None:
    """Let a prompt's attention take the tiles with its projections (the default); off, torch's
    float32 attention (for measuring; a prompt's rows are then no longer the same in any chunk)."""
    global _attn_tiles
    _attn_tiles = bool(on)


def set_qmat_tiles(on: bool) -> None:
    """Let prompt rows run through AMX-BF16 tiles where the CPU has them (the default); off,
    they take the int8 kernels as decode rows do."""
    kernels().set_qmat_tiles(on)


def num_threads() -> int:
    return kernels().num_threads()


def set_num_threads(n: int) -> None:
    """Threads per GEMV, the caller included (the pool is restarted)."""
    kernels().set_num_threads(n)


def set_spin_us(us: int) -> None:
    """How long an idle worker spins before it sleeps: decode calls GEMVs back to back."""
    kernels().set_spin_us(us)
