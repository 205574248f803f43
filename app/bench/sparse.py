"""`llmlocal bench sparse`: decode speed of the sparse backend against dense llama.cpp on the
same GGUF, and the bandwidth its kernels reach.

One run, batch 1, greedy, the same prompt for every engine:

    sparse_tok_s         backend `sparse` at the requested (or calibrated) level
    dense_kernel_tok_s   backend `sparse` at level 0: every column, through the same kernels
    paged_tok_s          backend `paged` (dense, our interleaved kernels), same file
    llamacpp_tok_s       backend `llamacpp` (dense), same file, same thread count
    kernel_bandwidth_gb_s  weight bytes the kernels read / seconds spent inside them, at the
                           requested level
    machine_bandwidth_gb_s this machine's read bandwidth (`native.cpu.bench.measure_bandwidth_gb_s`)

A model without calibrated thresholds is calibrated first, through the same pipeline as
`llmlocal quantize MODEL --sparsity S` (thresholds only, tensors copied byte for byte), into
a cache directory; later runs reuse that file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmlocal.engine.engine import Engine
from llmlocal.engine.plan import Plan
from llmlocal.models import resolve

from .scenarios import _median_stats, _run, measure_bandwidth_gb_s

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def bench_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmlocal" / "bench"


def calibrated_model(model: str | None, level: float, threads: int | None = None) -> str:
    """A path to ``model`` with sparsity thresholds: the file itself when it has them, else a
    calibrated copy in the cache (made once)."""
    resolved = resolve(model)
    if resolved.spec.sparsity is not None:
        return str(resolved.path)
    out = bench_cache_dir() / f"{Path(resolved.path).stem}-sparse.gguf"
    if not out.exists():
        from llmlocal.quant.pipeline import QuantizeJob, quantize

        out.parent.mkdir(parents=True, exist_ok=True)
        quantize(QuantizeJob(src=str(resolved.path), out=str(out), evaluate=False, sparsity=level or 0.5, threads=threads))
    return str(out)


def _decode(engine: Engine, max_tokens: int, runs: int) -> Any:
    """Median stats of ``runs`` greedy replies of exactly ``max_tokens`` tokens (past the
    model's end token: a sparse model may end sooner than the dense one, and every engine
    should decode the same count)."""
    messages = [{"role": "user", "content": PROMPT}]
    _run(engine, messages, 8)  # warm up: first-call allocations, the kernels' thread pool
    return _median_stats([_run(engine, messages, max_tokens, ignore_eos=True).stats for _ in range(runs)])


def bench_sparse(
    model: str | None, sparsity: float | None = None, max_tokens: int = 128, runs: int = 3, threads: int | None = None
) -> dict[str, Any]:
    from llmlocal.engine.backends.sparse import SparseBackend
    from llmlocal.engine.model.sparse_linear import SparseInt4Projection

    path = calibrated_model(model, sparsity if sparsity is not None else 0.5, threads)
    plan = Plan(model=path, n_ctx=1024, threads=threads)
    with Engine.load(plan.replace(backend="llamacpp")) as engine:
        llamacpp = _decode(engine, max_tokens, runs)
    with Engine.load(plan.replace(backend="paged", device="cpu")) as engine:
        paged = _decode(engine, max_tokens, runs)
    with Engine.load(plan.replace(backend="sparse", sparsity=sparsity)) as engine:
        backend = engine.backend
        assert isinstance(backend, SparseBackend)
        level = backend.sparsity
        sparse = _decode(engine, max_tokens, runs)
        # the kernels' bandwidth from one more run that times every call (not the one above:
        # the timing costs a little)
        projections = [m for ms in backend.projections().values() for m in ms if isinstance(m, SparseInt4Projection)]
        SparseInt4Projection.timed = True
        try:
            for m in projections:
                m.reset_counts()
            _decode(engine, max_tokens, 1)
            seconds = sum(m.seconds for m in projections)
            read = sum(m.bytes_read for m in projections)
        finally:
            SparseInt4Projection.timed = False
        backend.set_sparsity(0.0)
        dense = _decode(engine, max_tokens, runs)
        kernel_share = backend.sparse_weight_share
    bandwidth = measure_bandwidth_gb_s()
    llamacpp_tok_s = llamacpp.decode_tok_s or 0.0
    return {
        "model": model or "smollm2-135m",
        "gguf": path,
        "sparsity": level,
        "achieved_sparsity": sparse.achieved_sparsity,
        "sparse_tok_s": sparse.decode_tok_s,
        "dense_kernel_tok_s": dense.decode_tok_s,
        "paged_tok_s": paged.decode_tok_s,
        "llamacpp_tok_s": llamacpp_tok_s,
        "speedup_vs_llamacpp": (sparse.decode_tok_s or 0.0) / llamacpp_tok_s if llamacpp_tok_s else None,
        "speedup_vs_paged": (sparse.decode_tok_s or 0.0) / paged.decode_tok_s if paged.decode_tok_s else None,
        "dense_ratio_vs_llamacpp": (dense.decode_tok_s or 0.0) / llamacpp_tok_s if llamacpp_tok_s else None,
        "kernel_bandwidth_gb_s": read / seconds / 1e9 if seconds else None,
        "machine_bandwidth_gb_s": bandwidth,
        "kernel_weight_share": kernel_share,
        "completion_tokens": sparse.completion_tokens,
    }
