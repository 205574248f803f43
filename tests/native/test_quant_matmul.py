"""The Triton INT8 and INT4 matmuls (the paged engine's INT8 heads and projections on CUDA;
INT4 for the next GPU session) against float64 of the dequantized weights: in Triton's CPU
interpreter here, compiled on a GPU.

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
from llmlocal.native.quant_matmul import int8_matmul
from llmlocal.native.quant_matmul.triton_int4 import int4_matmul, pack_int4
from llmlocal.native.quant_matmul.triton_int8 import plan_split_k

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
    check(int8_matmul(x, codes, scale, block_m=16 if m <= 16 else 32, block_n=32, block_k=64), x, codes, scale)


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


def int4_case(m: int, n: int, k: int, dtype: torch.dtype, group: int = 32, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(dtype)
    zero = (torch.randn(n, k // group, generator=g) * 0.01).to(dtype)
    return x.to(device), codes.to(device), scale.to(device), zero.to(device)


def check_int4(y: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group: int, weight_eps: float) -> None:
    """Against float64 of W = (q - 8) scale + zero: the dequantized weights rounded by at most
    ``weight_eps`` relative to (|q - 8| |scale| + |zero|), then the float32 sums' bound."""
    xd = x.double().cpu()
    s = scale.double().cpu().repeat_interleave(group, 1)
    z = zero.double().cpu().repeat_interleave(group, 1)
    q = codes.double().cpu() - 8
    ref = xd @ (q * s + z).T
    size = xd.abs() @ (q.abs() * s.abs() + z.abs()).T  # sum_k |x| (|q - 8| |s| + |z|)
    k = x.shape[1]
    bound = (weight_eps + (k + 2) * 2.0**-24) * size + EPS[x.dtype] * ref.abs() + 1e-30
    err = (y.double().cpu() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"
    if x.dtype == torch.float32:  # far below one code read wrongly (off by one where |x| is largest)
        misread = xd.abs().max(dim=1).values[:, None] * s.abs().min(dim=1).values[None, :]
        assert float((err / misread).max()) < 0.01


@pytest.mark.parametrize("m,n,k,block_m", [(1, 96, 256, 16), (3, 70, 192, 16), (16, 64, 512, 16), (40, 33, 160, 32),
                                           (70, 48, 96, 64)])
def test_int4_matches_float64(m: int, n: int, k: int, block_m: int) -> None:
    x, codes, scale, zero = int4_case(m, n, k, torch.float32)
    # in the interpreter the dequantized weights stay float32 (2 roundings: the product, the sum)
    y = int4_matmul(x, pack_int4(codes), scale, zero, 32, block_m=block_m, block_n=32, block_k=64)
    check_int4(y, x, codes, scale, zero, 32, weight_eps=2 * 2.0**-24)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_int4_split_k_and_groups_of_64(split_k: int) -> None:
    x, codes, scale, zero = int4_case(2, 40, 384, torch.float32, group=64, seed=5)
    y = int4_matmul(x, pack_int4(codes), scale, zero, 64, block_n=16, block_k=128, split_k=split_k)
    check_int4(y, x, codes, scale, zero, 64, weight_eps=2 * 2.0**-24)


def test_int4_packing_puts_input_2j_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 15, 0]])
    assert pack_int4(codes).tolist() == [[1 | 2 << 4, 15]]


def test_int4_bad_input_is_refused() -> None:
    x, codes, scale, zero = int4_case(1, 8, 64, torch.float32)
    packed = pack_int4(codes)
    with pytest.raises(ValueError, match="do not match"):
        int4_matmul(x[:, :32], packed, scale, zero, 32)
    with pytest.raises(ValueError, match="scales and zeros"):
        int4_matmul(x, packed, scale[:, :1], zero, 32)
    with pytest.raises(ValueError, match="block_k"):
        int4_matmul(x, packed, scale, zero, 32, block_k=48)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_cuda_matches_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    for m, n, k, block_m in [(1, 2048, 1536, 16), (16, 1536, 8960, 16), (300, 1000, 896, 64)]:
        x, codes, scale, zero = int4_case(m, n, k, torch.bfloat16, seed=m, device="cuda")
        y = int4_matmul(x, pack_int4(codes), scale, zero, 32, block_m=block_m)
        check_int4(y, x, codes, scale, zero, 32, weight_eps=2.0**-8)  # weights rounded to bf16 for the dot
