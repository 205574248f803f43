"""How OpenMP threads wait at a barrier: llama.cpp's (and torch's) threads spin there for a
while before they sleep (libgomp: 300,000 turns by default), which is fastest on an idle
machine and starves everything else on a busy one. On two cores, the 1.5B Q4_K_M in llama.cpp
decoded 13.7-14.1 tok/s alone, and beside one CPU-bound process 1.1-2.0 tok/s with the default
spin (two llama.cpp processes side by side: 1.3 tok/s each); with 1,000 turns 12.9-13.3 alone,
6.6-6.9 beside the busy process (50% of its quiet speed) and 7.1 each side by side. (3,000
turns: 13.2-13.7 alone, 44%; 10,000: 13.3-14.1, 34%.) A laptop is rarely idle and a chat's
interface shares the cores with the model, so llmlocal waits the short way unless the user
said how (GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment). llmlocal's own kernels wait
in their own pool (native/cpu/csrc/pool.c) and are not affected; neither was the paged
engine's decode or prefill speed, measured both ways.

numpy's OpenBLAS starts a server thread per further core when numpy is imported, and each
spins 2^28 cycles (OpenBLAS's default timeout) before it first sleeps: 0.13 s of one of two
cores here, in the middle of loading a model, for BLAS calls llmlocal does not make. Its
threads sleep after 2^16 cycles instead, unless the user set OPENBLAS_THREAD_TIMEOUT."""

from __future__ import annotations

import os

SPIN_COUNT = "1000"
LIBGOMP_DEFAULT = "300000"  # libgomp's spin count when OMP_WAIT_POLICY is unset
_USER_CHOSE = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
OPENBLAS_TIMEOUT = "16"  # log2 of the cycles an idle OpenBLAS thread spins (4-30; OpenBLAS: 28)


def share_cpus() -> None:
    """Make OpenMP and OpenBLAS threads started from now on sleep soon when idle (unless the
    user chose). Called first when the engine package is imported, before numpy, torch or
    llama.cpp's libraries load."""
    if not _USER_CHOSE:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_TIMEOUT)


def fastest_when_idle() -> dict[str, str]:
    """The environment in which llama.cpp decodes fastest on an idle machine (libgomp's own
    spin), for benchmarks that compare with llama.cpp at its best; empty if the user chose."""
    return {} if _USER_CHOSE else {"GOMP_SPINCOUNT": LIBGOMP_DEFAULT}
