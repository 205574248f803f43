"""A prompt chunk's attention: the native kernel this CPU runs (`kernels().attn_tiles`: AMX-BF16
tiles, AVX512-BF16 or float32 on AVX2) against torch's float32 attention, taking turns.

    python -m llmlocal.native.cpu.bench_prompt_attention --start 512               # this CPU's kernel
    python -m llmlocal.native.cpu.bench_prompt_attention --start 3000 --isa avx2   # held to AVX2

One layer shaped like Qwen2.5-1.5B's (12 query heads, 2 KV heads of 128): a chunk of `--tokens`
query rows at positions `--start` ..., over `--start + --tokens` keys, on random data; torch gets
the engine's causal mask and grouped heads (`scaled_dot_product_attention(..., enable_gqa)`)
on the same arrays. Prints each path's best of `--rounds` timings (each the mean of several
calls) in ms and in G multiply-adds a second, counting only the causal ones (what a row may
see), and the ratio (above 1: the native kernel is faster). A benchmark: it prints.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable


def _timed(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):  # (the other path's threads may still spin for a while)
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlocal.native.cpu.bench_prompt_attention",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, default=512, help="positions already in the cache")
    ap.add_argument("--tokens", type=int, default=512, help="the chunk's query rows")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--isa", default=None, help="hold the kernels to this path (scalar, avx2, avx512)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import torch.nn.functional as F

    from . import runtime

    if args.isa:
        runtime.set_isa(args.isa)
    kernel = runtime.kernels().attn_kernel()
    if not kernel:
        print("This CPU runs no native prompt attention (the scalar path, or AMX-BF16 tiles switched off).")
        return 2
    h, hkv, d, t, start = 12, 2, 128, args.tokens, args.start
    n = start + t
    rng = np.random.default_rng(0)
    q = rng.standard_normal((t, h, d), dtype=np.float32)
    k = rng.standard_normal((n, hkv, d), dtype=np.float32)
    v = rng.standard_normal((n, hkv, d), dtype=np.float32)
    out = np.empty_like(q)
    qt, kt, vt = (torch.from_numpy(a).transpose(0, 1)[None] for a in (q, k, v))
    mask = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]

    def native() -> None:
        runtime.kernels().attn_tiles(q, k, v, out, t, h, n, hkv, d, start, 0, 1 / math.sqrt(d))

    def torch_sdpa() -> None:
        F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=1 / math.sqrt(d), enable_gqa=True)

    best = {"native": math.inf, "torch": math.inf}
    calls = max(2, int(2e9 / (h * d * 2 * t * n)))  # about two seconds of calls a round and path
    for _ in range(args.rounds):
        best["native"] = min(best["native"], _timed(native, calls))
        best["torch"] = min(best["torch"], _timed(torch_sdpa, calls))
    macs = h * d * 2 * (t * start + t * (t + 1) / 2)
    print(f"prompt attention, {t} rows after {start} positions, 12 x 2 heads of 128, isa {runtime.isa()}, "
          f"{runtime.num_threads()} thread(s)")
    for name, label in (("native", f"native ({kernel})"), ("torch", "torch float32")):
        print(f"  {label:>16}: {best[name] * 1e3:8.2f} ms  {macs / best[name] / 1e9:7.1f} G MAC/s")
    print(f"  native vs torch: {best['torch'] / best['native']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
