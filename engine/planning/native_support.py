"""What the paged engine's native CPU path runs: the GGUF types its kernels read in the file's
own bytes (native/cpu/qlayout.py), whether a whole file runs there, and where that is
faster than llama.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec

NATIVE_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K


def runs_natively(spec: ModelSpec) -> bool:
    """Whether the paged engine runs this GGUF on a CPU with every projection, the output head
    and the embedding in the native kernels, in the file's own types (the build has them)."""
    from llmlocal.models.tensor_names import PAGED_ARCHS
    from llmlocal.native.cpu import runtime

    if spec.format != "gguf" or spec.architecture not in PAGED_ARCHS or not runtime.built():
        return False
    matrices = [t for t in spec.tensors if len(t.shape) == 2 and t.name.endswith(".weight")]
    return bool(matrices) and all(t.ggml_type in NATIVE_TYPES for t in matrices)


# CPU features on which the native kernels were measured to decode faster than llama.cpp at its
# best setting on the same CPU (docs/performance.md): AVX512-VNNI (Sapphire Rapids: Qwen2.5-Coder
# 1.5B Q4_K_M 1.39x, 0.5B 1.74x, the starter's Q4_1 1.73x). On AVX2 alone (Zen 3) the lead is
# smaller and varies with the host's load (below), and llama.cpp loads sooner; AVX-VNNI (Alder
# Lake) has not been measured.
FASTER_ON = "avx512_vnni"  # as hardware.simd_features() names it
FASTER_ON_NAME = "AVX512-VNNI"


def decodes_faster_natively(spec: ModelSpec, simd: frozenset[str]) -> bool:
    """Whether the paged engine decodes this GGUF faster than llama.cpp on a CPU with ``simd``
    (hardware.simd_features()): the file runs natively and the CPU is of a kind measured so."""
    return FASTER_ON in simd and runs_natively(spec)


# CPU features on which the native kernels decode at least at parity with llama.cpp at its best
# setting: AVX2 with FMA and F16C, the kernels' AVX2 path (a 2-vCPU AMD EPYC, Zen 3, 2026-11-28:
# Qwen2.5-Coder-1.5B Q4_K_M 1.14x, the 0.5B 1.36x, the starter 1.44x; a 1,037-token prefill
# 1.25-1.37x, 16 concurrent requests on the starter 3.0x llama.cpp one after another; a day
# earlier, before the one-pass decode kernels, 0.98x and 1.03x). There the paged engine is worth its
# slower load for its prefix cache: with the disk tier on, a chat's history or a server's system
# prompt is never prefilled twice, across restarts too, which llama.cpp does not do.
PARITY_ON = frozenset({"avx2", "fma", "f16c"})
PARITY_ON_NAME = "AVX2"


def paged_pays(spec: ModelSpec, simd: frozenset[str], disk_cache: bool) -> bool:
    """Whether `auto` gives this GGUF the paged engine on a CPU with ``simd``: where its kernels
    decode faster than llama.cpp, or at parity (AVX2) when the prefix cache keeps a disk tier
    (``disk_cache``: the plan's kv_cache_dir), whose saved prefills outweigh llama.cpp's quicker
    load; with --no-kv-cache there, llama.cpp."""
    if decodes_faster_natively(spec, simd):
        return True
    return disk_cache and PARITY_ON <= simd and runs_natively(spec)


FOUR_BIT_TYPES = frozenset({2, 3, 12})  # Q4_0 Q4_1 Q4_K: fp32 activations, every projection skips


def four_bit_only(spec: ModelSpec) -> bool:
    """Whether every projection of the file is Q4_0, Q4_1 or Q4_K: the types the INT4 kernels of
    fp32 activations (and the sparse backend's column-skipping ones) read."""
    layers = {t.ggml_type for t in spec.tensors if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2}
    return bool(layers) and layers <= FOUR_BIT_TYPES


def sparse_pays(spec: ModelSpec, simd: frozenset[str]) -> bool:
    """Whether the sparse backend is the fast way to run this calibrated GGUF on a CPU with
    ``simd``: on no CPU measured so far, so `auto` runs a calibrated file densely, at full
    quality, and `--backend sparse` runs it sparsely. The dense engine's int8 kernels read
    each chunk once for any row count and the sparse backend's kernels are bound by their
    per-group work, not by the bytes they skip: on a Zen 5 (AVX-512) the starter calibrated at
    50% (every projection skipping) decoded 169 tok/s against 212 dense, and the 1.5B Q4_K_M
    (only its down projections skipping, at 0.6) 43.3 against 52.0; on a Zen 3 (AVX2) the
    starter at 50% 83.3 against 101.9 (`bench sparse`). (Until the dense engine took int8
    activations for 4-bit files on AVX-512 too, the sparse backend ran those faster there.)"""
    del spec, simd  # the measurements above hold for every file and CPU measured
    return False
