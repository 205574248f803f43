"""Triton kernel for ``y = x @ W.T`` with W stored as 4-bit codes and a scale and a zero per
group of inputs (W[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g], the form of
`engine.model.linear.Int4Linear`), for any number of rows of x: ``block_m`` rows a program
(16 for a decode step, more for a prompt).

Layout (`pack_int4`): codes (N, K / 2) uint8, byte j of a row holding input 2j in its low
nibble and 2j + 1 in its high one, so a chunk's bytes are one contiguous load and
``tl.interleave(low, high)`` puts the inputs back in order; scale and zero (N, K / g) in x's
dtype. A chunk of ``BLOCK_K`` inputs (whole groups) is dequantized in registers - codes to
float32, reshaped to (columns, groups, g) so each group's scale and zero broadcast - and
multiplied on the tensor cores in x's dtype, as torch's tinygemm rounds its dequantized
weights too. Split-K as in `triton_int8`: float32 partial sums added in a fixed order.

NOTE: written for the next GPU session (tested here in Triton's CPU interpreter against
float64); the engine's INT4 layers still use torch's tinygemm on CUDA. A first kernel that
gathered each input's scale and read x at stride 2 measured 86-100 GB/s on an H200
(`packaging/gpu_kernels.py`, 2026-11-28).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_int8 import launch

BLOCK_N = 64
BLOCK_K = 128


def _int4_kernel(
    x_ptr,  # (M, K), contiguous
    q_ptr,  # (N, K // 2) uint8, contiguous
    s_ptr,  # (N, K // GROUP)
    z_ptr,  # (N, K // GROUP)
    out_ptr,  # (M, N) in x's dtype when SPLIT_K == 1, else (SPLIT_K, M, N) float32
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP
    SPLIT_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_K // 2)  # a chunk's bytes
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    m_mask = offs_m < M
    n_mask = offs_n < N
    groups = K // GROUP
    q_rows = q_ptr + offs_n[:, None].to(tl.int64) * (K // 2)  # (BN, 1)
    g_rows = offs_n[:, None].to(tl.int64) * groups  # (BN, 1)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * K  # (BM, 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        b_mask = (k0 + 2 * offs_b) < k_end  # whole groups: a byte's two inputs are in or out together
        codes = tl.load(q_rows + (k0 // 2 + offs_b)[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0)
        q = tl.interleave(codes & 15, codes >> 4).to(tl.float32) - 8.0  # (BN, BK): inputs k0 .. k0 + BK - 1
        g_mask = n_mask[:, None] & ((k0 + offs_g * GROUP) < k_end)[None, :]
        scale = tl.load(s_ptr + g_rows + (k0 // GROUP + offs_g)[None, :], mask=g_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g_rows + (k0 // GROUP + offs_g)[None, :], mask=g_mask, other=0.0).to(tl.float32)
        w = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None] + zero[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # (BN, BK); masked groups are 0
        k = k0 + offs_k
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < k_end)[None, :], other=0.0)  # (BM, BK)
        if F32_DOT:  # float32 x, or the CPU interpreter (whose dot of bf16 operands is wrong)
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + out_offs, acc, mask=out_mask)


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool) -> object:
    """The kernel, wrapped by triton.jit on first use (after TRITON_INTERPRET is read), once per mode."""
    return triton.jit(_int4_kernel)


def pack_int4(codes: Tensor) -> Tensor:
    """(N, K) codes in [0, 15] -> (N, K / 2) uint8, input 2j in byte j's low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def int4_matmul(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, group: int, *, block_m: int = 16,
                block_n: int = BLOCK_N, block_k: int = BLOCK_K, split_k: int | None = None,
                num_warps: int = 4) -> Tensor:
    """(M, K) x against INT4 weights packed by `pack_int4`, with (N, K / group) scales and zeros
    -> (M, N) in x's dtype."""
    if x.dim() != 2 or codes.dim() != 2 or codes.dtype != torch.uint8 or 2 * codes.shape[1] != x.shape[1]:
        raise ValueError(f"int4_matmul: x {tuple(x.shape)} and packed codes {tuple(codes.shape)} do not match")
    k = x.shape[1]
    n = codes.shape[0]
    if k % group or scale.shape != (n, k // group) or zero.shape != scale.shape:
        raise ValueError(f"int4_matmul: {n} rows of {k} inputs in groups of {group} need scales and zeros of shape "
                         f"{(n, k // group)}, got {tuple(scale.shape)} and {tuple(zero.shape)}")
    if block_k % group or block_k % 32 or block_n % 16 or block_m % 16:
        raise ValueError("int4_matmul: block_k must be a multiple of the group and of 32, block_m and block_n of 16")
    return launch("int4_matmul", _jitted, x, (codes.contiguous(), scale.contiguous(), zero.contiguous()), n, block_m,
                  block_n, block_k, split_k, num_warps, GROUP=group)
