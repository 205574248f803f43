"""The q8_0 KV cache layout: int8 values with an fp16 scale per 32 of them, in place.

A q8_0 cache is one int8 tensor per layer and K/V, ``(num_blocks, block_size, n_kv_heads,
head_dim + head_dim / 16)``: each (token, kv head) row holds its ``head_dim`` int8 values ``q``
and then the fp16 scales ``d`` of its ``head_dim / 32`` groups of 32 values (two bytes each,
little-endian), as llama.cpp's q8_0 blocks hold them. A group x is stored as

    d = fp16(max_e |x_e| / 127),   q_e = round_half_even(x_e / float(d)) clamped to [-127, 127]

(q = 0 where d = 0) and read back as x_e ~ q_e * float(d): at most half a step, |x|max / 254,
off per value. 1 + 1/16 bytes a value against f16's 2: the same pool holds 1.88x the tokens.
(A scale per whole head row, 1.94x, doubled the log-prob error on Qwen2.5, whose keys have a
few channels far larger than the rest: a group of 32 confines such a channel's scale to its
group.) The head dimension must be a multiple of 32.

Keeping the scales inside the rows keeps a block one contiguous run of bytes: the pool's
block copies, the prefix cache's disk tier and the scratch caches move it as they move f16
blocks. Every writer (torch here, the Triton write kernel, the native decode step) quantizes
with the formula above, and every reader dequantizes a row as q * d.
"""

from __future__ import annotations

import torch
from torch import Tensor

Q8_DTYPE = torch.int8
GROUP = 32  # values per scale


def scale_bytes(head_dim: int) -> int:
    """Bytes of a head row's fp16 scales, after its values."""
    return 2 * (head_dim // GROUP)


def is_q8(cache: Tensor) -> bool:
    """Whether ``cache`` is a q8_0 cache (int8, scales in its rows)."""
    return cache.dtype == Q8_DTYPE


def head_dim_of(cache: Tensor) -> int:
    """The head dimension of a cache (num_blocks, block_size, n_kv_heads, last)."""
    return cache.shape[-1] * GROUP // (GROUP + 2) if is_q8(cache) else cache.shape[-1]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache of ``dtype`` for ``head_dim``."""
    if dtype != Q8_DTYPE:
        return head_dim
    if head_dim % GROUP:
        raise ValueError(f"a q8_0 KV cache needs a head dimension that is a multiple of {GROUP}, not {head_dim}")
    return head_dim + scale_bytes(head_dim)


def quantize_q8(x: Tensor) -> Tensor:
    """(..., D) float -> (..., D + D / 16) int8: the q8_0 rows of x (see the module docstring)."""
    x32 = x.float()
    groups = x32.unflatten(-1, (-1, GROUP))  # (..., D / 32, 32)
    d = (groups.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)  # (..., D / 32, 1)
    df = d.float()
    q = torch.round(groups / torch.where(df > 0, df, 1.0)).clamp_(-127, 127)
    q = torch.where(df > 0, q, 0.0).to(torch.int8).flatten(-2)  # (..., D)
    return torch.cat([q, d.flatten(-2).view(torch.int8)], dim=-1)  # (..., D + 2 D / 32)


def dequantize_q8(rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(..., D + D / 16) int8 q8_0 rows -> (..., D) values q * d in ``dtype``."""
    hd = rows.shape[-1] * GROUP // (GROUP + 2)
    q = rows[..., :hd].unflatten(-1, (-1, GROUP))  # (..., D / 32, 32)
    d = rows[..., hd:].contiguous().view(torch.float16).unsqueeze(-1)  # (..., D / 32, 1)
    return (q.float() * d.float()).flatten(-2).to(dtype)


def to_cache(x: Tensor, cache: Tensor) -> Tensor:
    """x (..., D) as the rows ``cache`` stores: quantized for q8_0, else cast."""
    if is_q8(cache):
        return quantize_q8(x)
    return x if x.dtype == cache.dtype else x.to(cache.dtype)


def from_cache(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Cache rows (..., last) as (..., D) values in ``dtype``."""
    if is_q8(rows):
        return dequantize_q8(rows, dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)
