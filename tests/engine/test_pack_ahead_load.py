"""Packing ahead (`gguf_parts.start_packing`) agrees with the loader: every projection the
loader builds on the native kernels is taken from what was packed before torch was needed, and
the arrays are the ones the loader packs itself - on the starter (llama: q and k rows as
stored) and on the real Qwen2.5-Coder 0.5B Q4_K_M (q and k rows permuted, q/k/v of two types)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from llmlocal.engine.model.fast_decode import native_int4, native_quant
from llmlocal.engine.model.gguf_parts import start_packing
from llmlocal.engine.model.loader import load_gguf
from llmlocal.engine.model.sparse_linear import QuantProjection
from llmlocal.models import resolve
from llmlocal.native.cpu import runtime

pytestmark = pytest.mark.skipif(not runtime.built(), reason="the native extension is not built")

Q05 = Path(os.environ.get("LLMLOCAL_DEV_MODELS", Path.home() / ".cache" / "llmlocal-dev")) / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
CPU = torch.device("cpu")


def load(spec, ahead=None):
    return load_gguf(spec, CPU, torch.float32, "auto", max_position=256, int4=native_int4(CPU, torch.float32),
                     quant=native_quant(CPU, torch.float32, spec, ahead=ahead))


def packed(net) -> list:
    return [p for m in net.modules() if isinstance(m, QuantProjection) for p in m.kernel.packed]


def check(model: str) -> None:
    spec = resolve(model).spec
    ahead = start_packing(spec)
    assert ahead is not None
    try:
        jobs = ahead.untaken()
        fast = load(spec, ahead)
        assert ahead.untaken() == 0, "the loader built a projection the packing ahead did not foresee"
    finally:
        ahead.close()
    own = load(spec)
    mine, theirs = packed(fast), packed(own)
    assert len(mine) == len(theirs) == jobs
    for a, b in zip(mine, theirs, strict=True):
        for x, y in ((a.codes, b.codes), (a.d, b.d), (a.m, b.m), (a.sc, b.sc), (a.mn, b.mn)):
            assert (x is None and y is None) or np.array_equal(x, y)


def test_the_starter_with_int8_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", "int8")  # (the default; fp32 takes the INT4 kernels)
    check(resolve().path)


def test_nothing_is_packed_ahead_for_the_int4_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # the starter's 4-bit layers with fp32 activations (its default on AVX-512): the INT4 layout
    monkeypatch.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", "fp32")
    assert start_packing(resolve().spec) is None


@pytest.mark.skipif(not Q05.is_file(), reason="run ../shared/models/fetch-real-models.sh")
def test_a_real_q4_k_m_file() -> None:
    check(str(Q05))


def test_a_second_load_maps_the_weights_the_first_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a packed-weights directory the first load writes what it packed (behind the load)
    and the next one maps it: the projections are the file's read-only pages, the same arrays,
    and greedy tokens are the same as without the directory. A truncated file is not used."""
    from llmlocal.engine import Engine, Plan, Request, SamplingParams
    from llmlocal.native.cpu.packed_cache import wait_for_writers

    monkeypatch.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", "int8")  # the starter's layers are packed then

    def run(directory: Path | None) -> tuple[list[int], list]:
        plan = Plan(backend="paged", device="cpu", n_ctx=512, packed_cache_dir=str(directory) if directory else None)
        with Engine.load(plan) as e:
            req = Request(prompt="def fibonacci(n):", sampling=SamplingParams(max_tokens=16, temperature=0))
            tokens = [t for ev in e.generate(req) for t in getattr(ev, "token_ids", ())]
            arrays = packed(e.backend.runner.model)  # type: ignore[attr-defined]
        wait_for_writers()
        return tokens, arrays

    without, own = run(None)
    cold, packed_cold = run(tmp_path)
    [file] = list(tmp_path.iterdir())
    warm, mapped = run(tmp_path)
    assert without == cold == warm and len(without) == 16
    assert all(a.codes.flags.writeable for a in packed_cold) and not any(a.codes.flags.writeable for a in mapped)
    for a, b in zip(own, mapped, strict=True):
        for x, y in ((a.codes, b.codes), (a.d, b.d), (a.m, b.m), (a.sc, b.sc), (a.mn, b.mn)):
            assert (x is None and y is None) or np.array_equal(x, y)
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 4096)
    again, repacked = run(tmp_path)
    assert again == without and all(a.codes.flags.writeable for a in repacked)
    assert file.stat().st_size % 4096 == 0 and run(tmp_path)[0] == without  # written whole again, and used
