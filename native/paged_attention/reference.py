"""Pure-torch paged attention: the reference the Triton kernels are tested against, and the
production path on CPU.

Cache layout (per layer): ``k_cache``, ``v_cache``: ``(num_blocks, block_size, n_kv_heads,
head_dim)``, contiguous; a q8_0 cache is int8 with 2 more bytes per 32 values (`kv_quant`). A
token's slot is ``block_id * block_size + offset_in_block``; a
sequence's block table lists its block ids in order, so its token ``t`` lives in block
``block_tables[b, t // block_size]`` at offset ``t % block_size``.

Decode attention is vectorised over sequences, tokens and query heads. It runs in steps of a
few megabytes (whole sequences when they fit, runs of blocks of one long sequence otherwise)
so that each step's K/V copy stays in cache, and in each step one matmul per kv head reads
the gathered K/V in place. With a sliding window it gathers only the blocks from the one
holding the window's first position on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .kv_quant import GROUP, dequantize_q8, head_dim_of, is_q8, to_cache

# Budget for one step's fp32 K copy: K and V of a step then stay in cache between the gather
# and the matmuls, and no temporary grows with the batch or the context.
STEP_BYTES = 4 << 20

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = _FLOAT_DTYPES + (torch.int8,)  # int8: q8_0 rows (kv_quant)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be (num_blocks, block_size, n_kv_heads, head_dim), got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must match k_cache: got {tuple(v_cache.shape)} {v_cache.dtype} "
            f"vs {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"the KV cache must be float32, float16, bfloat16 or int8 (q8_0), got {k_cache.dtype}")
    if is_q8(k_cache) and (k_cache.shape[-1] % (GROUP + 2) or head_dim_of(k_cache) < GROUP):
        raise ValueError(f"a q8_0 cache's rows hold head_dim values and a 2-byte scale per {GROUP}, got {k_cache.shape[-1]} bytes")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def _check_same_device(*tensors: Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def check_write_kv_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Raise ValueError unless the arguments follow the write_kv contract."""
    _check_caches(k_cache, v_cache)
    n_kv, head_dim = k_cache.shape[2], head_dim_of(k_cache)
    if key.dim() != 3 or key.shape[1:] != (n_kv, head_dim):
        raise ValueError(
            f"key must be (N, {n_kv}, {head_dim}) to match the cache, got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if key.dtype not in _FLOAT_DTYPES or value.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"key/value must be float32, float16 or bfloat16, got {key.dtype}/{value.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    _check_same_device(key, value, k_cache, v_cache, slot_mapping)


def check_decode_args(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, window: int = 0
) -> None:
    """Raise ValueError unless the arguments follow the paged_decode_attention contract."""
    _check_caches(k_cache, v_cache)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}")
    n_kv, head_dim = k_cache.shape[2], head_dim_of(k_cache)
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be (B, n_heads, {head_dim}), got {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.shape[1] % n_kv != 0:
        raise ValueError(f"n_heads ({q.shape[1]}) must be a multiple of n_kv_heads ({n_kv})")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must be ({batch}, max_blocks_per_seq >= 1), got {tuple(block_tables.shape)}"
        )
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be ({batch},), got {tuple(context_lens.shape)}")
    if block_tables.dtype not in _INDEX_DTYPES or context_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"block_tables and context_lens must be int32 (or int64), "
            f"got {block_tables.dtype}/{context_lens.dtype}"
        )
    _check_same_device(q, k_cache, v_cache, block_tables, context_lens)


def write_kv_reference(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write ``key[i]``/``value[i]`` (``(N, n_kv_heads, head_dim)``) into slot ``slot_mapping[i]``
    of the caches, cast to the cache dtype (quantized for q8_0); rows whose slot is negative are
    skipped."""
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, n_kv, width = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()  # (N_kept,)
    k_slots = k_cache.view(num_blocks * block_size, n_kv, width)  # (S, n_kv, W), aliases k_cache
    v_slots = v_cache.view(num_blocks * block_size, n_kv, width)  # (S, n_kv, W), aliases v_cache
    k_slots.index_copy_(0, slots, to_cache(key[keep], k_cache))
    v_slots.index_copy_(0, slots, to_cache(value[keep], v_cache))


def paged_decode_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    window: int = 0,
    step_bytes: int = STEP_BYTES,
) -> Tensor:
    """One query token per sequence against all of its cached tokens, or the last ``window``
    of them; see the package docstring for the full contract. Returns ``(B, n_heads,
    head_dim)`` in ``q``'s dtype.

    The work runs in steps whose fp32 K copy stays under ``step_bytes``: several whole
    sequences per step when they fit, else one sequence and a run of its blocks per step."""
    # out[b, h] = sum_t softmax_t(scale * q[b, h] . K[b, t, kv(h)]) V[b, t, kv(h)] over
    # lo[b] <= t < context_lens[b], kv(h) = h // (n_heads // n_kv_heads), where lo[b] =
    # max(0, context_lens[b] - window) with a window and 0 without. Steps are merged with an
    # online softmax (see _attend_rows), so no temporary grows with the batch or the context.
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, window)
    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    group = n_heads // n_kv
    lens = context_lens.long()  # (B,)
    # a q8_0 cache is read as q * d (kv_quant.dequantize_q8), block by block as it is gathered
    if batch == 0:
        return torch.empty_like(q)

    if max_context_len is None or not lens.is_cuda:
        # On the host the exact maximum costs nothing and guards against a stale hint.
        max_context_len = int(lens.max())
    if window > 0:
        # Only the blocks from the one holding position lo = max(0, L - W) on are read: each
        # table row is shifted so that block becomes block 0, and positions and lengths count
        # from its first token. The shifted context then spans at most W + block_size - 1.
        lo = (lens - window).clamp(min=0)  # (B,)
        first_block = lo // block_size  # (B,)
        lens = lens - first_block * block_size  # (B,)
        lo = lo - first_block * block_size  # (B,), in [0, block_size)
        span = min(max_context_len, window + block_size - 1)
        n_blocks = min(math.ceil(span / block_size), block_tables.shape[1])
        cols = first_block[:, None] + torch.arange(n_blocks, device=q.device)  # (B, nb)
        # Columns past the table's end are dead (past the sequence's last block), clamped only
        # to keep the gather in bounds.
        table = block_tables.gather(1, cols.clamp(max=block_tables.shape[1] - 1))  # (B, nb)
    else:
        lo = None
        n_blocks = min(math.ceil(max_context_len / block_size), block_tables.shape[1])
        table = block_tables[:, :n_blocks]  # (B, nb)

    # Table entries past a sequence's last block are padding with any value: replace them by
    # block 0 so the gather stays in bounds; the positions they cover are masked.
    block_idx = torch.arange(n_blocks, device=q.device)  # (nb,)
    live = block_idx[None, :] < ((lens + block_size - 1) // block_size)[:, None]  # (B, nb)
    table = torch.where(live, table.long(), 0)  # (B, nb)

    # GQA: the query heads of one kv head form a group of `group` rows.
    qh = (q.float() * scale).view(batch, n_kv, group, head_dim).transpose(0, 1).contiguous()  # (n_kv, B, G, D)

    block_bytes = block_size * n_kv * head_dim * 4  # one block of K in fp32
    if batch * n_blocks * block_bytes <= step_bytes:
        return _attend_one_step(q, k_cache, v_cache, table, lens, lo, scale)
    if n_blocks * block_bytes <= step_bytes:
        seqs_per_step, blocks_per_step = min(batch, max(1, step_bytes // (n_blocks * block_bytes))), n_blocks
    else:
        seqs_per_step, blocks_per_step = 1, max(1, step_bytes // block_bytes)

    k_steps = _StepGather(k_cache, seqs_per_step * blocks_per_step)
    v_steps = _StepGather(v_cache, seqs_per_step * blocks_per_step)
    out = torch.empty(n_kv, batch, group, head_dim, device=q.device, dtype=torch.float32)
    for first in range(0, batch, seqs_per_step):
        rows = slice(first, first + seqs_per_step)
        lo_rows = None if lo is None else lo[rows]
        out[:, rows] = _attend_rows(qh[:, rows], k_steps, v_steps, table[rows], lens[rows], lo_rows, blocks_per_step)
    return out.transpose(0, 1).reshape(batch, n_heads, head_dim).to(q.dtype)  # (B, H, D)


def _attend_one_step(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, lens: Tensor, lo: Tensor | None, scale: float
) -> Tensor:
    """The common decode case, when every sequence's K/V fits one step: one gather and one
    fused attention call (few torch ops, which is what a CPU decode step is bound by).

    The `group` query heads of a kv head act as `group` queries at one position, so the
    attention needs no causal mask, only the per-sequence length mask (and, with a window,
    the mask of the positions before ``lo``, the window's start in block 0)."""
    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    n_blocks = table.shape[1]
    length = n_blocks * block_size
    k = _floats(k_cache[table]).view(batch, length, n_kv, head_dim)  # (B, L, n_kv, D), a copy
    v = _floats(v_cache[table]).view(batch, length, n_kv, head_dim)
    valid = torch.arange(length, device=q.device)[None, :] < lens[:, None]  # (B, L)
    if lo is not None:
        valid &= torch.arange(length, device=q.device)[None, :] >= lo[:, None]
    # Rows past a sequence's end may never have been written (NaN): zero them, since a masked
    # score does not protect against NaN * 0.
    k.masked_fill_(~valid[:, :, None, None], 0.0)
    v.masked_fill_(~valid[:, :, None, None], 0.0)
    qh = q.float().view(batch, n_kv, n_heads // n_kv, head_dim)  # (B, n_kv, G, D)
    out = F.scaled_dot_product_attention(
        qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale
    )  # (B, n_kv, G, D)
    return out.reshape(batch, n_heads, head_dim).to(q.dtype)


def _floats(blocks: Tensor) -> Tensor:
    """Gathered cache blocks (..., last) as fp32 (..., D): dequantized when q8_0."""
    return dequantize_q8(blocks) if is_q8(blocks) else blocks.float()


class _StepGather:
    """Copies cache blocks, as fp32, into one buffer that every step of a call reuses.

    NOTE: a fresh multi-megabyte tensor per step would go back to the OS when freed and be
    page-faulted in again at the next step, which costs more than the copy itself."""

    def __init__(self, cache: Tensor, max_blocks: int) -> None:
        self.cache = cache
        shape = (max_blocks, *cache.shape[1:])  # (n, bs, n_kv, W): W = D, or D + 2 for q8_0
        self.raw = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        f32_shape = shape[:-1] + (head_dim_of(cache),)  # (n, bs, n_kv, D)
        self.f32 = self.raw if cache.dtype == torch.float32 else torch.empty(f32_shape, device=cache.device)

    def __call__(self, ids: Tensor) -> Tensor:
        """Blocks ``ids`` (b, nbs) in order as (b, nbs * bs, n_kv, D) fp32, valid until the next call."""
        rows, n_ids = ids.shape
        _, block_size, n_kv, head_dim = self.f32.shape
        n = rows * n_ids
        raw = torch.index_select(self.cache, 0, ids.flatten(), out=self.raw[:n])  # (n, bs, n_kv, W)
        if self.f32 is self.raw:
            f32 = raw
        elif is_q8(raw):
            # q * d in fp32, (n, bs, n_kv, D): (.., D / 32, 32) values times (.., D / 32, 1) scales
            f32 = self.f32[:n].copy_(raw[..., :head_dim])
            f32.unflatten(-1, (-1, GROUP)).mul_(raw[..., head_dim:].contiguous().view(torch.float16).unsqueeze(-1))
        else:
            f32 = self.f32[:n].copy_(raw)
        return f32.view(rows, n_ids * block_size, n_kv, head_dim)  # (b, Ls, n_kv, D)


def _attend_rows(
    qh: Tensor,
    k_steps: _StepGather,
    v_steps: _StepGather,
    table: Tensor,
    lens: Tensor,
    lo: Tensor | None,
    blocks_per_step: int,
) -> Tensor:
    """Attention of a few sequences, ``blocks_per_step`` cache blocks at a time.
    qh: (n_kv, b, G, D) fp32, pre-scaled; table: (b, nb), no padding ids; lens: (b,);
    lo: (b,) first position of the window (in block 0), or None for the whole context.
    Returns (n_kv, b, G, D) fp32."""
    # Online softmax over steps: m' = max(m, max_step s); alpha = e^(m - m');
    # l' = l alpha + sum_step e^(s - m'); acc' = acc alpha + sum_step e^(s - m') V; out = acc / l.
    # Positions t >= len (and t < lo) score -inf *and* get a zeroed V row: the cache behind
    # them (the tail of the last block, or block 0 standing in for padding) may never have been
    # written and may hold NaN, and 0 * NaN is still NaN. Step 0 holds block 0, and with it
    # the first live position (0, or lo < block_size), so m is finite after it.
    n_kv, rows, group, head_dim = qh.shape
    block_size = k_steps.cache.shape[1]
    m = torch.full((n_kv, rows, group, 1), float("-inf"), device=qh.device)
    l = torch.zeros(n_kv, rows, group, 1, device=qh.device)
    acc = torch.zeros(n_kv, rows, group, head_dim, device=qh.device)
    for first_block in range(0, table.shape[1], blocks_per_step):
        ids = table[:, first_block : first_block + blocks_per_step]  # (b, nbs)
        k = k_steps(ids)  # (b, Ls, n_kv, D)
        v = v_steps(ids)  # (b, Ls, n_kv, D)
        step_len = k.shape[1]
        pos = first_block * block_size + torch.arange(step_len, device=qh.device)  # (Ls,)
        valid = pos[None, :] < lens[:, None]  # (b, Ls)
        if lo is not None:
            valid &= pos[None, :] >= lo[:, None]
        v[(~valid).nonzero(as_tuple=True)] = 0.0  # writes only the masked rows

        # k[:, :, h] is a (b, Ls, D) view with row stride n_kv * D, which bmm reads in place:
        # one bmm per kv head avoids copying K/V into a head-major layout.
        s = torch.empty(n_kv, rows, group, step_len, device=qh.device)
        for h in range(n_kv):
            torch.bmm(qh[h], k[:, :, h].transpose(1, 2), out=s[h])  # (b, G, D) @ (b, D, Ls) -> (b, G, Ls)
        s.masked_fill_(~valid[None, :, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=3, keepdim=True))  # (n_kv, b, G, 1)
        p = torch.exp(s - m_new)  # (n_kv, b, G, Ls)
        alpha = torch.exp(m - m_new)  # (n_kv, b, G, 1), 0 on step 0
        l = l * alpha + p.sum(dim=3, keepdim=True)
        pv = torch.empty(n_kv, rows, group, head_dim, device=qh.device)
        for h in range(n_kv):
            torch.bmm(p[h], v[:, :, h], out=pv[h])  # (b, G, Ls) @ (b, Ls, D) -> (b, G, D)
        acc = acc * alpha + pv
        m = m_new
    return acc / l
