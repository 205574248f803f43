"""`llmlocal plan`, and `run`/`chat` loading through the planner, with the real starter model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from llmlocal.app.cli import build_parser
from llmlocal.app.options import plan_from_args

LLMLOCAL = [sys.executable, "-m", "llmlocal.app"]
STARTER_TENSOR_BYTES = 96_576_768


def llmlocal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMLOCAL_MEMORY_BUDGET"}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([*LLMLOCAL, *args], check=False, capture_output=True, text=True, timeout=timeout, env=env)


def test_plan_picks_the_faster_engine_on_this_cpu_and_says_why(starter_cpu_backend: str) -> None:
    result = llmlocal("plan", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["backend"] == starter_cpu_backend
    assert any(r.startswith(f"{starter_cpu_backend}: ") and ("AVX512-VNNI" in r or "AVX2" in r) for r in data["reasons"]), data["reasons"]


def test_plan_json_for_the_starter_on_the_cpu() -> None:
    result = llmlocal("plan", "--device", "cpu", "--backend", "llamacpp", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("backend", "device", "gpu_layers", "n_ctx", "kv_dtype", "quant", "draft", "predicted_bytes",
                "budget_bytes", "reasons", "alternatives"):
        assert key in data, key
    assert (data["backend"], data["device"], data["gpu_layers"], data["n_ctx"], data["quant"]) == ("llamacpp", "cpu", 0, 8192, "Q4_1")
    predicted = data["predicted_bytes"]
    assert predicted["weights"] == STARTER_TENSOR_BYTES  # mapped once, nothing repacked for Q4_1
    assert predicted["total"] == predicted["weights"] + predicted["kv"] + predicted["compute"] + predicted["overhead"]
    assert predicted["kv"] == 8192 * 2 * 30 * 3 * 64 * 2  # f16 K and V, every layer
    assert data["budget_bytes"] > predicted["total"]
    assert any("context 8192" in r for r in data["reasons"])
    assert data["alternatives"] and all("predicted_bytes" in a for a in data["alternatives"])


def test_plan_prints_a_bar_reasons_and_alternatives() -> None:
    result = llmlocal("plan", "--device", "cpu", "--backend", "llamacpp", "--memory-budget", "2G")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("smollm2-135m: llamacpp on the CPU, Q4_1, context 8192")
    bar = next(line for line in out.splitlines() if line.startswith("cpu "))
    assert "[" in bar and "|" in bar and "of 2.0 GiB" in bar
    assert "█ weights 92.1 MiB" in out and "▓ KV cache 180 MiB" in out
    assert "- cpu: needs" in out and "alternatives:" in out


def test_pins_are_kept() -> None:
    result = llmlocal("plan", "--backend", "paged", "--ctx", "2048", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["backend"], data["n_ctx"]) == ("paged", 2048)
    assert "context 2048: as asked with --ctx" in data["reasons"]


def test_too_small_a_budget_is_one_sentence_with_the_numbers() -> None:
    result = llmlocal("plan", "--memory-budget", "60M")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs" in lines[0] and "60.0 MiB is free" in lines[0]


def test_run_refuses_before_loading_when_nothing_fits() -> None:
    result = llmlocal("run", "Hi", "--memory-budget", "60M")
    assert result.returncode == 2 and "needs" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="with an NVIDIA driver (and no NVML) the probe asks torch")
def test_planning_does_not_import_torch() -> None:
    code = (
        "import sys, json\n"
        "from llmlocal.app.cli import main\n"
        "main(['plan', '--json'])\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["n_ctx"] > 0


def test_run_flags_pin_the_plan_and_the_planner_fills_the_rest(starter_cpu_backend: str) -> None:
    args = build_parser().parse_args(["run", "Hi", "--ctx", "1024", "--gpu-layers", "0", "--memory-budget", "4G"])
    plan = plan_from_args(args)
    assert (plan.n_ctx, plan.backend, plan.device, plan.gpu_layers) == (1024, starter_cpu_backend, "cpu", 0)
    assert plan.memory_budget == 4 << 30
    args = build_parser().parse_args(["run", "Hi", "--device", "cpu"])
    assert plan_from_args(args).n_ctx == 8192  # the default, chosen because it fits


def test_run_loads_the_planned_context(starter_cpu_backend: str) -> None:
    result = llmlocal("run", "Say hi.", "--json", "--temperature", "0", "--max-tokens", "2", "--device", "cpu",
                      "--memory-budget", "1G")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["backend"] == starter_cpu_backend and data["n_ctx"] == 8192
