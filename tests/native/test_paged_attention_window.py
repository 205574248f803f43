"""Sliding-window paged decode attention: the torch reference, the Triton kernels (CPU
interpreter, see conftest.py) and the dispatch against dense attention over the last W
positions, with every position before each window poisoned with NaN (and the table entries of
blocks wholly before it pointed out of range), so that reading one of them fails the test."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import llmlocal.native.paged_attention as pa

from paged_cases import (
    STARTER,
    assert_close,
    dense_attention,
    edge_lens,
    make_case,
    needs_triton,
    poison_before_window,
    run_reference,
    run_triton,
)


# Windows: a single token, smaller than a block, spanning several blocks, past every context.
WINDOWS = [1, 5, 21, 2000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "heads,dtype",
    [(STARTER, torch.float32), ((8, 2, 64), torch.float16), ((4, 4, 32), torch.bfloat16)],
    ids=lambda p: str(p).replace("torch.", "") if not isinstance(p, tuple) else "x".join(map(str, p)),
)
def test_reference_window_matches_dense(
    window: int, block_size: int, heads: tuple[int, int, int], dtype: torch.dtype
) -> None:
    case = make_case(edge_lens(block_size, 1000) + [37], block_size, *heads, dtype=dtype, seed=20 + block_size)
    expected = dense_attention(case, window)
    poison_before_window(case, window)
    assert_close(run_reference(case, window=window), expected)
    assert_close(run_reference(case, max_context_len=1000, window=window), expected)


@pytest.mark.parametrize("budget_blocks", [1, 2, 6, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_reference_window_in_small_steps(budget_blocks: int, dtype: torch.dtype) -> None:
    # A window of 50 with 16-token blocks spans at most 5 blocks: budgets of 1 and 2 blocks
    # split one sequence's window into steps, 6 and 10 take one and two whole windows a step.
    block_size, (n_heads, n_kv, head_dim), window = 16, STARTER, 50
    block_bytes = block_size * n_kv * head_dim * 4
    case = make_case([300, 1, 17, 160, 33, 58], block_size, n_heads, n_kv, head_dim, dtype=dtype, seed=21)
    expected = dense_attention(case, window)
    poison_before_window(case, window)
    out = run_reference(case, window=window, step_bytes=budget_blocks * block_bytes)
    assert_close(out, expected)


def test_reference_rejects_a_negative_window() -> None:
    case = make_case([5], 8, 4, 2, 16)
    with pytest.raises(ValueError, match="window"):
        run_reference(case, window=-1)



@needs_triton
@pytest.mark.parametrize("window", [1, 3, 21, 500])
@pytest.mark.parametrize(
    "block_size,heads,dtype",
    [
        (8, (4, 4, 32), torch.float32),  # GQA ratio 1
        (16, STARTER, torch.float32),  # ratio 3
        (16, STARTER, torch.float16),
        (16, (8, 2, 16), torch.float16),  # ratio 4
    ],
    ids=lambda p: str(p).replace("torch.", "") if not isinstance(p, tuple) else "x".join(map(str, p)),
)
def test_triton_decode_window_matches_dense(
    window: int, block_size: int, heads: tuple[int, int, int], dtype: torch.dtype
) -> None:
    case = make_case(edge_lens(block_size, 3 * block_size + 5) + [2 * block_size + 11], block_size, *heads,
                     dtype=dtype, seed=22)  # fmt: skip
    expected = dense_attention(case, window)
    poison_before_window(case, window)
    out = run_triton(case, max_context_len=int(case.context_lens.max()), window=window, num_splits=1)
    assert_close(out, expected)
    assert_close(run_reference(case, window=window), expected)


@needs_triton
@pytest.mark.parametrize("window", [10, 100])
@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("use_dot", [False, True])
def test_triton_decode_window_context_splits(window: int, num_splits: int, use_dot: bool) -> None:
    # 16-token tiles in 32-token blocks: for the sequences of 64 and 120 tokens (and 150 with
    # the window of 100) the window starts in the second tile of its first block, and the
    # walk starts there. Splits divide the walked part; the 7-token sequence fills one split.
    case = make_case([150, 7, 64, 120], 32, *STARTER, seed=23)
    expected = dense_attention(case, window)
    poison_before_window(case, window)
    out = run_triton(case, max_context_len=150, window=window, num_splits=num_splits, use_dot=use_dot, tile_n=16)
    assert_close(out, expected)


@needs_triton
def test_triton_decode_window_tiles_span_blocks_and_splits_by_default() -> None:
    from llmlocal.native.paged_attention.triton_decode import plan_splits

    # 64-token tiles over 8-token blocks: the walk starts at the window's first block.
    for window in (3, 20):
        case = make_case([11, 16, 5, 70, 61], 8, 8, 2, 32, padding="minus_one", seed=24)
        expected = dense_attention(case, window)
        poison_before_window(case, window)
        assert_close(run_triton(case, max_context_len=70, window=window, tile_n=64), expected)
        # No hint: the table width bounds the context.
        assert_close(run_triton(case, window=window, num_splits=2, tile_n=16), expected)

    # The launcher sizes its splits to the window, not the context: 700 tokens would get 3
    # splits, a window of 300 in 32-token blocks walks at most 331 tokens and gets 2.
    assert plan_splits(min(700, 300 + 32 - 1), 2, num_sms=16, tile_n=64).num_splits == 2
    case = make_case([700, 3, 333], 32, 8, 1, 32, dtype=torch.float16, seed=25)
    expected = dense_attention(case, 300)
    poison_before_window(case, 300)
    assert_close(run_triton(case, max_context_len=700, window=300, tile_n=64), expected)


@pytest.mark.parametrize("interpret", [True, False])
def test_dispatch_passes_the_window(interpret: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if interpret and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if not interpret:
        monkeypatch.delenv("TRITON_INTERPRET")
    case = make_case([10, 3, 27], 8, 4, 2, 16, seed=12)
    expected = dense_attention(case, 6)
    poison_before_window(case, 6)
    out = pa.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                    case.scale, 27, window=6)  # fmt: skip
    assert_close(out, expected)
