"""Triton kernel for ``y = x @ W.T`` with W stored as int8 codes and a scale per output row
(W[n, k] = q[n, k] * scale[n]): the paged engine's INT8 output heads and projections on CUDA.

A decode step reads every weight once and does little arithmetic with it, so its speed is the
speed at which the codes come from memory. Each program owns ``BLOCK_N`` output columns, 16
rows of x and one of ``split_k`` slices of the inputs; it walks its slice ``BLOCK_K`` inputs at
a time, converts the codes to x's dtype in registers (every int8 value is exact in bf16 and
fp16) and multiplies on the tensor cores, x padded to 16 rows (free beside the weights'
bytes). The row scale is applied to the float32 sums at the end. With ``split_k`` > 1 each
slice writes float32 partial sums that are added in a fixed order afterwards, so a result
never depends on timing.

On an H200 (torch 2.11, the 1.5B shape's 151,936 x 1,536 head) this reads 3.9 TB/s at one row,
60 us, where torch's ``_weight_int8pack_mm`` took 1,013 us, and 8,260 us at 16 rows against 63
(`packaging/gpu_kernels.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import triton_device
from ..triton_device import interpreting

ROWS = 16  # rows of x per program: the tensor cores' smallest tile
BLOCK_N = 64
BLOCK_K = 128
MAX_SPLIT_K = 16


def _int8_kernel(
    x_ptr,  # (M, K), contiguous
    q_ptr,  # (N, K) int8, contiguous
    s_ptr,  # (N,)
    out_ptr,  # (M, N) in x's dtype when SPLIT_K == 1, else (SPLIT_K, M, N) float32
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # out[m, n] = scale[n] * sum_k x[m, k] q[n, k]; this program: columns pid_n * BLOCK_N ..,
    # rows pid_m * BLOCK_M .., inputs [pid_k * k_per_split, (pid_k + 1) * k_per_split) & [0, K).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    q_rows = q_ptr + offs_n[:, None].to(tl.int64) * K  # (BN, 1)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * K  # (BM, 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        codes = tl.load(q_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)  # (BN, BK)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # (BM, BK)
        w = codes.to(tl.float32)
        if F32_DOT:  # float32 x, or the CPU interpreter (whose dot of bf16 operands is wrong): the same values
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]  # per slice: the slices' sums add up to the same
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + out_offs, acc, mask=out_mask)


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool) -> object:
    """The kernel, wrapped by triton.jit on first use (after TRITON_INTERPRET is read), once per mode."""
    return triton.jit(_int8_kernel)


def plan_split_k(n: int, k: int, m_tiles: int, num_sms: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                 split_k: int | None = None) -> tuple[int, int]:
    """(split_k, inputs per split): slices of whole chunks; unless ``split_k`` asks for a number,
    enough programs for about two per SM where the columns alone give fewer, at most MAX_SPLIT_K."""
    chunks = -(-k // block_k)
    if split_k is None:
        programs = -(-n // block_n) * m_tiles
        split_k = min(chunks, -(-2 * num_sms // programs), MAX_SPLIT_K)
    per = -(-chunks // max(1, split_k)) * block_k
    return -(-k // per), per


def int8_matmul(x: Tensor, codes: Tensor, scale: Tensor, *, block_m: int = ROWS, block_n: int = BLOCK_N,
                block_k: int = BLOCK_K, split_k: int | None = None, num_warps: int = 4) -> Tensor:
    """(M, K) x against (N, K) int8 codes with (N,) row scales -> (M, N) in x's dtype."""
    if x.dim() != 2 or codes.dim() != 2 or codes.dtype != torch.int8 or codes.shape[1] != x.shape[1]:
        raise ValueError(f"int8_matmul: x {tuple(x.shape)} and int8 codes {tuple(codes.shape)} do not match")
    n = codes.shape[0]
    if scale.shape != (n,):
        raise ValueError(f"int8_matmul: {n} rows of codes need {n} scales, got {tuple(scale.shape)}")
    if block_k % 16 or block_n % 16 or block_m % 16:
        raise ValueError("int8_matmul: block_m, block_n and block_k must be multiples of 16")
    return launch("int8_matmul", _jitted, x, (codes.contiguous(), scale), n, block_m, block_n, block_k, split_k,
                  num_warps)


def launch(name: str, jitted: Callable[[bool], object], x: Tensor, weights: tuple[Tensor, ...], n: int, block_m: int,
           block_n: int, block_k: int, split_k: int | None, num_warps: int, **constexprs: int) -> Tensor:
    """Run a weight-only matmul kernel of this package's signature - (x, *weights, out, M, N, K,
    k_per_split, [constexprs], BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, F32_DOT) - over (column tiles,
    K slices, row tiles), and add the slices' float32 partial sums in a fixed order."""
    interpret = interpreting()
    if not x.is_cuda and not interpret:
        raise ValueError(f"{name} needs CUDA tensors, or TRITON_INTERPRET=1 to run on the CPU")
    x = x.contiguous()
    m, k = x.shape
    m_tiles = -(-m // block_m)
    split, per = plan_split_k(n, k, m_tiles, triton_device.num_sms(x.device), block_n, block_k, split_k)
    out = torch.empty((m, n) if split == 1 else (split, m, n), device=x.device,
                      dtype=x.dtype if split == 1 else torch.float32)
    if m and n:
        jitted(interpret)[(triton.cdiv(n, block_n), split, m_tiles)](
            x, *weights, out, m, n, k, per, **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=split, F32_DOT=interpret or x.dtype == torch.float32, num_warps=num_warps)
    return out if split == 1 else out.sum(0).to(x.dtype)
