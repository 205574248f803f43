"""Paged attention for the ``paged`` backend: writing new K/V into a block KV cache, and decode
attention that reads each sequence's K/V through its block table.

KV cache, per layer: ``k_cache``, ``v_cache``: ``(num_blocks, block_size, n_kv_heads, head_dim)``,
contiguous, float32 / float16 / bfloat16. A token's slot is ``block_id * block_size +
offset_in_block``.

``write_kv`` and ``paged_decode_attention`` run the Triton kernels when the tensors are on CUDA
or when ``TRITON_INTERPRET=1`` is set (Triton's CPU interpreter, used by the tests), and the
vectorised torch reference otherwise. Importing this package does not import triton.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from .reference import paged_decode_attention_reference, write_kv_reference

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "backend_for",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_decode_attention_triton",
    "write_kv",
    "write_kv_reference",
    "write_kv_triton",
]


def _interpret_requested() -> bool:
    # The spellings triton itself accepts as true; reading the variable here keeps triton unimported.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def backend_for(tensor: Tensor) -> Literal["triton", "torch"]:
    """Which implementation the dispatching functions use for tensors like ``tensor``."""
    return "triton" if tensor.is_cuda or _interpret_requested() else "torch"


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``, ``value`` (``(N, n_kv_heads, head_dim)``) in place into the caches at
    ``slot_mapping`` (``(N,)`` int64), cast to the cache dtype; a negative slot skips its row."""
    if backend_for(key) == "triton":
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    window: int = 0,
) -> Tensor:
    """Attention of one query token per sequence over all of its cached tokens (the current
    token's K/V already written), or over the last ``window`` of them.

    q: ``(B, n_heads, head_dim)``; block_tables: ``(B, max_blocks_per_seq)`` int32 whose entries
    past a sequence's last block are padding (any value, never read); context_lens: ``(B,)``
    int32, each >= 1. Query head h uses kv head ``h // (n_heads // n_kv_heads)``. Returns
    ``(B, n_heads, head_dim)`` in q's dtype; softmax and accumulation run in fp32.
    ``max_context_len``, a host int >= every context length, lets the CUDA launcher size its
    context splits without a device sync. ``window`` > 0 is a sliding window: the query of a
    sequence of context length L (its own token at position L - 1) attends only positions
    max(0, L - window) .. L - 1; 0 attends the whole context."""
    if backend_for(q) == "triton":
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, window=window
        )
    return paged_decode_attention_reference(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, window=window
    )


def write_kv_triton(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """The Triton write_kv launcher (imports triton on first call)."""
    from .triton_write_kv import write_kv_triton as launch

    launch(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    window: int = 0,
    num_splits: int | None = None,
    tile_n: int | None = None,
    use_dot: bool | None = None,
    mma: bool | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """The Triton decode launcher (imports triton on first call). ``window`` is
    paged_decode_attention's; the other keyword-only knobs override the launcher's choices:
    context splits, tokens per inner step, tl.dot or not, 16-bit operands on the tensor cores
    or not, warps per program."""
    from .triton_decode import paged_decode_attention_triton as launch

    return launch(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len,
        window=window, num_splits=num_splits, tile_n=tile_n, use_dot=use_dot, mma=mma, num_warps=num_warps,
    )  # fmt: skip
