"""The GGUF-type kernels' cost curve: what a call of 1, 2, 4, ... 64 rows of x costs against 1.

    python -m llmlocal.native.cpu.bench_kernels                 # every type, this CPU's kernel
    python -m llmlocal.native.cpu.bench_kernels --kernel avx2   # the plain AVX2 kernel
    python -m llmlocal.native.cpu.bench_kernels --types Q4_K,Q6_K --threads 2 --json
    python -m llmlocal.native.cpu.bench_kernels --types INT4 --kernel avx2   # llmlocal's own 4-bit rows
    llmlocal bench kernels --json                                       # the same, from the CLI

Speculative verification, batched decoding and prefill compute several rows of x per weight
read: they pay where a call of R rows costs far less than R calls of one. Per type, one
transformer layer of Qwen2.5-1.5B's shapes (q/k/v fused 1536 -> 2048, o 1536 -> 1536,
gate/up fused 1536 -> 17920, down 8960 -> 1536), in the interleaved layout the dense engine
uses, on the kernel the engine would run (or the one named): the time of a call of R rows
(median over calls cycling through copies of the layer that together pass ``--working-set-mb``,
so weights stream from memory as in decode), its cost relative to one row, and the throughput
in G weight-rows/s (weights times rows per second).

``peak``: the same kernel's inner instruction sequence alone (`mac_peak`: independent int8
multiply-adds, vpmaddubsw + vpaddw on AVX2, vpdpbusd with VNNI), in G multiply-adds/s on one
thread: what a call of many rows could reach if unpacking, scaling and memory cost nothing.
``pass_peak`` (the avx2 and avx512vnni kernels): its multi-row passes alone, the multiply-adds
(AVX2: of four rows of x over 16 rows of W; 512-bit: of every row of x over 32) and each group's
float update, from L1: the ceiling of that path's structure (the update per group of 32 inputs
is what the activations' per-32 scales cost: on a Zen 5 thread 77% of the vpdpbusd peak).
Weights are random codes with sane scales: the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from .linear import QuantLinear, SparseInt4Linear
from .qlayout import FORMATS, QuantRows
from .runtime import kernels

ROWS = (1, 2, 4, 8, 16, 64)
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0")
# llmlocal's own 4-bit rows (the starter's format, and every file of 4-bit types only), through
# the INT4 kernel with float32 activations (`SparseInt4Linear`); 64 rows are 8 calls of 8
INT4 = "INT4"
ALL_TYPES = TYPES + (INT4,)
# (name, K in, N out): one layer of Qwen2.5-1.5B (its q/k/v and gate/up fused as the engine runs them)
LAYER_1_5B = (("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536))
KERNELS = ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512vnni-amx")
_HALF_ONE = np.float16(1.0 / 64).view(np.uint16)  # a small positive fp16 scale for every block


def random_rows(qtype: int, n: int, k: int, rng: np.random.Generator) -> QuantRows:
    """(n, k) weights of ``qtype`` as the file stores them: random code bytes, sane fp16 scales
    (d, and dmin / m where the type has them) so that no float is NaN or infinite."""
    f = FORMATS[qtype]
    blocks = k // f.block_values
    raw = rng.integers(0, 256, size=(n, blocks, f.block_bytes), dtype=np.uint8)
    half = np.frombuffer(np.array([_HALF_ONE], dtype=np.uint16).tobytes(), dtype=np.uint8)
    if f.name == "Q6_K":  # ql, qh, int8 scales, d last
        raw[:, :, -2:] = half
    elif f.name in ("Q4_K", "Q5_K", "Q4_1", "Q5_1"):  # d then dmin / m first
        raw[:, :, 0:2] = half
        raw[:, :, 2:4] = half
    else:  # d first
        raw[:, :, 0:2] = half
    return QuantRows(qtype, np.ascontiguousarray(raw.reshape(n, blocks * f.block_bytes)))


def _type_id(name: str) -> int:
    for qtype, f in FORMATS.items():
        if f.name == name:
            return qtype
    raise ValueError(f"unknown type {name}: choose from {', '.join(TYPES)}")


def use_kernel(name: str | None) -> str:
    """Run the named kernel variant (None: the engine's choice); returns the one that runs."""
    K = kernels()
    if name is None:
        return K.qmat_kernel()
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name}: choose from {', '.join(KERNELS)}")
    isa = "scalar" if name == "scalar" else "avx2" if name in ("avx2", "avxvnni") else "avx512"
    K.set_isa(isa)  # ValueError above what this CPU has
    K.set_qmat_vnni(name != "avx2")
    K.set_qmat_amx(name == "avx512vnni-amx")
    got = K.qmat_kernel()
    if got != name:
        raise ValueError(f"the {name} kernel does not run on this CPU (it runs {got})")
    return got


def layer(type_name: str, rng: np.random.Generator) -> list[QuantLinear] | list[SparseInt4Linear]:
    if type_name == INT4:
        return [SparseInt4Linear.from_codes(rng.integers(0, 16, (n, k), dtype=np.uint8),
                                            rng.uniform(0.005, 0.02, (n, k // 32)).astype(np.float32),
                                            rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32))
                for _, k, n in LAYER_1_5B]
    return [QuantLinear([random_rows(_type_id(type_name), n, k, rng)], interleaved=True) for _, k, n in LAYER_1_5B]


def time_rows(layers: list[list[QuantLinear]] | list[list[SparseInt4Linear]], rows: int, repeats: int, rng: np.random.Generator,
              stat: str = "median") -> float:
    """Seconds of one layer's four calls with ``rows`` rows of x, cycling through ``layers``: the
    median over ``repeats`` passes, or with ``stat="min"`` the fastest (A/B runs on a shared host)."""
    xs = {lin.in_features: rng.standard_normal((rows, lin.in_features), dtype=np.float32) for lin in layers[0]}
    outs = [np.empty((rows, lin.out_features), dtype=np.float32) for lin in layers[0]]
    for lin, out in zip(layers[0], outs):  # first calls: page faults, pools
        lin(xs[lin.in_features], out=out)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for lay in layers:
            for lin, out in zip(lay, outs):
                lin(xs[lin.in_features], out=out)
        times.append((time.perf_counter() - t0) / len(layers))
    return min(times) if stat == "min" else statistics.median(times)


def bench_kernels(types: list[str], rows: tuple[int, ...] = ROWS, kernel: str | None = None, threads: int = 1,
                  working_set_mb: int = 512, repeats: int = 5, seed: int = 0, stat: str = "median") -> dict[str, Any]:
    K = kernels()
    K.set_num_threads(threads)
    name = use_kernel(kernel)
    rng = np.random.default_rng(seed)
    weights = sum(n * k for _, k, n in LAYER_1_5B)
    out: dict[str, Any] = {"kernel": name, "isa": K.isa(), "threads": threads, "rows": list(rows),
                           "shapes": "one Qwen2.5-1.5B layer: " + ", ".join(f"{p} {k}->{n}" for p, k, n in LAYER_1_5B),
                           "kernels": {}}
    for type_name in types:
        first = layer(type_name, rng)
        per_layer = sum(lin.weight_bytes() for lin in first)
        copies = [first] + [layer(type_name, rng) for _ in range(max(0, working_set_mb * 2**20 // per_layer - 1))]
        secs = [time_rows(copies, r, repeats, rng, stat) for r in rows]
        out["kernels"][type_name] = {
            "rows": list(rows),
            "ms": [round(s * 1e3, 4) for s in secs],
            "cost_vs_one_row": [round(s / secs[0], 3) for s in secs],
            "g_weight_rows_s": [float(f"{weights * r / s / 1e9:.4g}") for r, s in zip(rows, secs)],
            "one_row_gb_s": round(per_layer / secs[0] / 1e9, 2),
        }
        del copies, first
    if name != "scalar":  # (the portable kernel has no one instruction sequence)
        out["peak_g_mac_s"] = round(peak(name), 1)
    if name in ("avx2", "avx512vnni"):
        out["pass_peak_g_mac_s"] = round(peak(name, passes=True), 1)
    return out


def peak(kernel: str, passes: bool = False) -> float:
    """G int8 multiply-adds a second on one thread by the kernel's instruction sequence alone,
    or (``passes``, the avx2 and avx512vnni kernels) by its multi-row passes alone: their multiply-adds and each
    group's float update, from L1, with none of the call's other work (the ceiling of that path)."""
    K = kernels()
    iters = 1 << 14 if passes else 1 << 22  # about 0.5 G multiply-adds either way
    K.mac_peak(kernel, iters >> 6, passes)  # warm up the core's clock
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        macs = K.mac_peak(kernel, iters, passes)
        best = max(best, macs / (time.perf_counter() - t0) / 1e9)
    return best


def format_table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"kernel {result['kernel']}, {result['threads']} thread(s); {result['shapes']}",
             "type    " + "".join(f"{r:>8}" for r in rows) + "   (cost vs 1 row; G weight-rows/s below)"]
    for name, k in result["kernels"].items():
        lines.append(f"{name:<8}" + "".join(f"{c:>8.2f}" for c in k["cost_vs_one_row"]))
        lines.append(f"{'':<8}" + "".join(f"{g:>8.1f}" for g in k["g_weight_rows_s"]) + f"   (1 row: {k['one_row_gb_s']} GB/s)")
    if "peak_g_mac_s" in result:
        lines.append(f"the kernel's multiply-add sequence alone: {result['peak_g_mac_s']} G MAC/s a thread")
    if "pass_peak_g_mac_s" in result:
        lines.append(f"its multi-row passes alone (multiply-adds and float updates): {result['pass_peak_g_mac_s']} G MAC/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlocal.native.cpu.bench_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(ALL_TYPES), help=f"comma-separated (default: {','.join(ALL_TYPES)})")
    p.add_argument("--kernel", default=None, choices=KERNELS, help="the kernel variant (default: the engine's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--working-set-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = bench_kernels([t.strip() for t in args.types.split(",") if t.strip()], kernel=args.kernel,
                           threads=args.threads, working_set_mb=args.working_set_mb, repeats=args.repeats)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
