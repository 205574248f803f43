"""Which kernel paths this CPU can run, from /proc/cpuinfo (independent of the kernels' own
dispatch): a test of a path skips only where these flags are missing, and fails where they are
present but the build or the dispatch does not run the path, so CI never skips more kernel
tests than the host's ISA explains."""

from __future__ import annotations

from functools import cache

# The `isa` paths (runtime.ISAS) and the flags each needs (dispatch.c's si4_best_isa).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c", "popcnt"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "fma", "f16c", "popcnt"),
}

# The GGUF-type kernel variants (runtime.qmat_kernel()): (ISA path, VNNI on, AMX on, flags).
QMAT_VARIANTS: dict[str, tuple[str, bool, bool, tuple[str, ...]]] = {
    "scalar": ("scalar", False, False, ()),
    "avx2": ("avx2", False, False, ISA_FLAGS["avx2"]),
    "avxvnni": ("avx2", True, False, (*ISA_FLAGS["avx2"], "avx_vnni")),
    "avx512vnni": ("avx512", True, False, (*ISA_FLAGS["avx512"], "avx512_vnni")),
    "avx512vnni-amx": ("avx512", True, True, (*ISA_FLAGS["avx512"], "avx512_vnni", "avx512dq", "amx_tile", "amx_int8")),
}


@cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags in /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def missing(flags: tuple[str, ...]) -> list[str]:
    """The flags of `flags` this CPU lacks; without /proc/cpuinfo, all of them but for an
    empty tuple (then only what the kernels report can be run)."""
    have = cpu_flags()
    return [f for f in flags if f not in have]
