"""The distributable: build the wheel, install it into an empty venv, answer offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wheel_installs_into_a_clean_venv_and_answers_offline(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "packaging" / "smoke.sh"), str(tmp_path)], capture_output=True,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke test passed" in result.stdout
