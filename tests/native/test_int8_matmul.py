"""The Triton INT8 matmul (the paged engine's INT8 heads and projections on CUDA) against
float64 of the dequantized weights: in Triton's CPU interpreter here, compiled on a GPU.

Each product x[m, k] q[n, k] is exact in float32 (bf16 x times an int8 code), so the kernel
differs from float64 only by its float32 sums, at most (K + 2) * 2^-24 * sum_k |x q| |scale|,
and by the rounding of the output to x's dtype. One code read wrongly moves an output by
|x_k| |scale| * (the code's error): with float32 outputs the tests also require every error
to be far below that.
In the interpreter the dot runs on float32 operands (its bf16 dot is wrong), the same values.
"""

from __future__ import annotations

import pytest
import torch
from llmlocal.native.int8_matmul import int8_matmul
from llmlocal.native.int8_matmul.triton_int8 import plan_split_k

EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def case(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(dtype)
    return x.to(device), codes.to(device), scale.to(device)


def check(y: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    xd, qd, sd = x.double().cpu(), codes.double().cpu(), scale.double().cpu()
    ref = xd @ (qd * sd[:, None]).T
    k = x.shape[1]
    bound = (k + 2) * 2.0**-24 * (xd.abs() @ qd.abs().T) * sd.abs() + EPS[x.dtype] * ref.abs() + 1e-30
    err = (y.double().cpu() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"
    if x.dtype == torch.float32:  # (a bf16 output's own rounding is larger than one misread code)
        # and far below what one code read wrongly (off by one, where |x| is largest) would do
        misread = xd.abs().max(dim=1).values[:, None] * sd.abs()[None, :]
        assert float((err / misread).max()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (3, 70, 200), (16, 64, 512), (17, 130, 96), (40, 33, 160)])
def test_matches_float64(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, codes, scale = case(m, n, k, dtype)
    check(int8_matmul(x, codes, scale, block_n=32, block_k=64), x, codes, scale)


@pytest.mark.parametrize("split_k", [1, 2, 3, 5])
def test_split_k_slices_add_up(split_k: int) -> None:
    # slices of whole chunks, the last one shorter; partial sums added in a fixed order
    x, codes, scale = case(2, 48, 320, torch.float32, seed=3)
    y = int8_matmul(x, codes, scale, block_n=16, block_k=64, split_k=split_k)
    check(y, x, codes, scale)
    assert torch.equal(y, int8_matmul(x, codes, scale, block_n=16, block_k=64, split_k=split_k))


def test_split_plan() -> None:
    # few columns: split the inputs for about two programs per SM, in whole chunks
    split, per = plan_split_k(n=1536, k=8960, m_tiles=1, num_sms=132)
    assert split > 1 and per % 128 == 0 and (split - 1) * per < 8960 <= split * per
    # a head's 2,374 column tiles fill the GPU alone
    assert plan_split_k(n=151936, k=1536, m_tiles=1, num_sms=132) == (1, 1536)


def test_bad_input_is_refused() -> None:
    x, codes, scale = case(1, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        int8_matmul(x[:, :16], codes, scale)
    with pytest.raises(ValueError, match="scales"):
        int8_matmul(x, codes, scale[:4])
    with pytest.raises(ValueError, match="do not match"):
        int8_matmul(x, codes.float(), scale)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_matches_float64(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    for m, n, k in [(1, 151936, 1536), (16, 1536, 8960), (5, 2048, 1536), (70, 1000, 896)]:
        x, codes, scale = case(m, n, k, dtype, seed=m, device="cuda")
        check(int8_matmul(x, codes, scale), x, codes, scale)
