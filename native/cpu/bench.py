"""Benchmark the sparse INT4 GEMV; prints one JSON object.

    python -m llmlocal.native.cpu.bench
    python -m llmlocal.native.cpu.bench --sparsity 0 0.5 --threads 2 --isa avx2

Per shape (Llama-3.2-1B's fused qkv, gate/up, down, o_proj; SmolLM2-135M's) and sparsity:

* ``us`` (median per call) and ``gb_s``: bytes actually read (the kept columns' codes and the
  factors of every group with a kept column) over time, with the calls cycling through copies
  of the weight that together exceed ``--working-set-mb`` (default 512 MB, past the caches),
  as decode streams a model that does not fit in cache; ``pct_of_machine`` compares with
  this machine's read bandwidth (``measure_bandwidth_gb_s``).
* ``hot_us``: the same weight called again and again (cache-resident: the small-shape cost).
* ``torch_us``: torch's ``_weight_int4pack_mm_for_cpu`` (bf16, dense) on the same shape, cycled
  the same way; ``torch_hot_us``.

``decode``: the GEMVs of one token of each model (every layer's four projections, in order,
on distinct weights, the input thresholded per projection), in ms per token.
Inputs are standard normal; the threshold is the |x| quantile of the requested sparsity.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .layout import PackedInt4, pack_int4
from .linear import SparseInt4Linear
from .reference import kept_columns
from .runtime import best_isa, isa, num_threads, set_isa, set_num_threads

# (model, projection, K, N); layer counts for the per-token figure
SHAPES = [
    ("llama-3.2-1b", "qkv", 2048, 3072),
    ("llama-3.2-1b", "gate_up", 2048, 16384),
    ("llama-3.2-1b", "down", 8192, 2048),
    ("llama-3.2-1b", "o_proj", 2048, 2048),
    ("smollm2-135m", "qkv", 576, 960),
    ("smollm2-135m", "gate_up", 576, 3072),
    ("smollm2-135m", "down", 1536, 576),
    ("smollm2-135m", "o_proj", 576, 576),
]
LAYERS = {"llama-3.2-1b": 16, "smollm2-135m": 30}


@dataclass
class Row:
    model: str
    proj: str
    k: int
    n: int
    sparsity: float
    kept: int
    bytes_read: int
    us: float
    us_min: float
    gb_s: float
    pct_of_machine: float
    hot_us: float
    torch_us: float | None = None
    torch_hot_us: float | None = None


def random_packed(rng: np.random.Generator, n: int, k: int) -> PackedInt4:
    """Q4_1-form weights (fp16 d and m): the layout the starter model's tensors take."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d = rng.uniform(0.002, 0.03, (n, k // 32)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0.0, 0.2, (n, k // 32)).astype(np.float16).astype(np.float32)
    return pack_int4(codes, d, m + np.float32(8.0) * d)


def copies_of(packed: PackedInt4, count: int) -> list[SparseInt4Linear]:
    out = [SparseInt4Linear(packed)]
    for _ in range(count - 1):
        p = PackedInt4(packed.codes.copy(), packed.sz.copy(), packed.n, packed.k, packed.group_size)
        out.append(SparseInt4Linear(p))
    return out


def time_calls(calls: list[Callable[[], Any]], repeats: int, min_calls: int = 200) -> list[float]:
    """Seconds per call, one figure per repeat; each repeat makes >= min_calls calls."""
    rounds = max(1, math.ceil(min_calls / len(calls)))
    for c in calls[: min(len(calls), 8)]:
        c()  # warm up: pool threads, page faults
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(rounds):
            for c in calls:
                c()
        out.append((time.perf_counter() - t) / (rounds * len(calls)))
    return out


def torch_int4(packed: PackedInt4, count: int) -> tuple[list[Any], Any]:
    """torch's CPU INT4 weights of the same values (copies), and a bf16 input maker."""
    import torch

    codes = torch.from_numpy(packed.unpack_codes().astype(np.int32))
    d, m = packed.factors()
    # (K / 32, N, 2): scale and the zero of W = (q - 8) * scale + zero
    sz = torch.stack([torch.from_numpy(d).t(), torch.from_numpy(m + 8 * d).t()], dim=-1).contiguous().bfloat16()
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    return [(w.clone(), sz.clone()) for _ in range(count)], torch


def bench_shape(model: str, proj: str, k: int, n: int, sparsities: list[float], args: argparse.Namespace,
                bandwidth: float, rng: np.random.Generator) -> list[Row]:
    packed = random_packed(rng, n, k)
    count = max(1, math.ceil(args.working_set_mb * 1e6 / packed.nbytes))
    lins = copies_of(packed, count)
    x = rng.standard_normal(k).astype(np.float32)
    y = np.empty(n, dtype=np.float32)
    # ours first, after a pause: torch leaves its OpenMP threads spinning for a while after its calls
    time.sleep(0.3)
    rows = []
    for s in sparsities:
        t = None if s == 0 else float(np.quantile(np.abs(x), s))
        keep = kept_columns(x, t)
        nbytes = packed.bytes_read(keep)
        cycled = time_calls([lambda lin=lin, t=t: lin(x, t, out=y) for lin in lins], args.repeat)
        hot = time_calls([lambda t=t: lins[0](x, t, out=y)], args.repeat)
        med = statistics.median(cycled)
        rows.append(Row(model, proj, k, n, s, int(keep.sum()), nbytes, med * 1e6, min(cycled) * 1e6,
                        nbytes / med / 1e9, 100 * nbytes / med / 1e9 / bandwidth, statistics.median(hot) * 1e6,
                        None, None))
    torch_figs: tuple[float | None, float | None] = (None, None)
    if not args.no_torch:
        weights, torch = torch_int4(packed, count)
        xb = torch.from_numpy(x).bfloat16()[None]  # (1, K)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        cycled = time_calls([lambda w=w, s=s: mm(xb, w, 32, s) for w, s in weights], args.repeat)
        hot = time_calls([lambda: mm(xb, weights[0][0], 32, weights[0][1])], args.repeat)
        torch_figs = (statistics.median(cycled) * 1e6, statistics.median(hot) * 1e6)
        del weights
    for r in rows:
        r.torch_us, r.torch_hot_us = torch_figs
    return rows


def bench_decode(model: str, sparsities: list[float], args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    time.sleep(0.3)  # torch's threads stop spinning
    shapes = [(k, n) for m, _, k, n in SHAPES if m == model]
    layers = [[SparseInt4Linear(random_packed(rng, n, k)) for k, n in shapes] for _ in range(LAYERS[model])]
    xs = [rng.standard_normal(k).astype(np.float32) for k, _ in shapes]
    ys = [np.empty(n, dtype=np.float32) for _, n in shapes]
    out: dict[str, Any] = {"layers": len(layers), "weight_mb": round(sum(lin.weight_bytes() for lay in layers for lin in lay) / 1e6, 1)}
    for s in sparsities:
        ts = [None if s == 0 else float(np.quantile(np.abs(x), s)) for x in xs]

        def token(ts: list[float | None] = ts) -> None:
            for lay in layers:
                for lin, x, y, t in zip(lay, xs, ys, ts):
                    lin(x, t, out=y)

        secs = time_calls([token], args.repeat, min_calls=10)
        out[f"ms_per_token_at_{s:g}"] = round(statistics.median(secs) * 1e3, 3)
        out[f"ms_per_token_min_at_{s:g}"] = round(min(secs) * 1e3, 3)
    return out


def measure_bandwidth_gb_s(megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth of main memory: bytes summed per second over a buffer far larger than cache."""
    import torch

    a = torch.ones(megabytes * 1024 * 1024 // 4, dtype=torch.float32)
    a.sum()  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlocal.native.cpu.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--threads", type=int, default=None, help="threads per GEMV (default: the runtime's)")
    p.add_argument("--isa", choices=["scalar", "avx2", "avx512"], default=None)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--working-set-mb", type=float, default=512.0)
    p.add_argument("--model", choices=sorted(LAYERS), nargs="+", default=sorted(LAYERS))
    p.add_argument("--no-torch", action="store_true", help="skip torch's INT4 op")
    args = p.parse_args(argv)

    if args.threads:
        set_num_threads(args.threads)
    if args.isa:
        set_isa(args.isa)
    bandwidth = measure_bandwidth_gb_s()
    time.sleep(0.5)  # let torch's OpenMP threads stop spinning
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    for model, proj, k, n in SHAPES:
        if model in args.model:
            rows += bench_shape(model, proj, k, n, args.sparsity, args, bandwidth, rng)
            print(f"# {model} {proj} {k}->{n} done", file=sys.stderr)
    decode = {m: bench_decode(m, args.sparsity, args, rng) for m in args.model}
    result = {
        "isa": isa(),
        "best_isa": best_isa(),
        "threads": num_threads(),
        "machine_bandwidth_gb_s": round(bandwidth, 2),
        "shapes": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(r).items()} for r in rows],
        "decode": decode,
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
