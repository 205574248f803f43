"""The GPU check's dry run: every step of packaging/gpu-check.sh on the CPU with a two-layer
model, as on a GPU machine without llama-cpp-python, so the check keeps working between GPU
runs. About a minute on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = ["wheelhouse", "install", "native kernels", "bandwidth", "model", "quantize", "cuda tests", "triton interpreted",
         "plan", "memory", "bench decode", "profile", "bench batch", "bench spec", "bench resume"]


@pytest.mark.timeout(600)
def test_dry_run_runs_every_step_and_prints_the_table(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    result = subprocess.run(
        ["bash", str(REPO / "packaging" / "gpu-check.sh"), "--dry-run", "--work", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=540,
    )
    log = tmp_path / "gpu-check.log"
    detail = result.stdout + result.stderr + (log.read_text()[-4000:] if log.exists() else "")
    assert result.returncode == 0, detail

    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["environment", *STEPS], detail
    assert [n for n, s in steps.items() if s["status"] != "ok"] == ["wheelhouse", "install"], detail
    # the figures each step exists for, read from the commands' own JSON
    assert steps["quantize"]["data"]["type"] == "Q4_0"  # llama.cpp hidden, as on the GPU machines
    assert steps["memory"]["data"]["predicted_bytes"] > 0 and steps["memory"]["data"]["measured_bytes"] > 0
    assert steps["bench decode"]["data"]["backends"]["paged"]["decode_tok_s"] > 0
    assert steps["bench decode"]["data"]["mbu_vs_copy"] > 0
    assert steps["profile"]["data"]["itl_ms"] > 0 and len(steps["profile"]["data"]["ttft_s"]) == 3
    assert steps["bench batch"]["data"]["paged_batch1_tok_s"] > 0
    assert steps["bench resume"]["data"]["chat"]["cached_prompt_tokens"] > 0  # the disk tier read its blocks back
    assert steps["triton interpreted"]["data"]["passed"] > 0 and "failed" not in steps["triton interpreted"]["data"]

    # the table comes last, a row per step
    table = result.stdout[result.stdout.index("llmlocal GPU check"):]
    assert all(f"\n{name} " in table for name in STEPS), table
    assert "0 failed or not run" in table.splitlines()[-1]
