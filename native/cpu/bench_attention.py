"""Decode attention of the native step (`DecodeStack`), alone or two builds taking turns.

    python -m llmlocal.native.cpu.bench_attention --context 3000              # this build
    python -m llmlocal.native.cpu.bench_attention --base HEAD~1 --rounds 4    # A/B against a build
    python -m llmlocal.native.cpu.bench_attention --layout in-order --isa avx2

A stack shaped like Qwen2.5-1.5B's attention (12 query heads, 2 KV heads of 128, 28 layers,
each with its own fp16 cache, so the rows come from memory as in a real step) with tiny FFNs
decodes one sequence at `--context` positions and at 16; the difference is the attention's
time a step. The positions' cache blocks (16 slots) are scattered over the cache, as a
long-running engine's free list leaves them, or `--layout in-order`. Each figure is the fastest
of the process's timed passes; with `--base`, each round runs both builds in fresh processes in
alternating order (ab_kernels' method) and the ratio is base / new (above 1: new is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from .ab_kernels import LOAD_BUILD, current_build, resolve

HEADS, KV_HEADS, HEAD_DIM, LAYERS, D, FFN = 12, 2, 128, 28, 1536, 32

_CHILD = LOAD_BUILD + """
import json
from {package}.bench_attention import step_ms
args = json.loads(sys.argv[2])
print(json.dumps({{n: step_ms(n, args["scattered"], args["isa"]) for n in (16, args["context"])}}))
"""


def step_ms(context: int, scattered: bool, isa: str | None, seconds: float = 2.0) -> float:
    """Milliseconds of the fastest of the decode steps run over `seconds`, at `context` positions."""
    import time

    import numpy as np

    from . import SparseInt4Linear, kernels

    if isa:
        kernels().set_isa(isa)
    rng = np.random.default_rng(0)

    def projection(n: int, k: int) -> SparseInt4Linear:
        codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
        scale = rng.uniform(0.01, 0.04, (n, k // 32)).astype(np.float32)
        return SparseInt4Linear.from_codes(codes, scale, np.zeros_like(scale), group_size=32)

    slots_n = (context // 16 + 2) * 16
    keep, layers = [], []
    for _ in range(LAYERS):
        mats = [projection((HEADS + 2 * KV_HEADS) * HEAD_DIM, D), projection(D, HEADS * HEAD_DIM),
                projection(2 * FFN, D), projection(D, FFN)]
        norm = np.ones(D, np.float32)
        kc = (0.3 * rng.standard_normal((slots_n, KV_HEADS, HEAD_DIM))).astype(np.float16)
        vc = rng.standard_normal((slots_n, KV_HEADS, HEAD_DIM)).astype(np.float16)
        keep.append((mats, norm, kc, vc))
        layers.append((norm.ctypes.data, *(m._matrix for m in mats), norm.ctypes.data, kc.ctypes.data, vc.ctypes.data))
    stack = kernels().DecodeStack((D, HEADS, KV_HEADS, HEAD_DIM, FFN, 1e-6, HEAD_DIM**-0.5, True), layers)
    blocks = rng.permutation(slots_n // 16) if scattered else np.arange(slots_n // 16)
    slots = (blocks[:, None] * 16 + np.arange(16)).reshape(1, -1)[:, : context + 1].astype(np.int64)
    lens = np.array([context], np.int64)
    new = slots[:, context - 1].copy()
    rope = np.zeros((1, HEAD_DIM), np.float32)
    rope[:, 0::2] = 1.0
    thresholds, kept = np.zeros(4 * LAYERS, np.float32), np.zeros(4 * LAYERS, np.int64)
    h0 = rng.standard_normal((1, D)).astype(np.float32)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        h = h0.copy()
        t = time.perf_counter()
        stack.step(h.ctypes.data, rope.ctypes.data, 0, slots.ctypes.data, slots.shape[1], lens.ctypes.data,
                   new.ctypes.data, 1, thresholds.ctypes.data, kept.ctypes.data)
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def run_build(path: str, args: dict) -> float:
    """The attention's milliseconds a step (the context's step less the 16-position one) in a
    fresh process of the build at `path`."""
    done = subprocess.run([sys.executable, "-c", _CHILD.format(package=__package__), path, json.dumps(args)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the build at {path} failed:\n{done.stderr[-2000:]}")
    ms = json.loads(done.stdout)
    return ms[str(args["context"])] - ms["16"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=3000, help="positions of the sequence's context (default 3000)")
    p.add_argument("--layout", choices=("scattered", "in-order"), default="scattered",
                   help="the context's cache blocks scattered over the cache (default) or in order")
    p.add_argument("--isa", choices=("avx512", "avx2", "scalar"), help="the kernels' variant (default: the best here)")
    p.add_argument("--base", help="a commit or a built _kernels*.so to compare this build (or --new) against")
    p.add_argument("--new", help="the build under test (default: this checkout's)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    args = {"context": a.context, "scattered": a.layout == "scattered", "isa": a.isa}
    new = resolve(a.new) if a.new else current_build()
    if not a.base:
        print(f"attention at {a.context} positions ({a.layout}): {run_build(new, args):.2f} ms a step")
        return
    base = resolve(a.base)
    got: dict[str, list[float]] = {"base": [], "new": []}
    for r in range(a.rounds):
        for name, path in (("base", base), ("new", new)) if r % 2 == 0 else (("new", new), ("base", base)):
            got[name].append(run_build(path, args))
    ratios = [b / n for b, n in zip(got["base"], got["new"])]
    print(f"attention at {a.context} positions ({a.layout}), {a.rounds} rounds, builds taking turns: "
          f"{statistics.median(got['base']):.2f} -> {statistics.median(got['new']):.2f} ms a step, "
          f"base / new {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
