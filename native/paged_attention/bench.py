"""Benchmark paged decode attention; prints one JSON object.

    python -m llmlocal.native.paged_attention.bench
    python -m llmlocal.native.paged_attention.bench --batch 1 8 --context 512 --dtype bfloat16

Shapes default to Llama-3.2-1B's attention (32 query heads, 8 kv heads, head_dim 64) with
16-token blocks scattered over a shuffled cache. For each shape it times the torch reference
on the CPU and, when CUDA is available, the Triton kernel and the reference on the GPU.
``bytes`` counts what an ideal kernel must move: the K and V of every context token, q and
the output; ``gb_s`` is that over the median time per call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from . import paged_decode_attention_reference, paged_decode_attention_triton


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16


@dataclass
class Result:
    impl: str
    device: str
    dtype: str
    shape: Shape
    ms: float  # median per call
    ms_min: float
    bytes: int
    gb_s: float  # bytes / median time


def bytes_moved(shape: Shape, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * shape.batch * shape.context * shape.n_kv_heads * shape.head_dim * elem
    q_and_out = 2 * shape.batch * shape.n_heads * shape.head_dim * elem
    return kv + q_and_out


def make_inputs(shape: Shape, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    blocks_per_seq = math.ceil(shape.context / shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.n_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    table = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = table.view(shape.batch, blocks_per_seq)  # (B, blocks_per_seq)
    context_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    q = torch.randn(shape.batch, shape.n_heads, shape.head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, block_tables, context_lens


def time_ms(
    fn: Callable[[], object], device: str, min_seconds: float = 0.5, max_iters: int = 200
) -> tuple[float, float]:
    """(median, minimum) milliseconds per call, after two warm-up calls."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_iters and (time.perf_counter() - start < min_seconds or len(samples) < 3):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), min(samples)


def bench_one(impl: str, device: str, dtype: torch.dtype, shape: Shape) -> Result:
    q, k_cache, v_cache, block_tables, context_lens = make_inputs(shape, dtype, device)
    kernel = paged_decode_attention_triton if impl == "triton" else paged_decode_attention_reference
    scale = shape.head_dim**-0.5

    def call() -> object:
        return kernel(q, k_cache, v_cache, block_tables, context_lens, scale, shape.context)

    ms, ms_min = time_ms(call, device)
    moved = bytes_moved(shape, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    return Result(impl, device, dtype_name, shape, round(ms, 4), round(ms_min, 4), moved, round(moved / ms / 1e6, 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    runs = [("reference", "cpu")]
    if torch.cuda.is_available():
        runs += [("triton", "cuda"), ("reference", "cuda")]
    results = []
    for dtype_name in args.dtype:
        for batch in args.batch:
            for context in args.context:
                shape = Shape(batch, context)
                for impl, device in runs:
                    results.append(bench_one(impl, device, getattr(torch, dtype_name), shape))

    report = {
        "kernel": "paged_decode_attention",
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "results": [asdict(r) for r in results],
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
