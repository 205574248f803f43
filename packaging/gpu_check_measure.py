"""Two measurements of the GPU check, each printing one JSON object.

``bandwidth``: the device's memory bandwidth as a large tensor copy moves it, counting bytes
read plus bytes written (the ceiling decode's MBU is taken against). The median of 20 copies,
timed with CUDA events on a GPU, with a host clock on the CPU.

``memory MODEL``: the planner's prediction for `llmlocal plan MODEL --backend paged --device D
--ctx N` against what loading that very plan and serving requests on it takes. On CUDA:
the device memory in use at the peak (sampled every 10 ms through NVML, or nvidia-smi) less
what was in use before this process touched the GPU, and torch's own peak reservation; the
planner's figure for the GPU includes the CUDA context, which only the first one sees.
On the CPU (the dry run): the process's peak resident memory less its size before loading.
``phases`` (CUDA): device memory and torch's reservation after the context alone, after
loading (weights, KV pool, captured graphs) and after serving: what is not torch's is the
context, the libraries' workspaces and the loaded kernels.

    python packaging/gpu_check_measure.py bandwidth
    python packaging/gpu_check_measure.py memory model.gguf --device cuda --ctx 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import llmlocal_without_llama_cpp  # noqa: F401  (beside this file: GGUFs tokenized where llama_cpp is absent)


def bandwidth() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    nbytes = (1 << 30) if cuda else (256 << 20)  # far larger than the L2 (50-60 MB) or a CPU's caches
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda" if cuda else "cpu").uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t
        if i >= 5:  # warm-up: allocation, clocks, first-touch page faults
            times.append(seconds)
    if not torch.equal(dst[:1024], src[:1024]):
        raise RuntimeError("the copy did not copy")
    median = statistics.median(times)
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "bytes_copied": nbytes,
            "median_ms": round(median * 1e3, 3), "gb_s": round(2 * nbytes / median / 1e9, 1)}


def _gpu_used_reader() -> Callable[[], int] | None:
    """Device memory in use by all processes, read through NVML (or nvidia-smi): no CUDA call,
    which a sampling thread must not make while the engine captures its CUDA graphs."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except (ImportError, OSError) as e:
        print(f"gpu_check_measure: no NVML ({e}); asking nvidia-smi", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError and kin: fall back to the command line tool
        print(f"gpu_check_measure: NVML failed ({e}); asking nvidia-smi", file=sys.stderr)

    def nvidia_smi() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.split()[0])) << 20

    try:
        nvidia_smi()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return nvidia_smi


class _PeakSampler:
    """Samples a reading every 10 ms on a thread; keeps the largest."""

    def __init__(self, read: Any) -> None:
        self._read = read
        self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._read())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())
        return self.peak


def _serve(engine: Any, max_batch: int) -> int:
    """A long prompt (a full prefill chunk and more), then a full batch of short requests at once."""
    from llmlocal.engine import DoneEvent, Request, SamplingParams

    def one(text: str, tokens: int) -> int:
        request = Request.chat([{"role": "user", "content": text}], SamplingParams(temperature=0, max_tokens=tokens,
                                                                                 ignore_eos=True))
        done = [e for e in engine.generate(request) if isinstance(e, DoneEvent)]
        return done[0].stats.completion_tokens

    words = "river stone light garden window morning paper music harbour bridge winter orange".split()
    produced = one("Summarise: " + " ".join(words[i % len(words)] for i in range(700)), 32)
    results = [0] * max_batch

    def short(i: int) -> None:
        results[i] = one(f"Count to {i + 3}.", 32)

    threads = [threading.Thread(target=short, args=(i,)) for i in range(max_batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return produced + sum(results)


def memory(model: str, device: str, ctx: int) -> dict[str, Any]:
    import psutil
    from llmlocal.app.cli import build_parser
    from llmlocal.app.options import choice_from_args
    from llmlocal.engine import Engine

    read_gpu = _gpu_used_reader() if device == "cuda" else None
    args = build_parser().parse_args(["plan", model, "--backend", "paged", "--device", device, "--ctx", str(ctx)])
    choice = choice_from_args(args)
    predicted = {d.device: d.to_dict() for d in choice.chosen.devices}
    plan = choice.plan
    out: dict[str, Any] = {"plan": choice.chosen.describe(), "kv_blocks": plan.kv_blocks, "max_batch": plan.max_batch,
                           "predicted": predicted}
    process = psutil.Process()
    if device == "cpu":
        sampler = _PeakSampler(lambda: int(process.memory_info().rss))
    elif read_gpu is not None:  # before this process's CUDA context: the planner counts that too
        sampler = _PeakSampler(read_gpu)
    else:
        sampler = None
    before = sampler.peak if sampler is not None else 0
    phases: dict[str, dict[str, int]] = {}

    def phase(name: str) -> None:
        """Device memory in use (less what was before) and torch's reservation, now."""
        if device == "cuda" and read_gpu is not None:
            import torch

            torch.cuda.synchronize()
            phases[name] = {"device": read_gpu() - before, "torch_reserved": torch.cuda.memory_reserved()}

    if device == "cuda":
        import torch

        torch.zeros(1, device="cuda")  # the CUDA context alone, before the engine's libraries and kernels
        phase("context")
    t = time.perf_counter()
    with Engine.load(plan) as engine:
        phase("loaded")
        tokens = _serve(engine, plan.max_batch)
        phase("served")
    out.update(tokens=tokens, seconds=round(time.perf_counter() - t, 1), phases=phases)
    key = "cuda:0" if device == "cuda" else "cpu"
    # the planner's peak (loading's high-water mark, or the total if higher) is what must fit
    # and what a sampled peak measures; its total is kept beside it
    out["predicted_bytes"] = predicted[key]["peak"]
    out["predicted_total_bytes"] = predicted[key]["total"]
    if device == "cuda":
        import torch

        out["torch_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    # without NVML or nvidia-smi, torch's reservation: without the CUDA context and libraries
    out["measured_bytes"] = sampler.stop() - before if sampler is not None else out["torch_max_reserved_bytes"]
    out["measured_by"] = "rss" if device == "cpu" else "device" if sampler is not None else "torch reserved"
    out["error"] = round(out["predicted_bytes"] / out["measured_bytes"] - 1, 4) if out["measured_bytes"] > 0 else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("bandwidth")
    m = sub.add_parser("memory")
    m.add_argument("model")
    m.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    m.add_argument("--ctx", type=int, default=2048)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = bandwidth() if args.what == "bandwidth" else memory(args.model, args.device, args.ctx)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
