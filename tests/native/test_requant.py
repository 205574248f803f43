"""A draft model's tensors requantized to Q4_0 (`qlayout.requantize_q4_0`), against gguf-py's
dequantization of the file's blocks and of ours: each block's scale is its value of largest
magnitude over -8 (as fp16), and every value lies within half a step of the source (about a
whole step where it clamps at code 15)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType
from llmlocal.native.cpu import qlayout as ql
from llmlocal.native.cpu import runtime

from qmat_cases import gguf_blocks

pytestmark = pytest.mark.skipif(not runtime.built(), reason="the native kernels are not built")
WIDER = [t for t in ql.FORMATS if ql.wider_than_q4_0(t)]


def test_which_types_are_wider() -> None:
    assert {ql.FORMATS[t].name for t in WIDER} == {"Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K"}


def _dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType(qtype)), dtype=np.float64)


@pytest.mark.parametrize("qtype", list(ql.FORMATS), ids=[f.name for f in ql.FORMATS.values()])
def test_requantized_rows_are_within_half_a_step(qtype: int) -> None:
    n, k = 37, 512
    raw = gguf_blocks(qtype, n, k, seed=qtype)
    order = np.random.default_rng(1).permutation(n)  # rows in another order, as RoPE permutes them
    got = ql.requantize_q4_0(ql.QuantRows(qtype, raw, order, name="blk.0.ffn_up.weight"))
    assert got is not None and got.qtype == ql.Q4_0 and got.shape == (n, k) and got.name.endswith("@Q4_0")
    src = _dequantize(raw, qtype)[order].reshape(n, -1, 32)
    ours = _dequantize(got.raw, ql.Q4_0).reshape(n, -1, 32)
    d = got.raw.reshape(n, -1, 18)[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    # the scale: the block's signed value of largest magnitude over -8, rounded to fp16
    at = np.abs(src).argmax(axis=-1)[..., None]
    want_d = (np.take_along_axis(src, at, axis=-1)[..., 0] / -8).astype(np.float32).astype(np.float16)
    np.testing.assert_array_equal(d, want_d.astype(np.float64))
    step = np.abs(d)[..., None]
    err = np.abs(ours - src)
    clamped = src / np.where(d == 0, 1, d)[..., None] > 7.5  # nearest code 16: stored as 15
    assert (err[~clamped] <= 0.5 * step.repeat(32, -1)[~clamped] * (1 + 1e-6) + 1e-7).all()
    # at most a step where it clamps, and d's fp16 rounding: |max| <= 8 |d| (1 + 2^-11)
    assert (err <= step * (1 + 8 / 2048) * (1 + 1e-6) + 1e-7).all()
    assert clamped.mean() < 0.05


def test_blocks_of_nan_or_zero_give_zero_codes() -> None:
    raw = gguf_blocks(ql.Q8_0, 2, 64)
    blk = raw.reshape(2, -1, 34)
    blk[0, 0, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # an untrusted file's scale
    blk[1, 1, 2:] = 0
    got = ql.requantize_q4_0(ql.QuantRows(ql.Q8_0, raw))
    assert got is not None
    values = _dequantize(got.raw, ql.Q4_0)
    assert np.isfinite(values).all()
    assert (values[0, :32] == 0).all() and (values[1, 32:] == 0).all()
    assert (values[0, 32:] != 0).any()


def test_refuses_a_type_it_does_not_read() -> None:
    with pytest.raises(ValueError, match="not read"):
        runtime.kernels().requant_q4_0(0, np.zeros(1, np.uint64), 1, 32, np.zeros(18, np.uint8))
