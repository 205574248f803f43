"""What this machine offers: cores, SIMD features, RAM, CUDA GPUs, and the memory budget.

`probe()` is fast (no torch import unless an NVIDIA driver is present and NVML is not
installed) and returns a `Hardware` the planner does arithmetic on. Tests build `Hardware`
by hand: an 8 GB laptop, a 6 GB GPU, an 80 GB H100.

The budget the planner may fill is the memory available now, not the total: other processes'
use is subtracted (RAM: the kernel's "available" figure, capped by a cgroup limit; GPU: free
memory as the driver reports it). ``--memory-budget`` or ``$LLMLOCAL_MEMORY_BUDGET``
replaces the probed figures: ``8G`` (RAM), ``8G,gpu=5G`` or ``gpu=20G`` (every GPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass

from llmlocal.models.errors import LLMLocalError

BUDGET_ENV = "LLMLOCAL_MEMORY_BUDGET"
GIB = 1 << 30

# CPU flags that matter to the kernels llama.cpp and torch pick (x86 and Arm names)
_SIMD_FLAGS = (
    "sse3", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve", "sve2",
)


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_bytes: int
    free_bytes: int  # what a new allocation can get now
    used_by_others: int  # bytes other processes hold on it

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


@dataclass(frozen=True)
class Hardware:
    total_ram: int
    available_ram: int  # bytes a new process can use without swapping (or the budget)
    physical_cores: int
    simd: frozenset[str] = frozenset()
    gpus: tuple[GPU, ...] = ()
    llamacpp_gpu: bool = False  # the installed llama.cpp can offload layers to a GPU
    budget_source: str = "probed"  # or "--memory-budget" / "$LLMLOCAL_MEMORY_BUDGET"

    @property
    def ram_used_by_others(self) -> int:
        return max(0, self.total_ram - self.available_ram)

    def with_budget(self, text: str, source: str) -> Hardware:
        """This machine with the budget ``text`` ("8G", "8G,gpu=5G", "gpu=20G") in place of
        the probed free memory."""
        ram, gpu = parse_memory_budget(text)
        hw = self
        if ram is not None:
            hw = dataclasses.replace(hw, available_ram=ram)
        if gpu is not None:
            gpus = tuple(dataclasses.replace(g, free_bytes=gpu) for g in hw.gpus)
            hw = dataclasses.replace(hw, gpus=gpus)
        return dataclasses.replace(hw, budget_source=source)

    def summary(self) -> dict[str, object]:
        return {
            "total_ram": self.total_ram,
            "available_ram": self.available_ram,
            "physical_cores": self.physical_cores,
            "simd": sorted(self.simd),
            "gpus": [dataclasses.asdict(g) for g in self.gpus],
            "llamacpp_gpu": self.llamacpp_gpu,
            "budget_source": self.budget_source,
        }


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8G', '6.5GB', '512MiB', '1234' (bytes) -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise LLMLocalError(f"Cannot read the memory size '{text}': write it like 8G, 6.5GB or 512M.")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise LLMLocalError(f"The memory budget must be positive, got '{text}': write it like 8G or 512M.")
    return value


def parse_memory_budget(text: str) -> tuple[int | None, int | None]:
    """'8G' -> (RAM, None); '8G,gpu=5G' -> (RAM, per-GPU); 'gpu=20G' -> (None, per-GPU)."""
    ram = gpu = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            ram = parse_size(key)
        elif key.strip().lower() in ("ram", "cpu"):
            ram = parse_size(value)
        elif key.strip().lower() in ("gpu", "cuda"):
            gpu = parse_size(value)
        else:
            raise LLMLocalError(f"Unknown memory budget part '{part}': write it like 8G or 8G,gpu=5G.")
    if ram is None and gpu is None:
        raise LLMLocalError("The memory budget is empty: write it like 8G or 8G,gpu=5G.")
    return ram, gpu


def physical_cores() -> int:
    """Physical cores (not hyper-threads): llama.cpp decodes fastest with one thread per core."""
    import psutil

    n = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        # Respect a CPU affinity mask (containers, taskset): never more threads than usable CPUs.
        n = min(n, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        pass
    return max(1, n)


def simd_features() -> frozenset[str]:
    """SIMD extensions of this CPU, from /proc/cpuinfo (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    have = set(value.split())
                    return frozenset(flag for flag in _SIMD_FLAGS if flag in have)
    except OSError:
        pass
    return frozenset()


def _cgroup_limit() -> int | None:
    """Bytes this process's cgroup may still use (v2, then v1), or None when unlimited."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            with open(usage_path) as f:
                return max(0, int(raw) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def _ram() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    available = vm.available
    limit = _cgroup_limit()
    if limit is not None:
        available = min(available, limit)
    return int(vm.total), int(available)


def _nvidia_driver_present() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia")


def _gpus_nvml() -> tuple[GPU, ...] | None:
    """Through NVML (the `nvidia-ml-py` package), which needs no CUDA context; None if absent."""
    if importlib.util.find_spec("pynvml") is None:
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        me = os.getpid()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                others = sum(p.usedGpuMemory or 0 for p in procs if p.pid != me)
            except pynvml.NVMLError:
                others = int(mem.used)
            out.append(GPU(i, name.decode() if isinstance(name, bytes) else str(name), int(mem.total), int(mem.free), int(others)))
        return tuple(out)
    finally:
        pynvml.nvmlShutdown()


def _gpus_torch() -> tuple[GPU, ...]:
    """Through torch, only when torch is installed and an NVIDIA driver exists (importing torch
    costs a second that CPU-only machines should not pay)."""
    if importlib.util.find_spec("torch") is None or not _nvidia_driver_present():
        return ()
    import torch

    if not torch.cuda.is_available():
        return ()
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        mine = torch.cuda.memory_reserved(i)
        others = max(0, total - free - mine)
        out.append(GPU(i, torch.cuda.get_device_name(i), int(total), int(free), int(others)))
    return tuple(out)


def _llamacpp_gpu() -> bool:
    """Whether the installed llama-cpp-python carries a GPU backend, read from its library
    files (importing llama_cpp to ask costs a quarter of a second)."""
    try:
        found = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return False
    if found is None or not found.submodule_search_locations:
        return False
    for root in found.submodule_search_locations:
        for _, _, files in os.walk(root):
            if any(re.search(r"ggml-(cuda|vulkan|metal|hip)", f) for f in files):
                return True
    return False


def probe(memory_budget: str | None = None) -> Hardware:
    """This machine. ``memory_budget`` (or ``$LLMLOCAL_MEMORY_BUDGET``) overrides the free
    memory probed; the argument wins over the environment."""
    total, available = _ram()
    gpus: tuple[GPU, ...] = ()
    if _nvidia_driver_present():
        nvml = _gpus_nvml()
        gpus = nvml if nvml is not None else _gpus_torch()
    hw = Hardware(
        total_ram=total,
        available_ram=available,
        physical_cores=physical_cores(),
        simd=simd_features(),
        gpus=gpus,
        llamacpp_gpu=bool(gpus) and _llamacpp_gpu(),
    )
    if memory_budget is not None:
        return hw.with_budget(memory_budget, "--memory-budget")
    env = os.environ.get(BUDGET_ENV)
    if env:
        return hw.with_budget(env, f"${BUDGET_ENV}")
    return hw
