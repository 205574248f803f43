"""OpenMP threads (llama.cpp's) wait the short way unless the user said how (engine/openmp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = (
    "import json, os; import llmlocal.engine; from llmlocal.engine.openmp import fastest_when_idle; "
    "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), fastest_when_idle()]))"
)


def probe(**env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_importing_the_engine_shortens_the_spin_unless_the_user_chose() -> None:
    assert probe() == ["1000", {"GOMP_SPINCOUNT": "300000"}]  # benchmarks give llama.cpp libgomp's own
    assert probe(GOMP_SPINCOUNT="50") == ["50", {}]
    assert probe(OMP_WAIT_POLICY="active") == [None, {}]


IDLE = "import resource, time; import llmlocal.engine, numpy; time.sleep(1.0); r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)"


def cpu_seconds(**env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", IDLE], env={**clean, **env}, capture_output=True, text=True, check=True)
    return float(out.stdout)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no server thread on one CPU")
def test_numpys_blas_threads_do_not_spin_after_the_engine_is_imported() -> None:
    """OpenBLAS's threads, started as numpy is imported, sleep at once instead of spinning; a
    user's own OPENBLAS_THREAD_TIMEOUT (here OpenBLAS's longest, 2^30 cycles) is kept."""
    ours, theirs = cpu_seconds(), cpu_seconds(OPENBLAS_THREAD_TIMEOUT="30")
    assert ours < theirs - 0.1, (ours, theirs)
