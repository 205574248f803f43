"""INT4 GEMV over a column-major layout that skips the weights of zero activations (CPU, C).

    from llmlocal.native.cpu import SparseInt4Linear
    lin = SparseInt4Linear.from_codes(codes, scale, zero, group_size=32)
    y = lin(x, threshold=t)     # columns j with |x_j| <= t are not read; lin.sparsity says how many

GGUF's quantized types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) run in their own bytes
through `QuantLinear` (`qlayout.py`: decoding the blocks and the column-major layout;
`csrc/qmat*.c`: int8-activation kernels, sparse or in quads of columns for dense decoding).

The set: `layout.py` (the packed byte layout, built in numpy), `csrc/` (the C kernels: sparse,
dense and 2-8-row batch GEMV, a per-row INT8 GEMV for output heads (`Int8RowsLinear`), all
row-parallel on a persistent thread pool, AVX-512 / AVX2 / portable variants picked at load
time, and `DecodeStack`, a decoder's layers in one call), `reference.py` (numpy reference and error bound),
`bench.py` (GB/s; `python -m llmlocal.native.cpu.bench`). Settings: `runtime.py`.
"""

from __future__ import annotations

from .layout import PackedInt4, pack_int4
from .linear import Int8RowsLinear, QuantLinear, SparseInt4Linear
from .runtime import (
    KernelsUnavailableError,
    available_isas,
    best_isa,
    isa,
    kernels,
    num_threads,
    set_isa,
    set_num_threads,
    set_spin_us,
)

__all__ = [
    "Int8RowsLinear",
    "KernelsUnavailableError",
    "PackedInt4",
    "QuantLinear",
    "SparseInt4Linear",
    "available_isas",
    "best_isa",
    "isa",
    "kernels",
    "num_threads",
    "pack_int4",
    "set_isa",
    "set_num_threads",
    "set_spin_us",
]
