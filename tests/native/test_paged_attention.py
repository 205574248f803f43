"""Paged attention: the torch reference against dense per-sequence attention, the Triton
kernels (CPU interpreter, see conftest.py) against the reference, and the dispatch.

Every cache is filled with NaN before the live tokens are written, and block-table padding
points at NaN blocks or out of range: a kernel that reads one position it should not read
returns NaN (the cases: paged_cases.py; the sliding-window cases: test_paged_attention_window.py).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch
from torch import Tensor

import llmlocal.native.paged_attention as pa

from paged_cases import (
    STARTER,
    assert_close,
    dense_attention,
    edge_lens,
    make_case,
    needs_triton,
    run_reference,
    run_triton,
)

# ---------------------------------------------------------------- reference vs dense attention


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "heads", [(4, 4, 32), STARTER, (8, 2, 64), (16, 2, 128), (32, 8, 64)], ids=lambda h: "x".join(map(str, h))
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_matches_dense(block_size: int, heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    case = make_case(edge_lens(block_size, 1000) + [37], block_size, *heads, dtype=dtype, seed=block_size)
    assert_close(run_reference(case), dense_attention(case))


@pytest.mark.parametrize("blocks_per_step", [0, 1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_in_small_steps(blocks_per_step: int, dtype: torch.dtype) -> None:
    # A tight budget makes the reference merge several steps with its online softmax:
    # 0 gives one sequence per step (all blocks), the others one sequence and a few blocks.
    block_size, (n_heads, n_kv, head_dim) = 16, STARTER
    block_bytes = block_size * n_kv * head_dim * 4
    lens = [300, 1, 17, 160, 33]
    case = make_case(lens, block_size, n_heads, n_kv, head_dim, dtype=dtype, seed=11)
    step_bytes = blocks_per_step * block_bytes if blocks_per_step else math.ceil(300 / block_size) * block_bytes
    out = pa.paged_decode_attention_reference(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale,
        step_bytes=step_bytes,
    )  # fmt: skip
    assert_close(out, dense_attention(case))


@pytest.mark.parametrize("padding", ["nan_block", "minus_one", "out_of_range"])
def test_reference_never_follows_padding(padding: str) -> None:
    case = make_case([5, 40, 16], 16, *STARTER, padding=padding)
    assert_close(run_reference(case), dense_attention(case))


def test_reference_max_context_len_hint() -> None:
    case = make_case([3, 70, 33], 16, *STARTER)
    expected = dense_attention(case)
    assert_close(run_reference(case, max_context_len=70), expected)
    # A wrong hint on the host is ignored: the exact maximum costs nothing there.
    assert_close(run_reference(case, max_context_len=10), expected)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_empty_batch(impl: str) -> None:
    if impl == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    case = make_case([4], 8, 4, 2, 16)
    fn = pa.paged_decode_attention_reference if impl == "reference" else pa.paged_decode_attention_triton
    out = fn(case.q[:0], case.k_cache, case.v_cache, case.block_tables[:0], case.context_lens[:0], 1.0)
    assert out.shape == (0, 4, 16)


def test_reference_mixed_q_and_cache_dtypes() -> None:
    case = make_case([9, 30], 8, 8, 2, 32, dtype=torch.bfloat16)
    case.q = case.q.float()
    assert_close(run_reference(case), dense_attention(case))


# ---------------------------------------------------------------- Triton decode vs reference


@needs_triton
@pytest.mark.parametrize(
    "block_size,heads,dtype",
    [
        (8, (4, 4, 32), torch.float32),  # GQA ratio 1
        (16, STARTER, torch.float32),  # ratio 3, group padded to 4
        (16, STARTER, torch.float16),
        (16, STARTER, torch.bfloat16),
        (32, (8, 2, 16), torch.float32),  # ratio 4
        (16, (8, 1, 32), torch.bfloat16),  # ratio 8
        (16, (6, 2, 40), torch.float16),  # head_dim not a power of two
    ],
    ids=lambda p: str(p).replace("torch.", "") if not isinstance(p, tuple) else "x".join(map(str, p)),
)
def test_triton_decode_matches_reference(block_size: int, heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    case = make_case(edge_lens(block_size, 3 * block_size + 5), block_size, *heads, dtype=dtype, seed=1)
    expected = run_reference(case)
    assert_close(run_triton(case, max_context_len=int(case.context_lens.max()), num_splits=1), expected)


@needs_triton
@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("use_dot", [False, True])
def test_triton_decode_context_splits(num_splits: int, use_dot: bool) -> None:
    # Sequence 1 is shorter than one split: its later splits are empty and must be skipped.
    case = make_case([150, 7, 64], 16, *STARTER, seed=2)
    out = run_triton(case, max_context_len=150, num_splits=num_splits, use_dot=use_dot, tile_n=16)
    assert_close(out, run_reference(case))


@needs_triton
def test_triton_decode_splits_long_context_by_default() -> None:
    from llmlocal.native.paged_attention.triton_decode import plan_splits

    case = make_case([700, 3], 32, 8, 1, 32, dtype=torch.float16, seed=3)
    # 2 (sequence, kv head) pairs cannot fill a GPU: the launcher splits the 700 tokens.
    assert plan_splits(700, 2, num_sms=16, tile_n=64).num_splits == 3
    # A full batch already fills the GPU; a short context is not worth splitting.
    assert plan_splits(2048, 32 * 8, num_sms=108, tile_n=64).num_splits == 1
    assert plan_splits(200, 1, num_sms=108, tile_n=64).num_splits == 1
    plan = plan_splits(5000, 4, num_sms=108, tile_n=32)
    assert plan.tokens_per_split % 32 == 0 and plan.num_splits * plan.tokens_per_split >= 5000
    assert_close(run_triton(case, max_context_len=700, tile_n=64), run_reference(case))


@needs_triton
def test_triton_decode_needs_no_max_context_len_and_survives_a_low_one() -> None:
    case = make_case([90, 20, 41], 8, *STARTER, seed=4)
    expected = run_reference(case)
    # Without a hint the table width bounds the context; with a low one the last split
    # still runs to each sequence's end.
    assert_close(run_triton(case, num_splits=2), expected)
    # Hint 40 -> two splits of 32 tokens: the 90-token sequence's second split takes 58.
    assert_close(run_triton(case, max_context_len=40, num_splits=2, tile_n=16), expected)


@needs_triton
@pytest.mark.parametrize("block_size,tile_n", [(32, 16), (8, 64)])
@pytest.mark.parametrize("padding", ["minus_one", "out_of_range"])
def test_triton_decode_tiles_and_padding(block_size: int, tile_n: int, padding: str) -> None:
    # Tiles smaller than a block, and tiles spanning several blocks.
    case = make_case([block_size + 3, 2 * block_size, 5], block_size, 8, 2, 32, padding=padding, seed=5)
    assert_close(run_triton(case, max_context_len=2 * block_size, tile_n=tile_n), run_reference(case))


@needs_triton
def test_triton_decode_dot_path_pads_the_group() -> None:
    # use_dot pads a group of 3 query heads to 16 rows; the padding rows must not be stored.
    case = make_case(edge_lens(16, 40), 16, *STARTER, dtype=torch.bfloat16, seed=6)
    assert_close(run_triton(case, max_context_len=40, use_dot=True, num_splits=1), run_reference(case))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_mma_path(dtype: torch.dtype, num_splits: int) -> None:
    # The cache's 16-bit values on the tensor cores (what CUDA runs for a bf16 or fp16 cache),
    # P in two 16-bit parts; here on float32 operands of the same values. Qwen2.5-1.5B's heads.
    case = make_case([12, 130, 1, 47], 16, 12, 2, 128, dtype=dtype, seed=11)
    expected = run_reference(case)
    assert_close(run_triton(case, max_context_len=130, use_dot=True, mma=True, num_splits=num_splits, tile_n=32),
                 expected)
    with pytest.raises(ValueError, match="mma needs"):
        run_triton(make_case([5], 16, 12, 2, 128, seed=1), use_dot=True, mma=True)  # a float32 cache


@needs_triton
def test_triton_decode_strided_q() -> None:
    # q as a view into a fused (B, H + 2 * n_kv, D) projection output.
    case = make_case([20, 9], 8, *STARTER, seed=7)
    qkv = torch.randn(2, 9 + 6, 64)
    qkv[:, :9] = case.q
    case.q = qkv[:, :9]
    assert not case.q.is_contiguous()
    assert_close(run_triton(case, max_context_len=20), run_reference(case))


@needs_triton
def test_triton_decode_rejects_bad_arguments() -> None:
    case = make_case([5], 8, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        pa.paged_decode_attention_triton(case.q[:, :3], case.k_cache, case.v_cache, case.block_tables,
                                         case.context_lens, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="int32"):
        pa.paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables.float(),
                                         case.context_lens, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="v_cache must match"):
        pa.paged_decode_attention_triton(case.q, case.k_cache, case.v_cache.half(), case.block_tables,
                                         case.context_lens, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="tile_n"):
        run_triton(case, tile_n=24)
    with pytest.raises(ValueError, match="num_splits"):
        run_triton(case, num_splits=0)
    with pytest.raises(ValueError, match="window"):
        run_triton(case, window=-1)


# ---------------------------------------------------------------- write_kv


def make_write_case(cache_dtype: torch.dtype, key_dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, n_kv, head_dim = 6, 8, 3, 64
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[[1, 4, 9]] = -1  # padded rows: skipped
    key = torch.randn(10, n_kv, head_dim, generator=gen).to(key_dtype)
    value = torch.randn(10, n_kv, head_dim, generator=gen).to(key_dtype)
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_kv_reference_writes_slots(cache_dtype: torch.dtype) -> None:
    key, value, k_cache, v_cache, slots = make_write_case(cache_dtype, torch.float32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    pa.write_kv_reference(key, value, k_cache, v_cache, slots)
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], key[i].to(cache_dtype))
            assert torch.equal(v_cache[slot // block_size, slot % block_size], value[i].to(cache_dtype))
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool).flatten()
    untouched[slots[slots >= 0]] = False
    untouched = untouched.view(k_cache.shape[:2])
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@needs_triton
@pytest.mark.parametrize(
    "cache_dtype,key_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.bfloat16, torch.float32), (torch.float16, torch.float32)],  # fmt: skip
    ids=str,
)
def test_write_kv_triton_matches_reference(cache_dtype: torch.dtype, key_dtype: torch.dtype) -> None:
    key, value, k_cache, v_cache, slots = make_write_case(cache_dtype, key_dtype, seed=1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pa.write_kv_reference(key, value, k_ref, v_ref, slots)
    pa.write_kv_triton(key, value, k_cache, v_cache, slots)
    if (key_dtype, cache_dtype) == (torch.float32, torch.bfloat16):
        # Triton's CPU interpreter truncates fp32 -> bf16 where torch and the GPU round to
        # nearest: allow one bf16 unit in the last place (the cuda test below is exact).
        ulp = dict(atol=0.0, rtol=2.0**-7)
        torch.testing.assert_close(k_cache, k_ref, **ulp)
        torch.testing.assert_close(v_cache, v_ref, **ulp)
    else:
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_triton
def test_write_kv_then_decode() -> None:
    # The engine's order: write the current token's K/V, then attend over the whole context.
    case = make_case([12, 30], 8, *STARTER, seed=8)
    new_k, new_v = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    slots = []
    for b in range(2):
        n = int(case.context_lens[b])
        slots.append(int(case.block_tables[b, n // 8]) * 8 + n % 8)
        case.keys[b] = torch.cat([case.keys[b], new_k[b : b + 1]])
        case.values[b] = torch.cat([case.values[b], new_v[b : b + 1]])
    pa.write_kv_triton(new_k, new_v, case.k_cache, case.v_cache, torch.tensor(slots))
    case.context_lens += 1
    assert_close(run_triton(case, max_context_len=31), dense_attention(case))


@needs_triton
def test_write_kv_rejects_bad_arguments() -> None:
    key, value, k_cache, v_cache, slots = make_write_case(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="key must be"):
        pa.write_kv_triton(key[:, :2], value[:, :2], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        pa.write_kv_triton(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="contiguous"):
        pa.write_kv_triton(key, value, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots)


# ---------------------------------------------------------------- dispatch


@needs_triton
def test_dispatch_runs_the_interpreted_kernels() -> None:
    from llmlocal.native.paged_attention import triton_decode, triton_write_kv

    assert pa.backend_for(torch.zeros(1)) == "triton"
    decode_kernel, _ = triton_decode.jitted_kernels(True)
    assert type(decode_kernel).__name__ == "InterpretedFunction"
    assert type(triton_write_kv.jitted_kernel(True)).__name__ == "InterpretedFunction"

    case = make_case([10, 3], 8, 4, 2, 16, seed=9)
    before = triton_decode.jitted_kernels.cache_info()
    out = pa.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                    case.scale, 10)  # fmt: skip
    after = triton_decode.jitted_kernels.cache_info()
    assert after.hits + after.misses == before.hits + before.misses + 1, "the dispatcher did not launch Triton"
    assert_close(out, run_reference(case))

    key, value, k_cache, v_cache, slots = make_write_case(torch.float16, torch.float16)
    before = triton_write_kv.jitted_kernel.cache_info()
    pa.write_kv(key, value, k_cache, v_cache, slots)
    after = triton_write_kv.jitted_kernel.cache_info()
    assert after.hits + after.misses == before.hits + before.misses + 1


def test_dispatch_uses_the_reference_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    assert pa.backend_for(torch.zeros(1)) == "torch"
    case = make_case([10, 3], 8, 4, 2, 16, seed=10)
    out = pa.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                    case.scale)  # fmt: skip
    assert torch.equal(out, run_reference(case))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_kernels_match_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiled kernels on the GPU: the launcher's own choices (splits, tl.dot for groups of 8).
    monkeypatch.delenv("TRITON_INTERPRET")
    for lens, block_size, heads in [
        (edge_lens(16, 2000), 16, STARTER),
        ([1, 300, 4097], 32, (32, 8, 64)),
        ([513, 7], 16, (32, 4, 128)),
    ]:
        case = make_case(lens, block_size, *heads, dtype=dtype)
        expected = run_reference(case)
        expected_window = run_reference(case, window=100)
        for name in ("q", "k_cache", "v_cache", "block_tables", "context_lens"):
            setattr(case, name, getattr(case, name).cuda())
        assert_close(run_triton(case, max_context_len=max(lens)).cpu(), expected)
        assert_close(run_triton(case).cpu(), expected)
        assert_close(run_triton(case, max_context_len=max(lens), window=100).cpu(), expected_window)

    key, value, k_cache, v_cache, slots = make_write_case(dtype, torch.float32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pa.write_kv_reference(key, value, k_ref, v_ref, slots)
    args = [t.cuda() for t in (key, value, k_cache, v_cache, slots)]
    pa.write_kv(*args)
    assert torch.equal(args[2].cpu(), k_ref) and torch.equal(args[3].cpu(), v_ref)


def test_import_does_not_import_triton() -> None:
    code = "import sys, llmlocal.native.paged_attention; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
