"""The gated MLP activation made natively (csrc/glu_body.h): `kernels().glu`, the pass the native
decode step runs, and `QMatrix.gemv_glu`, the int8 kernels' fused gate/up projection that makes
act(gate x) * (up x) as their threads finish each piece of rows (prompt rows).

References: float64 of the same formula (silu, and Gemma's gelu with the tanh approximation
written as torch writes it), and, for the fused projection, the unfused product in the same
kernels followed by the same pass: the fusion may not change a bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llmlocal.native.cpu import kernels
from llmlocal.native.cpu import qlayout as ql
from llmlocal.native.cpu.linear import QuantLinear
from qmat_cases import gguf_blocks


def reference(gate: np.ndarray, up: np.ndarray, activation: int) -> np.ndarray:
    g = torch.from_numpy(gate).double()
    act = torch.nn.functional.silu(g) if activation == 0 else torch.nn.functional.gelu(g, approximate="tanh")
    return (act * torch.from_numpy(up).double()).numpy()


@pytest.mark.parametrize("activation", [0, 1], ids=["silu", "gelu-tanh"])
def test_glu_against_float64(isa: str, activation: int) -> None:
    rng = np.random.default_rng(activation)
    for n, ffn in [(1, 1), (3, 37), (2, 1000)]:  # tails shorter than a vector
        gu = (rng.standard_normal((n, 2 * ffn)) * 4).astype(np.float32)
        if ffn >= 4:
            gu[0, :4] = [0.0, -90.0, 90.0, -1e-30]  # zero, both saturations, a denormal
        out = np.full((n, ffn), np.nan, dtype=np.float32)
        kernels().glu(gu, out, n, ffn, activation)
        ref = reference(gu[:, :ffn], gu[:, ffn:], activation)
        # a few float32 roundings of a value of |act| <= |g|: relative to |g u| plus a tiny floor
        bound = 4e-7 * np.abs(gu[:, :ffn].astype(np.float64) * gu[:, ffn:]) + 1e-30
        assert np.all(np.abs(out - ref) <= bound), (n, ffn, np.max(np.abs(out - ref) - bound))


@pytest.mark.parametrize("qtype", [ql.Q4_K, ql.Q6_K, ql.Q8_0, ql.Q5_0], ids=["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_the_fused_projection_changes_no_bit(isa: str, qtype: int) -> None:
    """gemv_glu's rows equal glu over gemv's (B, 2 f), for every row count a call takes and a
    second piece of rows (f = 160: two units of the threads' split)."""
    rng = np.random.default_rng(qtype)
    for f, k in [(96, 256), (160, 512)]:
        raw = gguf_blocks(qtype, 2 * f, k, seed=f)
        lin = QuantLinear([ql.QuantRows(qtype, raw)], interleaved=True)
        for batch in (1, 3, 17, 64, 70):
            x = torch.from_numpy(rng.standard_normal((batch, k)).astype(np.float32))
            for activation in (0, 1):
                fused = lin.gated(x, activation)
                product = lin.forward(x)
                unfused = torch.empty(batch, f)
                kernels().glu(product.data_ptr(), unfused.data_ptr(), batch, f, activation)
                assert fused is not None and torch.equal(fused, unfused), (f, k, batch, activation)


def test_the_fused_projection_is_refused_where_it_cannot_run() -> None:
    qtype = ql.Q4_K
    columns = QuantLinear([ql.QuantRows(qtype, gguf_blocks(qtype, 192, 256))], interleaved=False)
    x = torch.zeros(2, 256)
    assert columns.gated(x, 0) is None  # the column layout (sparse files): the caller's own pass
    odd = QuantLinear([ql.QuantRows(qtype, gguf_blocks(qtype, 2 * 48, 256))], interleaved=True)
    assert odd.gated(x, 0) is None  # f = 48: not whole chunks of 32
    for lin, f in ((columns, 96), (odd, 48)):
        with pytest.raises(ValueError, match="interleaved layout of 2 f rows, f a multiple of 32"):
            lin.matrices[0].gemv_glu(x.numpy(), np.zeros((2, f), np.float32), 2, 256, f, 0)
    good = QuantLinear([ql.QuantRows(qtype, gguf_blocks(qtype, 128, 256))], interleaved=True)
    with pytest.raises(ValueError, match="activation 0 or 1"):
        good.matrices[0].gemv_glu(x.numpy(), np.zeros((2, 64), np.float32), 2, 256, 64, 2)
