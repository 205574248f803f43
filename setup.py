"""Native extension of llmlocal; everything else is configured in pyproject.toml.

`llmlocal.native.cpu._kernels` (C11): the CPU kernels (GGUF types in their own bytes, the fused decode step, sparse INT4). On x86-64 the
AVX2 and AVX-512 variants are compiled in their own translation units with their own -m
flags and picked at load time by CPU feature checks, so one wheel runs on any x86-64; on
other architectures only the portable variant is built.
"""

from __future__ import annotations

import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "native/cpu/csrc"
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
# Variant translation unit -> the instruction-set flags it alone is compiled with.
ISA_SOURCES = {
    f"{CSRC}/isa_avx2.c": ["-mavx2", "-mfma", "-mf16c", "-mpopcnt"],
    f"{CSRC}/qmat_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    f"{CSRC}/qmat_avxvnni.c": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    f"{CSRC}/qmat_avx512vnni.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    f"{CSRC}/attn_fma.c": ["-mavx2", "-mfma"],
    f"{CSRC}/isa_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c", "-mpopcnt"],
}


# Prefill's AMX tile multiplies (qmat_amx.c), where the compiler knows them (GCC 11, Clang 12).
AMX_SOURCE = (f"{CSRC}/qmat_amx.c", ["-mamx-tile", "-mamx-int8", "-mavx512dq", *ISA_SOURCES[f"{CSRC}/qmat_avx512vnni.c"]])
# Prompt rows through AMX-BF16 tiles (qmat_tiles.c), where the compiler knows them.
TILES_SOURCE = (f"{CSRC}/qmat_tiles.c", ["-mamx-tile", "-mamx-bf16", "-mavx512bf16", "-mavx512f", "-mavx512bw", "-mavx512dq"])
# ... and a prompt chunk's attention on them (attn_tiles.c), built with the same flags.
ATTN_TILES_SOURCE = f"{CSRC}/attn_tiles.c"
# ... and without AMX on AVX512-BF16 (attn_bf16.c: Zen 4 and 5), where the compiler knows it.
ATTN_BF16_SOURCE = (f"{CSRC}/attn_bf16.c", ["-mavx512bf16", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"])
PROBES = {
    ATTN_BF16_SOURCE[0]: "__m512 probe(__m512 a, __m512bh b) { return _mm512_dpbf16_ps(a, b, b); }",
    AMX_SOURCE[0]: "void probe(void) { _tile_zero(0); _tile_dpbsud(0, 1, 2); }",
    TILES_SOURCE[0]: "void probe(void) { _tile_zero(0); _tile_dpbf16ps(0, 1, 2); }\n"
                     "__m512bh probe2(__m512 a) { return _mm512_cvtne2ps_pbh(a, a); }",
}


def _compiles(compiler, flags: list[str], probe: str, build_temp: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether the C compiler accepts these flags and the intrinsics of `probe` with them."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=build_temp) as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <immintrin.h>\n" + probe + "\n")
        try:
            compiler.compile([src], output_dir=tmp, extra_postargs=flags)
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    """Compiles every translation unit at once (each ISA variant with its own flags), then
    links them into the extension: one compiler process per core instead of one after another
    (the slowest unit, not their sum, is the build's time on a many-core machine)."""

    def build_extension(self, ext: Extension) -> None:
        if self.compiler.compiler_type != "unix":
            super().build_extension(ext)
            return
        os.makedirs(self.build_temp, exist_ok=True)
        sources = list(ext.sources)
        macros = list(ext.define_macros)
        isa_sources: dict[str, list[str]] = dict(getattr(ext, "isa_sources", {}))
        if isa_sources:
            # the bfloat16 tiles read the codes as the int8 AMX path unpacks them: only with it
            for (source, flags), macro in ((AMX_SOURCE, "LLMLOCAL_AMX"), (TILES_SOURCE, "LLMLOCAL_AMX_BF16")):
                if (macro == "LLMLOCAL_AMX" or ("LLMLOCAL_AMX", "1") in macros) and _compiles(
                    self.compiler, flags, PROBES[source], self.build_temp
                ):
                    isa_sources[source] = flags
                    macros.append((macro, "1"))
                    if macro == "LLMLOCAL_AMX_BF16":
                        isa_sources[ATTN_TILES_SOURCE] = flags
            if _compiles(self.compiler, ATTN_BF16_SOURCE[1], PROBES[ATTN_BF16_SOURCE[0]], self.build_temp):
                isa_sources[ATTN_BF16_SOURCE[0]] = ATTN_BF16_SOURCE[1]
                macros.append(("LLMLOCAL_AVX512_BF16", "1"))
            macros.append(("LLMLOCAL_X86_VARIANTS", "1"))
        # the variants first: they hold the heavy kernel bodies
        units = list(isa_sources.items()) + [(source, []) for source in sources]

        def compile_unit(item: tuple[str, list[str]]) -> list[str]:
            source, flags = item
            return self.compiler.compile(
                [source], output_dir=self.build_temp, macros=macros, include_dirs=ext.include_dirs,
                extra_postargs=ext.extra_compile_args + flags, depends=ext.depends,
            )

        with ThreadPoolExecutor(max_workers=max(1, min(len(units), os.cpu_count() or 1))) as pool:
            objects = [obj for objs in pool.map(compile_unit, units) for obj in objs]
        ext.define_macros = macros
        ext.extra_objects = list(ext.extra_objects) + objects
        ext.sources = []  # compiled above: the base class only links (when any source is newer)
        ext.depends = list(ext.depends) + sources
        super().build_extension(ext)


def cpu_kernels_extension() -> Extension:
    ext = Extension(
        "llmlocal.native.cpu._kernels",
        sources=[f"{CSRC}/{name}" for name in ("module.c", "decode_stack.c", "int8_gemv.c", "pool.c", "dispatch.c", "isa_scalar.c", "qmat_scalar.c")],
        include_dirs=[CSRC],
        depends=[f"{CSRC}/{h}" for h in ("sparse_int4.h", "qmat.h", "qmat_body.h", "binding.h", "kernel_body.h", "prep_body.h", "int8_body.h", "attn_body.h", "vexp.h", "glu_body.h")] + list(ISA_SOURCES) + [AMX_SOURCE[0], TILES_SOURCE[0], ATTN_TILES_SOURCE, ATTN_BF16_SOURCE[0]],
        extra_compile_args=["-std=c11", "-O3", "-pthread", "-fvisibility=hidden"],
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
    ext.isa_sources = ISA_SOURCES if X86 else {}  # type: ignore[attr-defined]
    return ext


ext_modules = [cpu_kernels_extension()] if os.name == "posix" and sys.platform != "cygwin" else []
setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
