"""Where a decode step's time goes, for the GPU check: one JSON object on stdout, the profiler's
table of the eager step on stderr (the check's log keeps both).

On CUDA, with the check's model loaded as `bench decode` loads it (paged, context 2048, 16
slots), this reports

* ``itl_ms``: the engine's inter-token latency of one request (the median of three);
* ``replayed``: how many of that request's decode steps replayed a CUDA graph (the rest ran
  eagerly: a step that should replay and does not is the first thing to look at);
* ``graph_ms``: one replay of the batch-1 and batch-16 graphs alone (CUDA events, the median
  of 50): the GPU's own time per step, and ``graph_gb_s`` the weight bytes over it;
* ``eager_ms``, ``eager_kernels``: the same batch-1 forward pass run eagerly, host clock with a
  synchronisation, and the kernels it launches (torch.profiler);
* ``host_ms``: the engine's ITL less the replay: scheduling, sampling and the copies around it;
* ``ttft_s``: the first token of three prompts of the same length (512 words), one after the
  other: the first pays for compiling the prefill's kernels, the others should not;
  ``prefill_wall_s`` and ``prefill_gpu_s`` a fourth under the profiler: its wall time and the
  GPU kernels' time in it (the profiler's tables by CUDA and by host time go to stderr).

Without CUDA (the dry run) only ``itl_ms`` and ``ttft_s`` are measured.

    python packaging/gpu_check_profile.py model.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import llmlocal_without_llama_cpp  # noqa: F401  (beside this file: GGUFs tokenized where llama_cpp is absent)

WORDS = "river stone light garden window morning paper music harbour bridge winter orange".split()


def _request(engine: Any, text: str, tokens: int) -> Any:
    from llmlocal.engine import DoneEvent, Request, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return next(e for e in engine.generate(Request.chat([{"role": "user", "content": text}], params))
                if isinstance(e, DoneEvent)).stats


def _events_ms(fn: Any, repeats: int = 50) -> float:
    import torch

    times = []
    for _ in range(repeats + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def profile(model: str, ctx: int) -> dict[str, Any]:
    import torch
    from llmlocal.engine import Engine, Plan

    cuda = torch.cuda.is_available()
    plan = Plan(model=model, backend="paged", device="cuda" if cuda else "cpu", n_ctx=ctx, max_batch=16 if cuda else 4)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    with Engine.load(plan) as engine:
        runner = engine.backend.runner
        _request(engine, "Say hello.", 8)  # warm-up
        graphs = runner.graphs
        before = graphs.replays if graphs is not None else 0
        runs = [_request(engine, f"Write a story about the sea ({i}).", 64) for i in range(3)]
        out["itl_ms"] = statistics.median(s.itl_ms_p50 for s in runs)
        out["decode_steps"] = sum(s.completion_tokens - 1 for s in runs)
        out["replayed"] = (graphs.replays - before) if graphs is not None else 0
        prompt = " ".join(WORDS[i % len(WORDS)] for i in range(512))
        out["ttft_s"] = [round(_request(engine, f"({i}) Summarise: " + prompt, 1).ttft_s, 3) for i in range(3)]
        if graphs is None:
            return out
        graphs.slots.fill_(-1)  # the replays and eager passes below write no KV
        weight_bytes = runner.model.weight_bytes()
        out["weight_bytes"] = int(weight_bytes)
        out["graph_ms"] = {str(b): round(_events_ms(graphs.graphs[b].replay), 3) for b in (1, max(graphs.sizes))}
        out["graph_gb_s"] = round(weight_bytes / (out["graph_ms"]["1"] / 1e3) / 1e9, 1)
        with torch.inference_mode():
            eager = []
            for _ in range(25):
                torch.cuda.synchronize()
                t = time.perf_counter()
                graphs._forward(1)
                torch.cuda.synchronize()
                eager.append((time.perf_counter() - t) * 1e3)
            out["eager_ms"] = round(statistics.median(eager[5:]), 3)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graphs._forward(1)
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["eager_kernels"] = len(kernels)
        out["host_ms"] = round(out["itl_ms"] - out["graph_ms"]["1"], 3)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), file=sys.stderr)
        # a fourth prompt of the same length under the profiler: the GPU's time in it against
        # the first token's wall time, and where the host's went
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            t = time.perf_counter()
            _request(engine, "(3) Summarise: " + prompt, 1)
            wall = time.perf_counter() - t
        gpu_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        out["prefill_wall_s"], out["prefill_gpu_s"] = round(wall, 3), round(gpu_us / 1e6, 3)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=2048)
    args = p.parse_args()
    print(json.dumps(profile(args.model, args.ctx)))


if __name__ == "__main__":
    main()
