"""Triton kernel writing new tokens' K/V into their cache slots, and its launcher.

One program per token: it copies the token's (n_kv_heads, head_dim) key and value rows to
slot ``slot_mapping[i]`` (block ``slot // block_size``, offset ``slot % block_size``), cast to
the cache dtype. A negative slot (a padded row) writes nothing.

This module imports triton; ``llmlocal.native.paged_attention`` imports it only when the
Triton path runs.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from torch import Tensor

from .reference import check_write_kv_args
from .triton_decode import interpreting


def _write_kv_kernel(
    key_ptr,  # (N, n_kv, D)
    value_ptr,  # (N, n_kv, D)
    k_cache_ptr,  # (num_blocks, block_size, n_kv, D); v_cache has the same strides
    v_cache_ptr,
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
):
    # cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE, h, d] = row[h, d] for slot >= 0.
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
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=store_mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=store_mask)


@functools.lru_cache(maxsize=None)
def jitted_kernel(interpret: bool) -> object:
    """The write kernel, wrapped by triton.jit on first use (see triton_decode.jitted_kernels
    for why the wrapping waits)."""
    if interpret != interpreting():
        raise RuntimeError("TRITON_INTERPRET changed between reading it and wrapping the kernel")
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
    _, block_size, n_kv, head_dim = k_cache.shape
    jitted_kernel(interpret)[(n_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, N_KV=n_kv, N_KV_PAD=triton.next_power_of_2(n_kv),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
