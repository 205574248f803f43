"""The per-row INT8 GEMV (output heads): every ISA path this machine has against the numpy
reference, with 1 and 2 threads, and in the engine against torch's INT8 head; and the fp16
conversion of DecodeStack's KV write against numpy's.

The kernels quantize x per block of 32 (as llama.cpp's Q8_0 matmul does) and sum products
exactly in int32 in runs of 4 to 32, so they differ from `int8_gemv_reference` only by the fp32
sum of those partial sums (at most K / 4 of them, each scaled by its block's dx): at most
(K / 4 + 4) * eps * sum_j |w_j qx_j| dx_j per output. One weight read wrongly moves an output
by about that sum / K, far above the bound.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from llmlocal.engine.model.linear import Int8Linear
from llmlocal.engine.model.sparse_linear import NativeInt8Linear
from llmlocal.native import cpu as si4
from llmlocal.native.cpu import Int8RowsLinear
from llmlocal.native.cpu.reference import INT8_BLOCK, int8_gemv_reference, quantize_activations

FP32_EPS = float(np.finfo(np.float32).eps)
# (N, K): K a multiple of 64, of 32 only, of neither; N not a multiple of 4 or of the 256-row piece
SHAPES = [(1, 64), (7, 33), (37, 70), (258, 96), (1030, 576)]


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = si4.num_threads()
    k = si4.kernels()
    min_part = k.min_part_bytes()
    si4.set_num_threads(request.param)
    k.set_min_part_bytes(0)  # split even the smallest matrix between the threads
    yield request.param
    k.set_min_part_bytes(min_part)
    si4.set_num_threads(before)


def weights(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(-127, 128, (n, k), dtype=np.int8), (rng.random(n, dtype=np.float32) + 0.5) / 100


def bound(w: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(B, N) bound on |kernel - reference| (see the module's docstring)."""
    qx, dx = quantize_activations(x)
    mag = np.zeros((x.shape[0], w.shape[0]))
    for blk in range(dx.shape[1]):
        j = slice(blk * INT8_BLOCK, (blk + 1) * INT8_BLOCK)
        mag += np.abs(qx[:, j].astype(np.float64)) @ np.abs(w[:, j].T.astype(np.float64)) * dx[:, blk : blk + 1]
    return (-(-x.shape[1] // 4) + 4) * FP32_EPS * mag * np.abs(scale.astype(np.float64))


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("batch", [1, 3, 11])  # 11: two passes over the weight (8 rows a pass)
def test_gemv_matches_reference(isa: str, threads: int, n: int, k: int, batch: int) -> None:
    rng = np.random.default_rng(n * k + batch)
    w, scale = weights(rng, n, k)
    x = rng.standard_normal((batch, k), dtype=np.float32)
    x[:, : min(k, 5)] = 0.0  # a block with zeros, and (k < 6) an all-zero block
    lin = Int8RowsLinear(w, scale)
    y = lin(torch.from_numpy(x)).numpy()
    ref = int8_gemv_reference(w, scale, x)
    assert np.all(np.abs(y - ref) <= bound(w, scale, x) + 1e-30)


def test_activation_quantization_is_per_block_of_32() -> None:
    x = np.concatenate([np.full(32, 0.01, np.float32), np.linspace(-100, 100, 32, dtype=np.float32)])[None]
    qx, dx = quantize_activations(x)
    np.testing.assert_array_equal(qx[0, :32], 127)  # the small block keeps its own scale
    assert dx[0, 0] == np.float32(0.01) / np.float32(127)
    assert qx[0, 32] == -127 and qx[0, 63] == 127
    # halves round away from zero, as C's roundf (llama.cpp's Q8_0 quantization)
    q, _ = quantize_activations(np.array([[127.0, 0.5, -0.5, 1.5, -2.5]], np.float32))
    assert q[0].tolist() == [127, 1, -1, 2, -3]


def test_bad_weights_are_refused() -> None:
    w = np.zeros((4, 64), np.int8)
    w[2, 7] = -128
    with pytest.raises(ValueError, match=r"-128.*\[-127, 127\]"):
        Int8RowsLinear(w, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="int8"):
        Int8RowsLinear(np.zeros((4, 64), np.int16), np.ones(4, np.float32))
    with pytest.raises(TypeError, match="float32"):
        Int8RowsLinear(np.zeros((4, 64), np.int8), np.ones(4, np.float64))
    with pytest.raises(ValueError, match=r"\(B, 64\)"):
        Int8RowsLinear(np.zeros((4, 64), np.int8), np.ones(4, np.float32))(torch.zeros(2, 32))


def test_native_head_matches_torch_int8_head() -> None:
    """The engine's head through the kernel against torch's INT8 matmul on the same weight."""
    rng = np.random.default_rng(3)
    weight = torch.from_numpy(rng.standard_normal((3000, 576), dtype=np.float32))
    torch_head = Int8Linear(weight)
    native = NativeInt8Linear.of(torch_head)
    assert native.qweight.data_ptr() == torch_head.qweight.data_ptr()  # shared, not copied
    h = torch.from_numpy(rng.standard_normal((5, 576), dtype=np.float32))
    exact = (h.double() @ (torch_head.qweight.double() * torch_head.scale.double()[:, None]).T)
    for head in (torch_head, native):
        err = (head(h).double() - exact).abs().max() / exact.abs().max()
        assert err < 0.02  # bf16 activations (torch) or per-32 int8 activations (native)
    np.testing.assert_allclose(native(h).numpy(), int8_gemv_reference(torch_head.qweight.numpy(),
                               torch_head.scale.numpy(), h.numpy()), rtol=1e-5, atol=1e-5)


def test_fp16_conversion_of_the_kv_write_matches_numpy(isa: str) -> None:
    """The fp16 KV write of DecodeStack rounds like torch and numpy (to nearest even, overflow
    to inf) on every ISA path, over a sweep of float bit patterns and the edge cases."""
    bits = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32)
    edges = [65504, 65519.99, 65520, 65535, 65536, -65520, 6.1035e-5, 6.0e-5, 2**-24, 2**-25, 3 * 2**-25,
             2**-25 * 1.0001, 1e-30, np.inf, -np.inf, 0.0, -0.0, 1.0, -2.5]
    x = np.concatenate([bits.view(np.float32), np.array(edges, np.float32)])
    x = x[~np.isnan(x)]
    out = np.zeros(len(x), np.uint16)
    si4.kernels().to_f16(x, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out, want)
    nan = np.zeros(1, np.uint16)
    si4.kernels().to_f16(np.array([np.nan], np.float32), nan)
    assert np.isnan(nan.view(np.float16)[0])
