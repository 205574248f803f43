"""Triton kernel writing new tokens' K/V into their cache slots, and its launcher.

One program per token: it copies the token's (n_kv_heads, head_dim) key and value rows to
slot ``slot_mapping[i]`` (block ``slot // block_size``, offset ``slot % block_size``), cast to
the cache dtype, or quantized to q8_0 rows (int8 values and an fp16 scale per 32, see
`kv_quant`). A negative slot (a padded row) writes nothing.

This module imports triton; ``llmlocal.native.paged_attention`` imports it only when the
Triton path runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kv_quant import is_q8
from .reference import check_write_kv_args
from ..triton_device import interpreting


quantize_rows = None  # _quantize_rows, wrapped by jitted_kernel in the mode the kernel runs in


def _quantize_rows(x, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """(ROWS, GROUPS * 32) fp32 -> (q (ROWS, GROUPS * 32) int8, d (ROWS, GROUPS) fp16): per group
    of 32, d = fp16(max|x| / 127), q = x / float(d) rounded half to even and clamped to +-127
    (0 where d = 0), as kv_quant.quantize_q8."""
    g = tl.reshape(x, (ROWS, GROUPS, 32))
    d = (tl.max(tl.abs(g), axis=2) / 127.0).to(tl.float16)  # (R, G)
    df = d.to(tl.float32)
    y = g / tl.where(df > 0.0, df, 1.0)[:, :, None]
    r = tl.floor(y + 0.5)  # exact for |y| < 2^22; ties go up, then back down to the even one
    r = tl.where((r - y == 0.5) & (r * 0.5 != tl.floor(r * 0.5)), r - 1.0, r)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    r = tl.where(df[:, :, None] > 0.0, r, 0.0)
    return tl.reshape(r, (ROWS, GROUPS * 32)).to(tl.int8), d


def _write_kv_kernel(
    key_ptr,  # (N, n_kv, D)
    value_ptr,  # (N, n_kv, D)
    k_cache_ptr,  # (num_blocks, block_size, n_kv, D); v_cache has the same strides
    v_cache_ptr,
    k_scale_ptr,  # QUANT: the caches viewed as fp16 (a row's group g's scale at element (row start + D) / 2 + g)
    v_scale_ptr,
    slot_mapping_ptr,  # (N,)
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    N_KV: tl.constexpr,
    N_KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr,
):
    # cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE, h, d] = row[h, d] for slot >= 0 (q8_0: the
    # quantized row, the fp16 scale of its group g of 32 at bytes D + 2g, D + 2g + 1).
    # The skip is a mask rather than an early return: masked lanes touch no memory.
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)

    offs_h = tl.arange(0, N_KV_PAD)  # (Hkv,)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # (D,)
    # A skipped row has no live heads. (Folding the scalar condition into the comparison
    # avoids `tensor_mask & scalar_bool`, which the CPU interpreter mis-types.)
    live_heads = tl.where(slot >= 0, N_KV, 0)
    store_mask = (offs_h[:, None] < live_heads) & (offs_d[None, :] < HEAD_DIM)  # (Hkv, D)

    key_offs = tok * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :]  # (Hkv, D)
    value_offs = tok * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :]
    k = tl.load(key_ptr + key_offs, mask=store_mask, other=0.0)
    v = tl.load(value_ptr + value_offs, mask=store_mask, other=0.0)

    block = slot // BLOCK_SIZE
    cache_offs = (
        block * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_tok
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )  # (Hkv, D)
    if QUANT:  # HEAD_DIM_PAD is a multiple of 32 (HEAD_DIM is)
        kq, kd = quantize_rows(k.to(tl.float32), N_KV_PAD, HEAD_DIM_PAD // 32)
        vq, vd = quantize_rows(v.to(tl.float32), N_KV_PAD, HEAD_DIM_PAD // 32)
        tl.store(k_cache_ptr + cache_offs, kq, mask=store_mask)
        tl.store(v_cache_ptr + cache_offs, vq, mask=store_mask)
        offs_g = tl.arange(0, HEAD_DIM_PAD // 32)  # (G,)
        scale_offs = ((block * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_tok
                       + offs_h[:, None] * stride_cache_head + HEAD_DIM) // 2 + offs_g[None, :])  # (Hkv, G)
        scale_mask = (offs_h[:, None] < live_heads) & (offs_g[None, :] < HEAD_DIM // 32)
        tl.store(k_scale_ptr + scale_offs, kd, mask=scale_mask)
        tl.store(v_scale_ptr + scale_offs, vd, mask=scale_mask)
    else:
        tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=store_mask)
        tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=store_mask)


@functools.lru_cache(maxsize=None)
def jitted_kernel(interpret: bool) -> object:
    """The write kernel, wrapped by triton.jit on first use (see triton_decode.jitted_kernels
    for why the wrapping waits)."""
    if interpret != interpreting():
        raise RuntimeError("TRITON_INTERPRET changed between reading it and wrapping the kernel")
    # the kernel calls its helper by this module's global name, wrapped in the same mode
    globals()["quantize_rows"] = triton.jit(_quantize_rows)
    return triton.jit(_write_kv_kernel)


def write_kv_triton(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Triton write_kv; the contract is write_kv's."""
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    interpret = interpreting()
    if not key.is_cuda and not interpret:
        raise ValueError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run on CPU")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or slot_mapping.stride(0) != 1:
        raise ValueError("key and value need a contiguous last dim, and slot_mapping must be contiguous")
    n_tokens = key.shape[0]
    if n_tokens == 0:
        return
    _, block_size, n_kv, head_dim = key.shape[0], k_cache.shape[1], k_cache.shape[2], key.shape[2]
    quant = is_q8(k_cache)
    # the scales' fp16 view (an fp16 never read otherwise: the caches stand in for it)
    k_scales, v_scales = (k_cache.view(torch.float16), v_cache.view(torch.float16)) if quant else (k_cache, v_cache)
    jitted_kernel(interpret)[(n_tokens,)](
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, N_KV=n_kv, N_KV_PAD=triton.next_power_of_2(n_kv),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), QUANT=quant,
    )  # fmt: skip
