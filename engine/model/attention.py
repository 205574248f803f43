"""Attention over the paged KV cache, for one engine step.

A step's tokens are flattened into one batch of N tokens: first `num_decode` sequences with
one new token each, then prefill chunks (a run of new tokens of one sequence, possibly after
a cached prefix). Every token's K/V is first written to its slot; then

* decodes attend through their block tables with the paged decode kernel on CUDA; on a CPU
  the step's runner gathers each sequence's slots once (``decode_slots``), and every layer
  copies those K/V rows with one ``index_select`` and calls one fused attention — a decode
  step on a CPU is bound by the number of torch calls per layer, not by their arithmetic;
* each prefill chunk attends, with `scaled_dot_product_attention`, to the sequence's whole
  context so far, gathered from the cache: its cached prefix and the chunk itself, causally.

A q8_0 cache (int8 rows with an fp16 scale per 32 values, see
`llmlocal.native.paged_attention.kv_quant`) is quantized as K/V are written and dequantized
as it is read, in every path: the gathered decode rows, the prefill chunks' context, the Triton
kernel and the native decode step (fast_decode).

A layer with a sliding window W (Mistral, Gemma 3's local layers, Phi-3) lets the token at
position p see positions p - W + 1 .. p only; the cache still holds every position (the blocks
are shared by all layers), the window only narrows what is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from llmlocal.native.cpu import runtime
from llmlocal.native.cpu.linear import prompt_rows_from
from llmlocal.native.paged_attention import paged_decode_attention, write_kv
from llmlocal.native.paged_attention.kv_quant import from_cache, to_cache


@dataclass
class PrefillChunk:
    offset: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    start: int  # position of the chunk's first token = tokens already in the cache
    slots: torch.Tensor  # (start + num_tokens,) int64: slots of every position so far


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) int64: where each new token's K/V goes
    num_decode: int = 0
    # a prompt's chunks take the bfloat16 attention (`prompt_rows`; csrc/attn_tiles.c): the CPU has
    # AMX-BF16 tiles and the model's projections take them too (`ModelRunner.prompt_tiles`), or
    # it has AVX512-BF16 and no tiles (`runtime.attn_bf16`)
    prompt_tiles: bool = False
    block_tables: torch.Tensor | None = None  # (num_decode, max_blocks) int32
    context_lens: torch.Tensor | None = None  # (num_decode,) int32, including the new token
    max_context_len: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # CPU decode: (num_decode, L) int64 slots of each sequence's context, padded with slot 0;
    # and (num_decode, 1, 1, L) bool of the real ones (None when every context is L long)
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    # the decodes' masks of windowed layers, by window, built once a step (`window_mask`)
    window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor | None:
        """(num_decode, 1, 1, L) bool: the gathered decode slots a layer of ``window`` sees
        (None: every real slot)."""
        if window <= 0 or self.decode_slots is None or self.context_lens is None:
            return self.decode_mask
        if window not in self.window_masks:
            lens = self.context_lens.to(torch.int64)
            if int(lens.max()) <= window:
                self.window_masks[window] = self.decode_mask
            else:
                idx = torch.arange(self.decode_slots.shape[1], device=lens.device)[None, :]  # (1, L)
                keep = (idx < lens[:, None]) & (idx >= lens[:, None] - window)  # (B, L)
                self.window_masks[window] = keep[:, None, None, :]
        return self.window_masks[window]


def paged_attention(
    q: torch.Tensor,  # (N, H, D)
    k: torch.Tensor,  # (N, Hkv, D)
    v: torch.Tensor,  # (N, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """(N, H, D) attention outputs for the step's tokens; writes their K/V to the cache.
    ``window`` > 0: each token sees the last ``window`` positions, itself included."""
    n_kv, width = k_cache.shape[2], k_cache.shape[3]  # width: head_dim, + head_dim / 16 for q8_0
    if meta.decode_slots is not None or k_cache.device.type == "cpu":
        # the CPU path: plain indexed copies (its slots are never negative), none of write_kv's
        # checks and row masks (a prompt chunk of 512 rows: 0.9 ms a layer through those, on two
        # Zen 5 threads); k and v themselves stay in q's dtype: a first prefill chunk attends to
        # them as they are
        k_cache.view(-1, n_kv, width).index_copy_(0, meta.slot_mapping, to_cache(k, k_cache))
        v_cache.view(-1, n_kv, width).index_copy_(0, meta.slot_mapping, to_cache(v, v_cache))
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode
    if nd and meta.decode_slots is not None and not meta.prefills:
        return _gathered_decode(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty_like(q)
    if nd and meta.decode_slots is not None:
        out[:nd] = _gathered_decode(q[:nd], k_cache, v_cache, meta, scale, window)
    elif nd:
        assert meta.block_tables is not None and meta.context_lens is not None
        out[:nd] = paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.max_context_len, window=window
        )
    if meta.prefills:
        flat_k = k_cache.view(-1, n_kv, width)  # (slots, Hkv, W)
        flat_v = v_cache.view(-1, n_kv, width)
        tiles = meta.prompt_tiles and q.dtype is torch.float32 and runtime.attn_tiles()
        prompt_from = prompt_rows_from() if tiles else None
        for chunk in meta.prefills:
            rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
            if prompt_from is not None and chunk.offset >= prompt_from and q.shape[-1] in _TILE_HEAD_DIMS:
                # a prompt's rows in bfloat16 (`_tiles_attention`), K and V as the cache holds them in every
                # chunk (the first too): the same numbers however the prompt was chunked
                ck = from_cache(flat_k[chunk.slots], q.dtype)
                cv = from_cache(flat_v[chunk.slots], q.dtype)
                out[rows] = _tiles_attention(q[rows], ck, cv, chunk.start, scale, window)
                continue
            if chunk.start == 0:
                # Nothing cached: attend to the chunk's own (uncached-precision) K/V.
                ck, cv = k[rows], v[rows]
            else:
                ck = from_cache(flat_k[chunk.slots], q.dtype)  # (L, Hkv, D), L = start + num_tokens
                cv = from_cache(flat_v[chunk.slots], q.dtype)
            out[rows] = _causal_attention(q[rows], ck, cv, chunk.start, scale, window)
    return out


def _gathered_decode(
    q: torch.Tensor,  # (B, H, D), one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """(B, H, D): each sequence's query over its context rows, gathered by slot."""
    assert meta.decode_slots is not None
    b, h, d = q.shape
    n_kv, width = k_cache.shape[2], k_cache.shape[3]
    slots = meta.decode_slots  # (B, L)
    length = slots.shape[1]
    k = k_cache.view(-1, n_kv, width).index_select(0, slots.view(-1)).view(b, length, n_kv, width)  # (B, L, Hkv, W)
    v = v_cache.view(-1, n_kv, width).index_select(0, slots.view(-1)).view(b, length, n_kv, width)
    k, v = from_cache(k, q.dtype), from_cache(v, q.dtype)  # (B, L, Hkv, D)
    # GQA: the h // n_kv query heads of one kv head are that head's queries at one position
    qh = q.view(b, n_kv, h // n_kv, d)  # (B, Hkv, G, D)
    o = F.scaled_dot_product_attention(
        qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.window_mask(window), scale=scale
    )  # (B, Hkv, G, D)
    return o.reshape(b, h, d)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int = 0
) -> torch.Tensor:
    """q (T, H, D) at positions start..start+T-1 over k, v (L, Hkv, D) at 0..L-1, L = start + T."""
    t, h, _ = q.shape
    length, n_kv, _ = k.shape
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
    kh = k.transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa: dict[str, bool] = {}
    if n_kv != h:
        if _SDPA_GQA:  # SDPA reads each kv head for its query heads: no copy of K and V per head
            gqa["enable_gqa"] = True
        else:
            kh = kh.repeat_interleave(h // n_kv, dim=1)  # (1, H, L, D)
            vh = vh.repeat_interleave(h // n_kv, dim=1)
    windowed = 0 < window < length
    if start == 0 and not windowed:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, **gqa)
    else:
        # query i sits at position start + i and may see keys 0 .. start + i (the last `window`)
        qpos = torch.arange(start, start + t, device=q.device)[:, None]
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos  # (T, L)
        if windowed:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, **gqa)
    return o.squeeze(0).transpose(0, 1)  # (T, H, D)


_TILE_HEAD_DIMS = frozenset(range(32, 257, 32))


def _tiles_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int) -> torch.Tensor:
    """q (T, H, D) at positions start.. over k, v (L, Hkv, D): the causal attention on the tiles,
    softmax in float32 over each row's own keys, Q K^T and P V in bfloat16 with float32 sums."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    t, h, d = q.shape
    out = torch.empty_like(q)
    runtime.kernels().attn_tiles(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, h, k.shape[0],
                                 k.shape[1], d, start, window if 0 < window < k.shape[0] else 0, scale)
    return out


def _sdpa_takes_gqa() -> bool:
    """Whether this torch's SDPA takes grouped K/V heads itself (``enable_gqa``, torch 2.5+).
    On the CPU it then skips expanding K and V to every query head: a chunk of 31 tokens after
    4,623 cached ones (Qwen2.5-1.5B's 12 query and 2 kv heads) took 24 ms a layer against 44
    expanded, the outputs equal to the bit."""
    try:
        one = torch.zeros(1, 2, 1, 4)
        F.scaled_dot_product_attention(one, one[:, :1], one[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


_SDPA_GQA = _sdpa_takes_gqa()
