"""The q8_0 KV cache (int8 rows with an fp16 scale per token and kv head, `kv_quant`): its
layout and rounding, and every attention path over it - the torch reference (one step and
multi-step), the CPU engine's gathered decode, the Triton kernels in the CPU interpreter
(conftest.py) - against exact float64 attention over the dequantized cache. The native decode
step reads the same cache in tests/engine/test_kv_q8.py.

The cases are paged_cases' (NaN everywhere a kernel must not read), quantized: a NaN row
quantizes to a NaN scale, so a stray read still returns NaN.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import llmlocal.native.paged_attention as pa
from llmlocal.engine.model.attention import AttentionMetadata, paged_attention
from llmlocal.native.paged_attention.kv_quant import dequantize_q8, head_dim_of, quantize_q8

from paged_cases import STARTER, PagedCase, dense_attention, edge_lens, make_case, needs_triton, poison_before_window

# Over the dequantized cache the paths differ from float64 only by fp32 rounding (the scale
# multiplies a sum of int8 * fp32 products in one, each value in another).
TOL = dict(atol=2e-5, rtol=2e-5)


def quantized(case: PagedCase) -> PagedCase:
    """The case with q8_0 caches; its dense truth the dequantized K/V."""
    k_cache, v_cache = quantize_q8(case.k_cache), quantize_q8(case.v_cache)
    keys = [dequantize_q8(quantize_q8(k), torch.float64) for k in case.keys]
    values = [dequantize_q8(quantize_q8(v), torch.float64) for v in case.values]
    return PagedCase(case.q, k_cache, v_cache, case.block_tables, case.context_lens, keys, values, case.scale)


def check(out: Tensor, case: PagedCase, window: int = 0) -> None:
    assert not out.isnan().any(), "a masked or padding position was read"
    torch.testing.assert_close(out.double(), dense_attention(case, window).double(), **TOL)


# ---------------------------------------------------------------- layout and rounding


def test_rows_hold_int8_values_then_an_fp16_scale_per_32() -> None:
    x = torch.zeros(2, 64)  # (2 rows, D = 64): two groups a row
    x[0, :4] = torch.tensor([0.5, -1.27, 0.0, 0.00501])  # group 0: max 1.27
    x[0, 40] = 2.54  # group 1: max 2.54; row 1 stays zero
    rows = quantize_q8(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 64 + 4)
    d = rows[:, 64:].contiguous().view(torch.float16)  # (2, 2)
    assert d[0].tolist() == [torch.tensor(1.27 / 127, dtype=torch.float16).item(),
                             torch.tensor(2.54 / 127, dtype=torch.float16).item()]
    assert d[1].tolist() == [0.0, 0.0] and not rows[1, :64].any()
    assert rows[0, :4].tolist() == [50, -127, 0, 1] and rows[0, 40] == 127 and not rows[0, 4:40].any()
    assert head_dim_of(rows.view(1, 1, 2, 68)) == 64


def test_rounding_is_half_to_even_and_the_error_at_most_half_a_step() -> None:
    # max 31.75: d = 31.75 / 127 = 0.25 exactly, and x / d = 127, 2.5, 3.5, -2.5, -0.5, 1.5
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([31.75, 0.625, 0.875, -0.625, -0.125, 0.375])
    rows = quantize_q8(x)
    assert rows[0, 32:].contiguous().view(torch.float16).item() == 0.25
    assert rows[0, :6].tolist() == [127, 2, 4, -2, 0, 2]
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(512, 128, generator=gen) * torch.rand(512, 1, generator=gen) * 10
    err = (dequantize_q8(quantize_q8(big)) - big).unflatten(1, (4, 32)).abs().amax(dim=2)  # (512, 4 groups)
    step = big.unflatten(1, (4, 32)).abs().amax(dim=2) / 127
    assert bool((err <= step * 0.5 * (1 + 2**-10) + 1e-12).all())


# ---------------------------------------------------------------- torch paths vs float64


@pytest.mark.parametrize("heads", [(4, 4, 32), STARTER, (14, 2, 64), (12, 2, 128), (8, 4, 256)], ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("block_size", [8, 16])
def test_reference_decode_over_a_q8_cache_is_exact_attention_over_its_values(heads: tuple[int, int, int], block_size: int) -> None:
    case = quantized(make_case(edge_lens(block_size, 90), block_size, *heads))
    check(pa.paged_decode_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables,
                                              case.context_lens, case.scale), case)
    # the multi-step path: a step of two blocks at a time, then of whole short sequences
    for step_bytes in (2 * block_size * heads[1] * heads[2] * 4, 12 * block_size * heads[1] * heads[2] * 4):
        check(pa.paged_decode_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                  case.context_lens, case.scale, step_bytes=step_bytes), case)


@pytest.mark.parametrize("window", [5, 20])
def test_reference_decode_with_a_window_over_a_q8_cache(window: int) -> None:
    base = make_case([3, 40, 70], 8, *STARTER)
    poison_before_window(base, window)
    case = quantized(base)
    check(pa.paged_decode_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables,
                                              case.context_lens, case.scale, window=window), case, window)


def test_the_engines_cpu_paths_write_and_read_q8_as_the_reference() -> None:
    """The model's attention on a CPU: K/V of a step quantized into their slots, the decode rows
    gathered by slot and the prefill chunks' context both read as q * d."""
    gen = torch.Generator().manual_seed(1)
    n_heads, n_kv, hd, bs, nb = 9, 3, 64, 16, 8
    k_cache = torch.zeros(nb, bs, n_kv, hd + hd // 16, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    length = 37
    k = torch.randn(length, n_kv, hd, generator=gen)
    v = torch.randn(length, n_kv, hd, generator=gen)
    q = torch.randn(length, n_heads, hd, generator=gen)
    table = torch.tensor([5, 2, 7], dtype=torch.int32)
    slots = (table.long()[torch.arange(length) // bs] * bs + torch.arange(length) % bs)
    # a prefill of the first 20 tokens, then a chunk of 16 after them (reads its context from the cache)
    from llmlocal.engine.model.attention import PrefillChunk

    meta = AttentionMetadata(slot_mapping=slots[:20], prefills=[PrefillChunk(0, 20, 0, slots[:20])])
    paged_attention(q[:20], k[:20], v[:20], k_cache, v_cache, meta, hd**-0.5)
    meta = AttentionMetadata(slot_mapping=slots[20:36], prefills=[PrefillChunk(0, 16, 20, slots[:36])])
    chunk_out = paged_attention(q[20:36], k[20:36], v[20:36], k_cache, v_cache, meta, hd**-0.5)
    # the last token decoded: the CPU runner's gathered slots
    meta = AttentionMetadata(slot_mapping=slots[36:], num_decode=1, block_tables=table[None],
                             context_lens=torch.tensor([length], dtype=torch.int32), max_context_len=length,
                             decode_slots=slots[None].contiguous())
    decode_out = paged_attention(q[36:], k[36:], v[36:], k_cache, v_cache, meta, hd**-0.5)
    assert torch.equal(k_cache.view(-1, n_kv, hd + hd // 16)[slots], quantize_q8(k))
    assert torch.equal(v_cache.view(-1, n_kv, hd + hd // 16)[slots], quantize_q8(v))
    kd = dequantize_q8(quantize_q8(k), torch.float64).repeat_interleave(3, dim=1)  # (L, H, D)
    vd = dequantize_q8(quantize_q8(v), torch.float64).repeat_interleave(3, dim=1)
    for t, got in [*((20 + i, chunk_out[i]) for i in range(16)), (36, decode_out[0])]:
        p = torch.softmax((q[t].double()[:, None, :] @ kd[: t + 1].transpose(0, 1).transpose(1, 2))[:, 0] * hd**-0.5, -1)
        want = (p[:, None, :] @ vd[: t + 1].transpose(0, 1))[:, 0]  # (H, D)
        torch.testing.assert_close(got.double(), want, **TOL)


# ---------------------------------------------------------------- Triton (CPU interpreter)


@needs_triton
@pytest.mark.parametrize("heads", [STARTER, (14, 2, 64)], ids=lambda h: "x".join(map(str, h)))
def test_triton_write_quantizes_bit_for_bit_as_torch(heads: tuple[int, int, int]) -> None:
    _, n_kv, hd = heads
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(19, n_kv, hd, generator=gen) * 3
    key[4] = 0.0  # a zero row: scale 0, values 0
    value = torch.randn(19, n_kv, hd, generator=gen)
    slots = torch.randperm(6 * 8, generator=gen)[:19]
    slots[7] = -1  # a padded row writes nothing
    caches = [torch.full((6, 8, n_kv, hd + hd // 16), 55, dtype=torch.int8) for _ in range(4)]
    pa.write_kv_reference(key, value, caches[0], caches[1], slots)
    pa.write_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", [STARTER, (14, 2, 64), (12, 2, 128)], ids=lambda h: "x".join(map(str, h)))
def test_triton_decode_over_a_q8_cache_agrees_with_exact_attention_and_the_reference(
    heads: tuple[int, int, int], num_splits: int
) -> None:
    case = quantized(make_case(edge_lens(16, 100), 16, *heads))
    out = pa.paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale, num_splits=num_splits)
    check(out, case)
    ref = pa.paged_decode_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables,
                                              case.context_lens, case.scale)
    torch.testing.assert_close(out, ref, **TOL)


@needs_triton
def test_triton_decode_with_a_window_over_a_q8_cache() -> None:
    base = make_case([3, 40, 70], 8, *STARTER)
    poison_before_window(base, 20)
    case = quantized(base)
    check(pa.paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale, window=20), case, 20)
