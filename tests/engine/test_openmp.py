"""OpenMP threads (llama.cpp's) wait the short way unless the user said how (engine/openmp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
