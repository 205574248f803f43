"""Kernel timings on a GPU for the decode step's parts, at Qwen2.5-1.5B's shapes: paged decode
attention under several launch settings, the INT4 projections and the output head through
torch's ops, cuBLAS in bf16 and our Triton INT8 and INT4 kernels (`native.quant_matmul`), at 1,
4 and 16 rows (a decode step) and 512 (a prompt). One JSON line per
measurement on stdout. Each time is a CUDA graph of 20 calls replayed, divided by 20: the GPU's
own time, without Python's launch cost.

    python packaging/gpu_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from typing import Callable

import torch


def gpu_us(fn: Callable[[], object], calls: int = 20, replays: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return round(statistics.median(times), 2)


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def compiled_info(jit: object) -> list[dict[str, int]]:
    """Registers and spills of each variant triton compiled of `jit` so far."""
    out = []
    try:
        for cache in jit.device_caches.values():  # type: ignore[attr-defined]
            for ck in cache[0].values():
                out.append({"regs": int(ck.n_regs), "spills": int(ck.n_spills)})
    except Exception as e:  # noqa: BLE001  (diagnostics only)
        out.append({"error": repr(e)[:80]})
    return out


def attention(quick: bool) -> None:
    from llmlocal.native.paged_attention import triton_decode as td

    h, kv, d, bs, dtype = 12, 2, 128, 16, torch.bfloat16
    blocks = 2048
    k_cache = torch.randn(blocks, bs, kv, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    # {} is the launcher's own choice; mma False is the float32 dot (8 warps by default)
    configs = [{}, {"mma": False}, {"mma": False, "num_warps": 4}, {"use_dot": False}, {"num_warps": 2},
               {"num_warps": 8}, {"tile_n": 16}, {"tile_n": 32}, {"tile_n": 128}, {"num_splits": 1},
               {"tile_n": 32, "num_warps": 2}, {"mma": False, "tile_n": 16}]
    for batch in (1, 16):
        for ctx in (100, 1000):
            width = 128
            tables = torch.randperm(blocks, device="cuda")[: batch * width].view(batch, width).to(torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, h, d, dtype=dtype, device="cuda")
            for cfg in configs[: 3 if quick else None]:
                try:
                    us = gpu_us(lambda: td.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(d),
                                                                       2048, **cfg))
                    kv_bytes = 2 * batch * ctx * kv * d * 2
                    emit(part="attention", batch=batch, ctx=ctx, cfg=cfg, us=us, gb_s=round(kv_bytes / us / 1e3, 1))
                except Exception as e:  # noqa: BLE001
                    emit(part="attention", batch=batch, ctx=ctx, cfg=cfg, error=repr(e)[:200])
    dec, _ = td.jitted_kernels(False)
    emit(part="attention-compiled", variants=compiled_info(dec))


def linears(quick: bool) -> None:
    from llmlocal.native.quant_matmul import triton_int4 as t4
    from llmlocal.native.quant_matmul import triton_int8 as ti

    shapes = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
              "head": (151936, 1536)}
    dtype = torch.bfloat16
    configs = [(64, 128, 4), (32, 128, 4), (128, 128, 4), (64, 256, 4), (32, 256, 4), (128, 64, 4), (64, 128, 8)]
    if quick:
        shapes = {"head": shapes["head"]}
    for name, (n, k) in shapes.items():
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        g = 32
        scale = (torch.rand(n, k // g, device="cuda") * 0.01).to(dtype)
        zero = (torch.randn(n, k // g, device="cuda") * 0.01).to(dtype)
        int4_bytes = n * k // 2 + 2 * 2 * n * (k // g)
        q8 = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        s8 = (torch.rand(n, device="cuda") * 0.01).to(dtype)
        dense = torch.randn(n, k, device="cuda", dtype=dtype)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        packed = t4.pack_int4(codes)
        tiny = {}
        for tiles in (2, 4, 8):
            u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
            tiny[tiles] = torch.ops.aten._convert_weight_to_int4pack(u8, tiles)
        w64 = (codes.double() - 8) * scale.double().repeat_interleave(g, 1) + zero.double().repeat_interleave(g, 1)
        for m in (1, 4, 16) if quick else (1, 4, 16, 512):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = x.double() @ w64.T
            runs: dict[str, tuple[Callable[[], torch.Tensor], int]] = {
                "bf16 cublas": (lambda: torch.nn.functional.linear(x, dense), n * k * 2),
            }
            if m <= 16:  # (8 ms at 16 rows of the head already)
                runs["int8pack_mm"] = (lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8), n * k)
            for tiles, w in tiny.items():
                runs[f"tinygemm int4 tiles {tiles}"] = ((lambda w=w: torch.ops.aten._weight_int4pack_mm(x, w, g, sz)),
                                                        int4_bytes)
            for bn, bk, warps in configs[: 1 if quick else None]:
                runs[f"triton int8 {bn}x{bk} w{warps}"] = (
                    lambda bn=bn, bk=bk, warps=warps: ti.int8_matmul(x, q8, s8, block_n=bn, block_k=bk, num_warps=warps),
                    n * k)
                for bm in (16,) if m <= 16 else (64, 128):
                    runs[f"triton int4 m{bm} {bn}x{bk} w{warps}"] = (
                        lambda bn=bn, bk=bk, warps=warps, bm=bm: t4.int4_matmul(
                            x, packed, scale, zero, g, block_m=bm, block_n=bn, block_k=bk, num_warps=warps), int4_bytes)
            for label, (fn, nbytes) in runs.items():
                try:
                    us = gpu_us(fn)
                    row = {"part": "linear", "shape": name, "n": n, "k": k, "m": m, "impl": label, "us": us,
                           "gb_s": round(nbytes / us / 1e3, 1)}
                    if "int4" in label:
                        y = fn().double()
                        row["rel_err"] = float((y - ref).abs().max() / ref.abs().max())
                    emit(**row)
                except Exception as e:  # noqa: BLE001
                    emit(part="linear", shape=name, m=m, impl=label, error=repr(e)[:200])
        torch.cuda.empty_cache()
    emit(part="int8-compiled", variants=compiled_info(ti._jitted(False)))
    emit(part="int4-compiled", variants=compiled_info(t4._jitted(False)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer settings")
    p.add_argument("--parts", default="attention,linears")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device", file=sys.stderr)
        sys.exit(2)
    emit(part="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    t = time.perf_counter()
    for part in args.parts.split(","):
        try:
            {"attention": attention, "linears": linears}[part](args.quick)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        emit(part="done", what=part, seconds=round(time.perf_counter() - t, 1))


if __name__ == "__main__":
    main()
