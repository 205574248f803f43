"""`llmlocal doctor`: what it reports is what this installation is (versions, kernels, CUDA,
llama.cpp, paths, default model), checked against the libraries themselves."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from llmlocal.app.cli import main

LLMLOCAL = [sys.executable, "-m", "llmlocal.app"]


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMLOCAL, "doctor", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def doctor_json(capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["doctor", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def report_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The (absent) settings file of the module's doctor runs: module fixtures start before the
    per-test one that isolates the config."""
    return tmp_path_factory.mktemp("doctor") / "config.toml"


@pytest.fixture(scope="module")
def report(report_config: Path) -> dict:
    result = doctor("--json", LLMLOCAL_SPARSE_ISA="", LLMLOCAL_CONFIG=str(report_config))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_versions_are_the_installed_ones(report: dict) -> None:
    assert report["versions"] == {
        "llmlocal": version("llmlocal"),
        "python": platform.python_version(),
        "torch": version("torch"),
        "llama-cpp-python": version("llama-cpp-python"),
        "textual": version("textual"),
    }


def test_cpu_features_and_the_kernels_isa_match_the_runtime(report: dict) -> None:
    from llmlocal.engine.planning.hardware import simd_features
    from llmlocal.native.cpu import runtime

    assert report["cpu"]["simd"] == sorted(simd_features())
    native = report["native_kernels"]
    assert native["built"] is runtime.built()
    assert native["best_isa"] == runtime.best_isa()
    # Nothing forced: the kernels take the best path the runtime finds for this CPU and build.
    # (Not runtime.isa() here: other tests in this process may have switched it.)
    assert native["isa"] == runtime.best_isa()
    assert native["forced_by"] is None
    # the GGUF-type kernels' variant on that path: VNNI where the CPU has it, AMX in prefill
    simd = set(report["cpu"]["simd"])
    if native["isa"] == "avx512" and "avx512_vnni" in simd:
        assert native["gguf_kernel"] in ("avx512vnni", "avx512vnni-amx")
        assert (native["gguf_kernel"] == "avx512vnni-amx") <= ("amx_int8" in simd)
        assert native["prompt_tiles"] == ({"amx_bf16", "avx512_bf16", "amx_tile"} <= simd)
    elif native["isa"] == "avx2":
        assert native["gguf_kernel"] == ("avxvnni" if "avx_vnni" in simd else "avx2")


def test_a_forced_isa_is_the_one_reported() -> None:
    result = doctor("--json", LLMLOCAL_SPARSE_ISA="scalar")
    assert result.returncode == 0, result.stderr
    native = json.loads(result.stdout)["native_kernels"]
    assert (native["isa"], native["forced_by"]) == ("scalar", "LLMLOCAL_SPARSE_ISA")


def test_cuda_and_llamacpp_offload_are_what_the_libraries_say(report: dict) -> None:
    import llama_cpp
    import torch

    cuda = report["cuda"]
    assert cuda["available"] is torch.cuda.is_available()
    assert cuda["torch_cuda"] == torch.version.cuda
    if not cuda["available"]:
        assert cuda["devices"] == [] and cuda["reason"]
        if torch.version.cuda is None:
            assert f"torch {torch.__version__} is built without CUDA" in cuda["reason"]
    else:
        assert len(cuda["devices"]) == torch.cuda.device_count()
    assert report["llamacpp"]["gpu_offload"] is bool(llama_cpp.llama_supports_gpu_offload())
    if not report["llamacpp"]["gpu_offload"]:
        assert "-DGGML_CUDA=on" in report["llamacpp"]["hint"]


def test_paths_and_default_model(report: dict, report_config: Path, starter_path: str) -> None:
    paths = report["paths"]
    assert paths["config"] == {"path": str(report_config), "exists": False}
    assert report["default_model"] == {"name": "smollm2-135m", "source": "built-in", "path": starter_path}


def test_the_data_directory_comes_from_the_environment_then_the_file_then_the_default(
    isolated_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LLMLOCAL_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    data = doctor_json(capsys)["paths"]["data_dir"]
    assert (data["path"], data["source"]) == (str(tmp_path / "xdg" / "llmlocal"), "built-in")

    isolated_config.write_text(f'data_dir = "{tmp_path / "from-file"}"\nmodel = "{tmp_path / "gone.gguf"}"\n')
    got = doctor_json(capsys)
    assert (got["paths"]["data_dir"]["path"], got["paths"]["data_dir"]["source"]) == (str(tmp_path / "from-file"), "config file")
    assert got["paths"]["data_dir"]["chats"] == str(tmp_path / "from-file" / "chats.db")
    assert got["paths"]["config"]["exists"] is True
    assert got["default_model"]["source"] == "config file" and "No model named" in got["default_model"]["error"]

    monkeypatch.setenv("LLMLOCAL_DATA_DIR", str(tmp_path / "from-env"))
    data = doctor_json(capsys)["paths"]["data_dir"]
    assert (data["path"], data["source"]) == (str(tmp_path / "from-env"), "$LLMLOCAL_DATA_DIR")


def test_text_output_says_the_same(report: dict, report_config: Path) -> None:
    result = doctor(LLMLOCAL_SPARSE_ISA="", LLMLOCAL_CONFIG=str(report_config))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"llmlocal {report['versions']['llmlocal']}"
    rows = {line[:22].strip(): line[22:] for line in lines if line.startswith("  ")}
    assert rows["torch"] == report["versions"]["torch"]
    assert rows["llama-cpp-python"] == report["versions"]["llama-cpp-python"]
    assert rows["textual"] == report["versions"]["textual"]
    assert rows["simd"] == " ".join(report["cpu"]["simd"])
    native = report["native_kernels"]
    assert rows["native kernels"].startswith(f"{native['isa']} path") and f"through {native['gguf_kernel']}" in rows["native kernels"]
    assert ("bfloat16 AMX tiles" in rows["native kernels"]) == native["prompt_tiles"]
    assert rows["cuda"].startswith("available" if report["cuda"]["available"] else "not available: ")
    assert rows["llama.cpp offload"].startswith("yes" if report["llamacpp"]["gpu_offload"] else "no: ")
    assert rows["config"] == f"{report['paths']['config']['path']} (not created yet)"
    assert rows["name"] == "smollm2-135m (built-in)" and rows["file"] == report["default_model"]["path"]
