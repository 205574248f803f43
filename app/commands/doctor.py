"""`llmlocal doctor`: what this installation is and what it can use here.

Prints the versions of llmlocal and the libraries it runs on, the CPU's SIMD features and the
path llmlocal's native kernels took, whether CUDA can be used (and if not, why), whether the
installed llama.cpp can offload layers to a GPU, where settings, chats and models live, and
the default model. Nothing is downloaded and no model is loaded.

Examples:

    llmlocal doctor
    llmlocal doctor --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

PACKAGES = ("torch", "llama-cpp-python", "textual")
NVIDIA_DRIVER_FILES = ("/dev/nvidia0", "/proc/driver/nvidia")
LLAMACPP_CUDA_BUILD = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="versions, CPU features, native kernels, CUDA, paths and the default model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, ensure_ascii=False) if args.json else render(report))
    return 0


def collect() -> dict[str, Any]:
    """Everything `doctor` reports, as plain data (what --json prints)."""
    from .. import config

    cfg = config.load()
    return {
        "versions": versions(),
        "cpu": cpu(),
        "native_kernels": native_kernels(),
        "cuda": cuda(),
        "llamacpp": llamacpp(),
        "paths": paths(cfg),
        "default_model": default_model(cfg),
    }


def versions() -> dict[str, str | None]:
    """llmlocal, Python and the libraries it runs on; None for one that is not installed."""
    out: dict[str, str | None] = {"llmlocal": _version("llmlocal"), "python": platform.python_version()}
    for name in PACKAGES:
        out[name] = _version(name)
    return out


def _version(dist: str) -> str | None:
    try:
        return dist_version(dist)
    except PackageNotFoundError:
        return None


def cpu() -> dict[str, Any]:
    from llmlocal.engine.planning.hardware import physical_cores, simd_features

    return {"machine": platform.machine(), "physical_cores": physical_cores(), "simd": sorted(simd_features())}


def native_kernels() -> dict[str, Any]:
    """The native CPU kernels: whether they were compiled, the ISA path they took, and the variant
    the GGUF-type kernels run (VNNI, AMX in prefill, AMX-BF16 tiles for prompt rows)."""
    from llmlocal.native.cpu import runtime

    if not runtime.built():
        return {"built": False, "error": "not compiled: reinstall llmlocal on a machine with a C compiler"}
    try:
        return {
            "built": True,
            "isa": runtime.isa(),
            "best_isa": runtime.best_isa(),
            "gguf_kernel": runtime.qmat_kernel(),  # the GGUF-type kernels' variant: avx2 ... avx512vnni-amx
            "prompt_tiles": runtime.qmat_tiles(),  # prompt rows through AMX-BF16 tiles
            "forced_by": "LLMLOCAL_SPARSE_ISA" if os.environ.get("LLMLOCAL_SPARSE_ISA", "").strip() else None,
            "threads": runtime.num_threads(),
        }
    except (ImportError, ValueError) as e:  # a broken build, or a bad LLMLOCAL_SPARSE_ISA
        return {"built": True, "error": str(e)}


def cuda() -> dict[str, Any]:
    """Whether torch can use a CUDA GPU here, and the first reason it cannot."""
    import importlib.util

    driver = any(os.path.exists(p) for p in NVIDIA_DRIVER_FILES)
    if importlib.util.find_spec("torch") is None:
        return {"available": False, "driver": driver, "torch_cuda": None, "devices": [], "reason": "torch is not installed"}
    import torch

    built_for = torch.version.cuda
    out: dict[str, Any] = {"available": False, "driver": driver, "torch_cuda": built_for, "devices": []}
    if built_for is not None and driver and torch.cuda.is_available():
        out["available"] = True
        out["devices"] = [_gpu(torch, i) for i in range(torch.cuda.device_count())]
        return out
    out["reason"] = _no_cuda_reason(torch.__version__, built_for, driver)
    return out


def _no_cuda_reason(torch_version: str, built_for: str | None, driver: bool) -> str:
    reasons = []
    if built_for is None:
        reasons.append(f"torch {torch_version} is built without CUDA")
    if not driver:
        reasons.append(f"no NVIDIA driver was found ({' and '.join(NVIDIA_DRIVER_FILES)} are missing)")
    if not reasons:  # a CUDA build and a driver, yet no device
        return f"torch (CUDA {built_for}) cannot use the NVIDIA driver: check with nvidia-smi that it supports CUDA {built_for}"
    if driver:  # the GPU is there: only torch is missing its CUDA build
        reasons[-1] += ": install a CUDA build of torch to use the GPU"
    return " and ".join(reasons)


def _gpu(torch: Any, index: int) -> dict[str, Any]:
    free, total = torch.cuda.mem_get_info(index)
    return {"index": index, "name": torch.cuda.get_device_name(index), "total_bytes": int(total), "free_bytes": int(free)}


def llamacpp() -> dict[str, Any]:
    """Whether the installed llama.cpp build can offload layers to a GPU."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as e:  # a missing or broken native library: reported
        return {"gpu_offload": False, "error": f"llama-cpp-python does not load ({e})"}
    if llama_cpp.llama_supports_gpu_offload():
        return {"gpu_offload": True}
    return {"gpu_offload": False, "hint": f"built for the CPU only; for an NVIDIA GPU reinstall it: {LLAMACPP_CUDA_BUILD}"}


def paths(cfg: Any) -> dict[str, Any]:
    from llmlocal.models.hub import cache_dir

    from ..config import effective

    data = effective(cfg, "data_dir")
    models = effective(cfg, "models_dir")
    return {
        "config": {"path": str(cfg.path), "exists": cfg.path.is_file()},
        "data_dir": {"path": str(data.value), "source": data.source, "chats": str(data.value / "chats.db")},
        "models_dir": {"path": str(models.value), "source": models.source},
        "hf_cache": {"path": str(cache_dir())},
    }


def default_model(cfg: Any) -> dict[str, Any]:
    from llmlocal.models import resolve
    from llmlocal.models.errors import LLMLocalError

    from ..config import effective

    setting = effective(cfg, "model")
    out: dict[str, Any] = {"name": setting.value, "source": setting.source}
    try:
        out["path"] = resolve(setting.value).path
    except LLMLocalError as e:
        out["error"] = str(e)
    return out


# ---- text -------------------------------------------------------------------------------
def render(r: dict[str, Any]) -> str:
    v = r["versions"]
    lines = [f"llmlocal {v['llmlocal'] or 'unknown'}"]
    lines += _rows([("python", f"{v['python']} ({r['cpu']['machine']})")] + [(n, v[n] or "not installed") for n in PACKAGES])
    c = r["cpu"]
    lines += ["", "cpu"] + _rows([
        ("cores", f"{c['physical_cores']} physical"),
        ("simd", " ".join(c["simd"]) or "none detected"),
        ("native kernels", _native_text(r["native_kernels"])),
    ])
    lines += ["", "gpu"] + _rows([("cuda", _cuda_text(r["cuda"])), ("llama.cpp offload", _llamacpp_text(r["llamacpp"]))])
    p = r["paths"]
    lines += ["", "paths"] + _rows([
        ("config", p["config"]["path"] + ("" if p["config"]["exists"] else " (not created yet)")),
        ("chats", f"{p['data_dir']['chats']} ({p['data_dir']['source']})"),
        ("models", f"{p['models_dir']['path']} ({p['models_dir']['source']})"),
        ("hugging face cache", p["hf_cache"]["path"]),
    ])
    m = r["default_model"]
    found = m["path"] if "path" in m else f"not available: {m['error']}"
    lines += ["", "default model"] + _rows([("name", f"{m['name']} ({m['source']})"), ("file", found)])
    return "\n".join(lines)


def _rows(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"  {key:<20}{value}" for key, value in pairs]


def _native_text(n: dict[str, Any]) -> str:
    if "error" in n:
        return n["error"]
    forced = f", forced by {n['forced_by']}" if n["forced_by"] else ""
    tiles = " (prompts in bfloat16 AMX tiles)" if n.get("prompt_tiles") else ""
    return (f"{n['isa']} path (best here: {n['best_isa']}{forced}), GGUF types through {n['gguf_kernel']}{tiles}, "
            f"{n['threads']} threads")


def _cuda_text(c: dict[str, Any]) -> str:
    if not c["available"]:
        return f"not available: {c['reason']}"
    gpus = ", ".join(f"cuda:{g['index']} {g['name']}" for g in c["devices"])
    return f"available (CUDA {c['torch_cuda']}): {gpus}"


def _llamacpp_text(lc: dict[str, Any]) -> str:
    if lc["gpu_offload"]:
        return "yes"
    return f"no: {lc.get('error') or lc['hint']}"
