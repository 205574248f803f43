"""Triton paged decode attention (flash-decoding), and its launcher.

One program handles one (sequence, kv head, context split): it loads the query rows of every
query head that shares that kv head (the GQA group), so each K/V element is read from memory
once per group, not once per query head. It walks its slice of the context in tiles of
``TILE_N`` tokens, finding each token's cache block through the block table, and keeps an
online softmax (running max and sum) in fp32.

With a sliding window of W tokens, a sequence of context length L attends only positions
max(0, L - W) .. L - 1: its walk starts in the block holding position L - W (the blocks
wholly before it are never loaded) and masks the positions before L - W in that block.

When there are few (sequence, kv head) pairs and long contexts, the launcher splits the
context into ``num_splits`` slices so the GPU has enough programs to stay busy; each slice
writes a normalised partial output and its log-sum-exp, and a second kernel merges them.
The splits divide the part of the context that is walked (the window, with one).
With one split the decode kernel writes the final output and the merge is skipped.

A q8_0 cache (`kv_quant`) is read as int8 values and an fp16 scale per 32 of them: a tile's K
and V are loaded as int8 (about half the bytes of f16) and scaled as they are converted.

On CUDA with a bf16 or fp16 cache and q of the same dtype (``MMA``), the tensor cores multiply
the stored values themselves: the scores are q . K with float32 sums (products of two 16-bit
values are exact), scaled after; P . V takes P in two 16-bit parts, hi = P rounded and lo = P -
hi rounded, so P is carried to about 16 bits and the output keeps float32's accuracy to within
the cache's own rounding. Float32 and q8_0 caches take the float32 dot (IEEE, no TF32). In the
CPU interpreter (``F32_OPS``) the same values go through float32 operands.

This module imports triton; ``llmlocal.native.paged_attention`` imports it only when the
Triton path runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import triton_device
from ..triton_device import interpreting
from .kv_quant import is_q8
from .reference import check_decode_args

# ln-space scores are converted to log2 space once (folded into q) so the kernels use exp2.
_LOG2_E = 1.4426950408889634
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256


def _decode_kernel(
    q_ptr,  # (B, H, D)
    k_cache_ptr,  # (num_blocks, block_size, n_kv, D); v_cache has the same strides
    v_cache_ptr,
    k_scale_ptr,  # QUANT: the caches viewed as fp16 (a row's group g's scale at element (row start + D) / 2 + g)
    v_scale_ptr,
    block_tables_ptr,  # (B, max_blocks), last stride 1
    context_lens_ptr,  # (B,)
    out_ptr,  # (B, H, D), written when NUM_SPLITS == 1
    part_out_ptr,  # (B, H, NUM_SPLITS, D) fp32, written when NUM_SPLITS > 1
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32, log2-space log-sum-exp of each split
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,
    window,  # attend the last `window` positions; read only when WINDOWED
    stride_qb,
    stride_qh,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    stride_ob,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    MMA: tl.constexpr,
    F32_OPS: tl.constexpr,
    WINDOWED: tl.constexpr,
    QUANT: tl.constexpr,
):
    # For query rows g of kv head `kvh` of sequence `seq`, over tokens t in [start, end):
    #   s[g, t] = log2(e) * scale * q[g] . K[t];  m = max_t s;  l = sum_t 2^(s - m);
    #   o[g] = sum_t 2^(s - m) V[t] / l.
    # Tile by tile: m' = max(m, max_tile s); l' = l * 2^(m - m') + sum_tile 2^(s - m');
    # acc' = acc * 2^(m - m') + sum_tile 2^(s - m') V. Masked tokens score -inf and weigh 0;
    # their K/V are never loaded (masked loads), so padding table entries are never followed.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    ctx_len = tl.load(context_lens_ptr + seq)
    if WINDOWED:
        # The walk starts at `first`: the tile of the block holding lo = max(0, L - W) that
        # holds lo itself (the block's first token when TILE_N >= BLOCK_SIZE), so no block
        # wholly before the window is loaded, tiles stay aligned to the blocks, and every
        # tile holds a live token. Positions in [first, lo) are masked. The merge kernel
        # computes `first` the same way.
        lo = tl.maximum(ctx_len - window, 0)
        first = lo // BLOCK_SIZE * BLOCK_SIZE
        first += (lo - first) // TILE_N * TILE_N
    else:
        first = 0
    start = first + split * tokens_per_split
    # The last split runs to the end of the context, so a low max_context_len hint costs
    # speed, never correctness.
    end = tl.where(split == NUM_SPLITS - 1, ctx_len, tl.minimum(start + tokens_per_split, ctx_len))

    offs_g = tl.arange(0, GROUP_PAD)  # (G,)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # (D,)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # (G,) query head indices

    q_offs = seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]  # (G, D)
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if MMA:  # q as stored (16-bit): the tensor cores multiply it with K exactly, the scale comes after
        if F32_OPS:
            q = q.to(tl.float32)
    else:
        q = q.to(tl.float32) * qk_scale  # (G, D)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # (G,)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # (G,)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # (G, D)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)  # (N,) token positions in the sequence
        n_mask = offs_n < end
        if WINDOWED:
            n_mask = n_mask & (offs_n >= lo)
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok_offs = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_tok  # (N,)
        kv_offs = tok_offs[:, None] + kvh * stride_cache_head + offs_d[None, :]  # (N, D)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # (N, D)
        if MMA:
            if F32_OPS:
                k = k.to(tl.float32)
        else:
            k = k.to(tl.float32)
        if QUANT:  # K[t, e] = q[t, e] * d[t, e // 32]
            scale_offs = ((tok_offs + kvh * stride_cache_head + HEAD_DIM) // 2)[:, None] + offs_d[None, :] // 32  # (N, D)
            k = k * tl.load(k_scale_ptr + scale_offs, mask=kv_mask, other=0.0).to(tl.float32)

        if MMA and F32_OPS:  # (the CPU interpreter: float32 operands, the same values)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        elif MMA:
            s = tl.dot(q, tl.trans(k)) * qk_scale  # 16-bit products, float32 sums
        elif USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (G, D) @ (D, N) -> (G, N)
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, N, D) -> (G, N)
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (G,), finite: each tile has a live token
        alpha = tl.exp2(m_i - m_new)  # (G,), 0 on the first tile
        p = tl.exp2(s - m_new[:, None])  # (G, N)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # (N, D)
        if not MMA:
            v = v.to(tl.float32)
        if QUANT:
            v = v * tl.load(v_scale_ptr + scale_offs, mask=kv_mask, other=0.0).to(tl.float32)
        if MMA:
            # P in two 16-bit parts, P = hi + lo to about 16 bits, each times V on the tensor cores
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            if F32_OPS:
                v32 = v.to(tl.float32)
                pv = tl.dot(p_lo.to(tl.float32), v32, tl.dot(p_hi.to(tl.float32), v32, input_precision="ieee"),
                            input_precision="ieee")
            else:
                pv = tl.dot(p_lo, v, tl.dot(p_hi, v))
        elif USE_DOT:
            pv = tl.dot(p, v, input_precision="ieee")  # (G, N) @ (N, D) -> (G, D)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (G, N, D) -> (G, D)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # An empty split (start >= ctx_len, a short sequence in a long batch) has l == 0; it is
    # not stored, and the guard only keeps the arithmetic finite.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # (G, D)
    if NUM_SPLITS == 1:
        o_offs = seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]  # (G, D)
        out_mask = g_mask[:, None] & d_mask[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # (G,) (b, h, split)
        # An empty split stores no rows. (The row count folds the scalar condition into one
        # vector comparison; the CPU interpreter mis-types `vector_mask & scalar_bool`.)
        live_rows = offs_g < tl.where(start < ctx_len, GROUP, 0)  # (G,)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_safe), mask=live_rows)
        part_offs = row[:, None] * HEAD_DIM + offs_d[None, :]  # (G, D)
        tl.store(part_out_ptr + part_offs, o, mask=live_rows[:, None] & d_mask[None, :])


def _merge_kernel(
    part_out_ptr,  # (B, H, NUM_SPLITS, D) fp32
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32
    context_lens_ptr,  # (B,)
    out_ptr,  # (B, H, D)
    tokens_per_split,
    window,  # as the decode kernel's; read only when WINDOWED
    n_heads,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    # Split j holds o_j = (sum_{t in j} 2^(s_t) V_t) / (sum_{t in j} 2^(s_t)) and
    # lse_j = log2(sum_{t in j} 2^(s_t)). With M = max_j lse_j and w_j = 2^(lse_j - M):
    #   out = sum_j w_j o_j / sum_j w_j.
    # Only the first ceil((ctx_len - first) / tokens_per_split) splits of a sequence hold data,
    # `first` being where the decode kernel's walk starts (0 without a window).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    if WINDOWED:
        lo = tl.maximum(ctx_len - window, 0)
        first = lo // BLOCK_SIZE * BLOCK_SIZE
        first += (lo - first) // TILE_N * TILE_N
        walked = ctx_len - first
    else:
        walked = ctx_len
    n_live = tl.minimum((walked + tokens_per_split - 1) // tokens_per_split, NUM_SPLITS)

    offs_s = tl.arange(0, SPLITS_PAD)  # (S,)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # (D,)
    s_mask = offs_s < n_live
    d_mask = offs_d < HEAD_DIM
    row = (seq * n_heads + head) * NUM_SPLITS + offs_s  # (S,)

    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))  # (S,)
    w = tl.exp2(lse - tl.max(lse, axis=0))  # (S,), 0 for dead splits
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (S, D)
    o = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)  # (D,)
    o_offs = seq * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def jitted_kernels(interpret: bool) -> tuple[object, object]:
    """The decode and merge kernels, wrapped by triton.jit on first use.

    NOTE: triton.jit chooses between the compiler and the CPU interpreter when it wraps a
    function, reading TRITON_INTERPRET at that moment. Wrapping here, keyed by the mode the
    caller read from the environment a moment earlier, means an early import of this module
    cannot freeze the wrong mode."""
    if interpret != interpreting():
        raise RuntimeError("TRITON_INTERPRET changed between reading it and wrapping the kernels")
    return triton.jit(_decode_kernel), triton.jit(_merge_kernel)


@dataclass(frozen=True)
class SplitPlan:
    """How the context is divided among programs: split j covers tokens
    [j * tokens_per_split, (j + 1) * tokens_per_split), the last one runs to the end."""

    num_splits: int
    tokens_per_split: int


def plan_splits(
    max_context_len: int, seq_head_pairs: int, num_sms: int, tile_n: int, num_splits: int | None = None
) -> SplitPlan:
    """Choose the number of context splits: enough (sequence, kv head, split) programs to fill
    about two waves of SMs, no split shorter than MIN_TOKENS_PER_SPLIT tokens, at most
    MAX_SPLITS. ``num_splits`` forces a count (tests use it to split short contexts)."""
    if num_splits is None:
        wanted = math.ceil(2 * num_sms / max(seq_head_pairs, 1))
        by_length = math.ceil(max_context_len / MIN_TOKENS_PER_SPLIT)
        num_splits = max(1, min(wanted, by_length, MAX_SPLITS))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    # Round each split up to whole tiles; rounding may leave fewer splits than asked for.
    tokens_per_split = math.ceil(math.ceil(max_context_len / num_splits) / tile_n) * tile_n
    return SplitPlan(max(1, math.ceil(max_context_len / tokens_per_split)), tokens_per_split)


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
    """Triton paged decode attention; the contract is paged_decode_attention's.

    ``max_context_len`` (a host int, >= every context length) sizes the splits without a
    device sync; without it the block table's width bounds the context. ``window`` > 0
    attends only the last ``window`` positions of each sequence. ``num_splits``,
    ``tile_n`` (tokens per inner step, a power of two) and ``use_dot`` (tl.dot instead of
    broadcast products, needs tiles of at least 16), ``mma`` (with tl.dot and a 16-bit cache that
    q matches: the cache's own values on the tensor cores, see the module's docstring) and
    ``num_warps`` override the launcher's choices.

    On an H200, for 100 tokens of Qwen2.5-1.5B's attention (12 query heads, 2 KV heads): the
    float32 dot of 64-token tiles spilled a thousand registers and took 160 us a layer, 29 with
    8 warps; the tensor-core path 6.8 (`packaging/gpu_kernels.py`)."""
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, window)
    interpret = interpreting()
    if not q.is_cuda and not interpret:
        raise ValueError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run on CPU")
    if q.stride(-1) != 1 or block_tables.stride(-1) != 1 or context_lens.stride(0) != 1:
        raise ValueError("q's last dim, block_tables' rows and context_lens must be contiguous")

    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    group = n_heads // n_kv
    quant = is_q8(k_cache)  # check_decode_args saw that q's head_dim is head_dim_of(k_cache)
    # the scales' fp16 view (an fp16 never read otherwise: the caches stand in for it)
    k_scales, v_scales = (k_cache.view(torch.float16), v_cache.view(torch.float16)) if quant else (k_cache, v_cache)
    if batch == 0:
        return torch.empty_like(q)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if max_context_len < 1:
        raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")

    head_dim_pad = triton.next_power_of_2(head_dim)
    group_pow2 = triton.next_power_of_2(group)
    if use_dot is None:
        # tl.dot needs every tile dim >= 16; padding the group to 16 rows is cheap once the
        # group already has 8, and the broadcast product would need too many registers.
        use_dot = q.is_cuda and group_pow2 >= 8 and head_dim_pad >= 16
    group_pad = max(group_pow2, 16) if use_dot else group_pow2
    sixteen_bit = q.dtype == k_cache.dtype and q.dtype in (torch.bfloat16, torch.float16)
    if mma is None:
        mma = use_dot and q.is_cuda and sixteen_bit
    if mma and not (use_dot and sixteen_bit):
        raise ValueError("mma needs tl.dot and q in the cache's 16-bit dtype")
    if num_warps is None and q.is_cuda:
        num_warps = 8 if use_dot and not mma else 4
    if tile_n is None:
        # Keep the (G, N, D) broadcast product of the non-dot path near 8K fp32 values.
        tile_n = 64 if use_dot else max(16, min(64, 8192 // (group_pad * head_dim_pad)))
    if tile_n < 1 or tile_n & (tile_n - 1) or (use_dot and tile_n < 16):
        raise ValueError(f"tile_n must be a power of two (>= 16 with use_dot), got {tile_n}")

    walked_len = max_context_len
    if window > 0:
        # The walk starts less than min(tile_n, block_size) tokens before the window.
        walked_len = min(max_context_len, window + min(tile_n, block_size) - 1)
    plan = plan_splits(walked_len, batch * n_kv, triton_device.num_sms(q.device), tile_n, num_splits)
    decode_kernel, merge_kernel = jitted_kernels(interpret)

    out = torch.empty_like(q)
    if plan.num_splits > 1:
        part_out = torch.empty(batch, n_heads, plan.num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(batch, n_heads, plan.num_splits, device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out  # never touched by the NUM_SPLITS == 1 variant

    decode_kernel[(batch, n_kv, plan.num_splits)](
        q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, out, part_out, part_lse,
        scale * _LOG2_E, plan.tokens_per_split, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, TILE_N=tile_n,
        NUM_SPLITS=plan.num_splits, USE_DOT=use_dot, MMA=mma, F32_OPS=interpret, WINDOWED=window > 0, QUANT=quant,
        **({} if num_warps is None else {"num_warps": num_warps}),
    )  # fmt: skip
    if plan.num_splits > 1:
        merge_kernel[(batch, n_heads)](
            part_out, part_lse, context_lens, out,
            plan.tokens_per_split, window, n_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=plan.num_splits, SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
            BLOCK_SIZE=block_size, TILE_N=tile_n, WINDOWED=window > 0,
        )  # fmt: skip
    return out
