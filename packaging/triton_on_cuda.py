"""pytest plugin of the GPU check: the paged-attention kernel tests with the Triton kernels
compiled on the GPU, and every decode launch checked against the float64 reference.

The tests in tests/native build their cases on the CPU and run the Triton kernels in Triton's
interpreter (TRITON_INTERPRET=1, set per test by tests/native/conftest.py). With this plugin
(`pytest -p triton_on_cuda`, packaging/ on PYTHONPATH), on a machine with CUDA:

* the package's Triton launchers (`paged_decode_attention_triton`, `write_kv_triton`; the
  dispatchers call them too) copy their CPU arguments to the GPU with the same strides and
  storage offsets (a strided view stays strided), launch the compiled kernels with
  TRITON_INTERPRET off for the call, copy what the kernel wrote back into the CPU tensors and
  return a CPU result: the tests' own assertions then judge the compiled kernels;
* every decode launch, on any machine, is also compared with attention computed in float64
  from the same cache (`float64_truth`): ||out - ref|| / ||ref|| within the output dtype's
  tolerance, and no NaN (the caches hold NaN wherever nothing may be read). The worst error
  per dtype is printed at the end of the run.

Without CUDA the kernels stay in the interpreter (the dry run), with the float64 check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import llmlocal.native.paged_attention as pa

# ||out - ref|| / ||ref|| allowed per output dtype: fp32 leaves room for tf32 in tl.dot (about
# 3e-4); fp16 and bf16 outputs are rounded once (2^-11, 2^-8 relative per element).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}
_worst: dict[str, float] = {}
_launches = {"decode": 0, "write_kv": 0, "on_gpu": 0}


def _to_device(t: Any) -> Any:
    """A CUDA copy of a CPU tensor with the same size, strides and storage offset."""
    if not isinstance(t, torch.Tensor) or t.is_cuda:
        return t
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    return flat.cuda().as_strided(t.shape, t.stride(), t.storage_offset())


@contextlib.contextmanager
def _compiled() -> Iterator[None]:
    """TRITON_INTERPRET off for one launch (the kernels are wrapped for the mode read then)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def float64_truth(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int = 0,
) -> torch.Tensor:
    """Each sequence's query attending its cached positions (the last ``window`` of them if
    > 0), gathered through its block table and computed in float64 with an explicit softmax:
    independent of the torch reference, which keeps the cache dtype."""
    q64 = q.detach().cpu().double()  # (B, H, D)
    k_cache, v_cache, tables = k_cache.cpu(), v_cache.cpu(), block_tables.cpu().long()
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = q64.shape[1] // n_kv
    out = torch.empty_like(q64)
    for b, n in enumerate(context_lens.cpu().tolist()):
        pos = torch.arange(max(0, n - window) if window > 0 else 0, n)
        blocks = tables[b, pos // block_size]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        probs = torch.softmax(scale * q64[b][:, None, :] @ k.transpose(1, 2), dim=-1)  # (H, 1, L)
        out[b] = (probs @ v)[:, 0]
    return out


def _check_float64(out: torch.Tensor, args: tuple[Any, ...], window: int) -> None:
    if out.numel() == 0:
        return
    ref = float64_truth(*args[:6], window=window)
    got = out.detach().cpu().double()
    assert not got.isnan().any(), "the kernel's output holds NaN: it read a position it must not read"
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    name = str(out.dtype).replace("torch.", "")
    _worst[name] = max(_worst.get(name, 0.0), err)
    limit = TOLERANCE.get(out.dtype, 1e-3)
    assert err <= limit, f"{name} kernel output vs float64 truth: relative error {err:.2e} > {limit:.0e}"


def _decode_launcher(original: Any) -> Any:
    def launch(*args: Any, **kwargs: Any) -> torch.Tensor:
        _launches["decode"] += 1
        if torch.cuda.is_available() and isinstance(args[0], torch.Tensor) and not args[0].is_cuda:
            _launches["on_gpu"] += 1
            with _compiled():
                out = original(*[_to_device(a) for a in args], **kwargs).cpu()
        else:
            out = original(*args, **kwargs)
        # (a launch captured into a CUDA graph has no output yet, and no copy may leave the GPU)
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            _check_float64(out, args, kwargs.get("window", 0))
        return out

    return launch


def _write_kv_launcher(original: Any) -> Any:
    def launch(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
        _launches["write_kv"] += 1
        if not (torch.cuda.is_available() and isinstance(key, torch.Tensor) and not key.is_cuda):
            return original(key, value, k_cache, v_cache, slot_mapping)
        _launches["on_gpu"] += 1
        on_gpu = [_to_device(a) for a in (key, value, k_cache, v_cache, slot_mapping)]
        with _compiled():
            original(*on_gpu)
        k_cache.copy_(on_gpu[2].cpu())  # the kernel writes the caches in place
        v_cache.copy_(on_gpu[3].cpu())

    return launch


def pytest_configure(config: pytest.Config) -> None:
    pa.paged_decode_attention_triton = _decode_launcher(pa.paged_decode_attention_triton)
    pa.write_kv_triton = _write_kv_launcher(pa.write_kv_triton)


def pytest_report_header(config: pytest.Config) -> str:
    where = f"compiled on {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "in the interpreter (no CUDA)"
    return f"triton_on_cuda: Triton kernels {where}; decode launches checked against float64"


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: hand the figures to the controller
        workeroutput["triton_on_cuda"] = {"worst": dict(_worst), "launches": dict(_launches)}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller, as each worker ends: add its launches and errors to ours."""
    figures = getattr(node, "workeroutput", {}).get("triton_on_cuda")
    if figures:
        for name, err in figures["worst"].items():
            _worst[name] = max(_worst.get(name, 0.0), err)
        for name, n in figures["launches"].items():
            _launches[name] += n


def pytest_terminal_summary(terminalreporter: Any) -> None:
    worst = ", ".join(f"{k} {v:.1e}" for k, v in sorted(_worst.items())) or "none"
    terminalreporter.write_line(
        f"triton_on_cuda: {_launches['decode']} decode and {_launches['write_kv']} write_kv launches, "
        f"{_launches['on_gpu']} moved to the GPU; worst relative error vs float64: {worst}"
    )
