"""INT8 weight-only matrix products on a GPU (a Triton kernel): output heads and other INT8
projections of the paged engine on CUDA. Importing this package does not import triton."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def int8_matmul(x: Tensor, codes: Tensor, scale: Tensor, **options: int) -> Tensor:
    """``x @ (codes * scale[:, None]).T`` for (M, K) x, (N, K) int8 codes and (N,) scales, in
    x's dtype; on CUDA tensors, or on the CPU under TRITON_INTERPRET=1. See `triton_int8`."""
    from .triton_int8 import int8_matmul as run

    return run(x, codes, scale, **options)
