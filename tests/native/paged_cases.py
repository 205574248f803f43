"""Paged-attention test cases: caches filled with NaN before the live tokens are written, block
tables whose padding points at NaN blocks or out of range, the dense truth of each case, and
the runners and tolerances the kernel tests share (test_paged_attention.py,
test_paged_attention_window.py)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import llmlocal.native.paged_attention as pa

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# Outputs are rounded once to the output dtype: tolerances of a few units in the last place;
# fp32 allows for a different summation order over up to a thousand terms.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# Starter model (SmolLM2-135M): 9 query heads, 3 kv heads, head_dim 64.
STARTER = (9, 3, 64)


@dataclass
class PagedCase:
    q: Tensor  # (B, H, D)
    k_cache: Tensor  # (num_blocks, block_size, n_kv, D)
    v_cache: Tensor
    block_tables: Tensor  # (B, max_blocks) int32
    context_lens: Tensor  # (B,) int32
    keys: list[Tensor]  # per sequence (L_b, n_kv, D), the dense truth
    values: list[Tensor]
    scale: float


def make_case(
    lens: list[int],
    block_size: int,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    padding: str = "nan_block",
    seed: int = 0,
) -> PagedCase:
    """Sequences of the given lengths scattered over shuffled cache blocks; unused blocks and
    the unused tail of each last block hold NaN. Table padding: "nan_block" (a NaN-filled
    block), "minus_one", or "out_of_range" (a block id past the cache)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    spare = 3
    num_blocks = sum(blocks_per_seq) + spare
    max_blocks = max(blocks_per_seq) + 2  # every row has padding entries
    k_cache = torch.full((num_blocks, block_size, n_kv, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))

    order = torch.randperm(num_blocks, generator=gen)
    pad_id = {"nan_block": int(order[-1]), "minus_one": -1, "out_of_range": num_blocks + 1000}[padding]
    block_tables = torch.full((len(lens), max_blocks), pad_id, dtype=torch.int32)
    keys, values = [], []
    next_block = 0
    for b, n in enumerate(lens):
        ids = order[next_block : next_block + blocks_per_seq[b]]
        next_block += blocks_per_seq[b]
        block_tables[b, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(n, n_kv, head_dim, generator=gen).to(dtype)  # (L, n_kv, D)
        v = torch.randn(n, n_kv, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        k_cache[ids[pos // block_size], pos % block_size] = k
        v_cache[ids[pos // block_size], pos % block_size] = v
        keys.append(k)
        values.append(v)
    q = torch.randn(len(lens), n_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return PagedCase(q, k_cache, v_cache, block_tables, context_lens, keys, values, head_dim**-0.5)


def dense_attention(case: PagedCase, window: int = 0) -> Tensor:
    """Per-sequence attention over contiguous K/V in float64 with an explicit softmax; with a
    window, over the last ``window`` positions only."""
    n_heads = case.q.shape[1]
    outs = []
    for b, (k, v) in enumerate(zip(case.keys, case.values)):
        if window > 0:
            k, v = k[-window:], v[-window:]  # positions max(0, L - window) .. L - 1
        group = n_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        q = case.q[b].double()[:, None, :]  # (H, 1, D)
        probs = torch.softmax(case.scale * q @ k.transpose(1, 2), dim=-1)  # (H, 1, L)
        outs.append((probs @ v)[:, 0])  # (H, D)
    return torch.stack(outs).to(case.q.dtype)  # (B, H, D)


def run_reference(case: PagedCase, max_context_len: int | None = None, **overrides: Any) -> Tensor:
    return pa.paged_decode_attention_reference(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale, max_context_len,
        **overrides,
    )  # fmt: skip


def run_triton(case: PagedCase, max_context_len: int | None = None, **overrides: Any) -> Tensor:
    return pa.paged_decode_attention_triton(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale,
        max_context_len, **overrides,
    )  # fmt: skip


def edge_lens(block_size: int, long: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, long]


def poison_before_window(case: PagedCase, window: int) -> None:
    """Fill the cache with NaN at every position before each sequence's window, and point the
    table entries of the blocks wholly before it out of range: a kernel that reads such a
    position returns NaN, one that follows such an entry reads out of bounds."""
    num_blocks, block_size = case.k_cache.shape[:2]
    for b, n in enumerate(case.context_lens.tolist()):
        lo = max(0, n - window)
        pos = torch.arange(lo)
        ids = case.block_tables[b, pos // block_size].long()
        case.k_cache[ids, pos % block_size] = float("nan")
        case.v_cache[ids, pos % block_size] = float("nan")
        case.block_tables[b, : lo // block_size] = num_blocks + 1000


def assert_close(out: Tensor, expected: Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert not out.isnan().any(), "a masked or padding position was read"
    torch.testing.assert_close(out, expected, **TOL[out.dtype])
