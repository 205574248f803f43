"""The hardware probe on this machine, and the memory-budget override."""

from __future__ import annotations

import os

import psutil
import pytest
from llmlocal.engine.planning.hardware import (
    BUDGET_ENV,
    GPU,
    Hardware,
    parse_memory_budget,
    parse_size,
    physical_cores,
    probe,
    simd_features,
)
from llmlocal.models.errors import LLMLocalError

GIB = 1 << 30


def test_probe_reads_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    hw = probe()
    vm = psutil.virtual_memory()
    assert hw.total_ram == vm.total
    assert 0 < hw.available_ram <= hw.total_ram
    assert hw.ram_used_by_others == hw.total_ram - hw.available_ram
    assert hw.physical_cores == physical_cores() >= 1
    assert hw.budget_source == "probed"
    if not (os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia")):
        assert hw.gpus == () and hw.llamacpp_gpu is False
    for gpu in hw.gpus:
        assert 0 <= gpu.free_bytes <= gpu.total_bytes


def test_simd_features_match_cpuinfo() -> None:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    found = simd_features()
    for flag in ("avx", "avx2", "fma", "avx512f", "asimd"):
        assert (flag in found) == (flag in flags), flag


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8G", 8 * GIB), ("6.5GB", int(6.5 * GIB)), ("512MiB", 512 << 20), ("512m", 512 << 20), ("1234", 1234), ("2t", 2 << 40)],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "eight gigs", "8X", "-1G", "0"])
def test_bad_sizes_name_the_format(text: str) -> None:
    with pytest.raises(LLMLocalError, match="8G"):
        parse_memory_budget(text)


def test_budget_parts() -> None:
    assert parse_memory_budget("8G") == (8 * GIB, None)
    assert parse_memory_budget("8G,gpu=5G") == (8 * GIB, 5 * GIB)
    assert parse_memory_budget("cuda=20G") == (None, 20 * GIB)
    assert parse_memory_budget("ram=1G") == (GIB, None)
    with pytest.raises(LLMLocalError, match="Unknown memory budget part"):
        parse_memory_budget("disk=1G")


def test_budget_argument_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUDGET_ENV, "3G")
    hw = probe()
    assert hw.available_ram == 3 * GIB and hw.budget_source == f"${BUDGET_ENV}"
    hw = probe("2G")  # the flag wins over the environment
    assert hw.available_ram == 2 * GIB and hw.budget_source == "--memory-budget"
    assert hw.total_ram == psutil.virtual_memory().total  # only the budget changes


def test_gpu_budget_replaces_free_gpu_memory() -> None:
    hw = Hardware(16 * GIB, 12 * GIB, 8, gpus=(GPU(0, "test", 8 * GIB, 7 * GIB, GIB),))
    limited = hw.with_budget("gpu=4G", "--memory-budget")
    assert limited.gpus[0].free_bytes == 4 * GIB and limited.available_ram == 12 * GIB
    assert limited.gpus[0].total_bytes == 8 * GIB
    assert hw.summary()["gpus"][0]["free_bytes"] == 7 * GIB
