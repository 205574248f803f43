"""Linear layers of the native CPU path (backend `sparse`, and `paged` on the CPU in fp32):
INT4 GEMV through the native kernels that skip the weight columns of small inputs, a
thresholding wrapper for projections that are not INT4, and the INT8 output head through the
native INT8 GEMV.

Each projection input x gets its layer's calibrated threshold t (see `model/sparsity.py`):
x_j with |x_j| <= t counts as zero, so column j of the weight is never read. t = 0 (or None)
runs the dense kernel: every column, same arithmetic.

Every layer counts the weight it was asked to multiply and the part it skipped; the backend
sums these into `Stats.achieved_sparsity` (the share of projection weight reads skipped,
the figure decode speed follows).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from llmlocal.native.cpu import Int8RowsLinear, SparseInt4Linear
from llmlocal.native.cpu.linear import QuantLinear
from llmlocal.native.cpu.pack_ahead import PackAhead
from llmlocal.native.cpu.qlayout import QuantCodes, QuantRows

from .gguf_tensors import Int4Codes
from .linear import Int8Linear
from .sparsity import threshold_activations


class _Counted(nn.Module):
    """Weight entries asked for and skipped since the last `reset_counts`."""

    in_features: int
    out_features: int

    def __init__(self) -> None:
        super().__init__()
        self.threshold: float | None = None
        self.total = 0
        self.skipped = 0

    def reset_counts(self) -> None:
        self.total = self.skipped = 0


class SparseInt4Projection(_Counted):
    """y = W x' + b, W INT4 in the kernels' column-major layout (repacked once at load).

    With ``timed`` set, also sums the seconds spent in the kernel and the weight bytes it
    read (the benchmark's kernel bandwidth)."""

    timed = False

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kernel = SparseInt4Linear.from_codes(codes.codes, codes.scale, codes.zero, codes.group_size)
        self.in_features, self.out_features = self.kernel.in_features, self.kernel.out_features
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.seconds = 0.0
        self.bytes_read = 0

    def reset_counts(self) -> None:
        super().reset_counts()
        self.seconds, self.bytes_read = 0.0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        x2 = x2.contiguous()
        t = self.threshold if self.threshold else None  # 0 or None: the dense kernel
        kernel = self.kernel
        start = time.perf_counter() if self.timed else 0.0
        y = kernel(x2, t)
        self._count(x2.shape[0], start)
        k, n = self.in_features, self.out_features
        if t is not None:
            # each row skips the columns it zeroed: with one row (decode) exactly the reads
            # saved; a multi-row chunk reads the union of its rows' columns
            self.skipped += (x2.shape[0] * k - kernel.rows_kept) * n
        if self.bias is not None:
            y = y + self.bias
        if x.dim() != 2:
            y = y.reshape(*shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _count(self, rows: int, start: float) -> None:
        """A call of ``rows`` rows begun at ``start`` (timed): the weight asked for, and with
        ``timed`` the kernel's seconds and the weight bytes it read."""
        if self.timed:
            self.seconds += time.perf_counter() - start
            self.bytes_read += self.kernel.weight_bytes() * self.kernel.columns_read // self.in_features
        self.total += rows * self.in_features * self.out_features

    def weight_bytes(self) -> int:
        return self.kernel.weight_bytes()


class QuantProjection(SparseInt4Projection):
    """y = W x' + b, W in its GGUF types (Q4_K, Q6_K, Q5_0, Q8_0, ...) in their own bytes, through
    the int8-activation kernels (`QuantLinear`); parts stacked by rows (fused q/k/v, gate/up).
    `interleaved` (dense decoding) stores columns in quads: faster, but no column is skipped."""

    def __init__(self, parts: list[QuantCodes | QuantRows], bias: torch.Tensor | None = None, interleaved: bool = False,
                 ahead: PackAhead | None = None) -> None:
        _Counted.__init__(self)
        self.kernel = QuantLinear(parts, interleaved, ahead)  # type: ignore[assignment]
        self.in_features, self.out_features = self.kernel.in_features, self.kernel.out_features
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.seconds = 0.0
        self.bytes_read = 0

    def gated(self, x: torch.Tensor, activation: int) -> torch.Tensor | None:
        """act(gate x) * (up x) of a fused gate/up projection, made by the kernels
        (`QuantLinear.gated`), or None where they do not make it (a threshold, a bias, halves of
        different types, tiles): the caller projects and applies the activation itself."""
        if self.threshold or self.bias is not None or x.dim() != 2 or x.dtype != torch.float32:
            return None
        start = time.perf_counter() if self.timed else 0.0
        y = self.kernel.gated(x.contiguous(), activation)  # type: ignore[attr-defined]
        if y is not None:
            self._count(x.shape[0], start)
        return y


class ThresholdedLinear(_Counted):
    """Any linear layer with its input thresholded in torch: the same numbers as the kernels,
    no skipped reads (for projections stored in a format the kernels do not read, such as
    the Q6_K tensors of a Q4_K_M file)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        weight = getattr(inner, "weight", None)
        if weight is None:
            weight = getattr(inner, "qweight", None)
        self.in_features = int(getattr(inner, "in_features", 0) or weight.shape[1])  # type: ignore[union-attr]
        self.out_features = int(inner.out_features)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.threshold:
            x = threshold_activations(x, self.threshold)
        self.total += x.numel() * self.out_features
        return self.inner(x)

    def weight_bytes(self) -> int:
        return self.inner.weight_bytes()  # type: ignore[operator]


SparseProjection = SparseInt4Projection | QuantProjection | ThresholdedLinear


class NativeInt8Linear(Int8Linear):
    """An `Int8Linear` (per-row INT8, an output head) through the native INT8 GEMV: fp32
    activations and logits, the same thread pool as the INT4 kernels (torch's int8 matmul
    wants bf16 activations, and its own threads fight the pool's for the two cores)."""

    @classmethod
    def of(cls, layer: Int8Linear) -> NativeInt8Linear:
        """The same weight, scales and bias (shared, not copied) through the kernel."""
        native = cls.__new__(cls)
        nn.Module.__init__(native)
        native.register_buffer("qweight", layer.qweight, persistent=False)
        native.register_buffer("scale", layer.scale, persistent=False)
        native.bias = layer.bias
        native.out_features = layer.out_features
        native._scale32 = layer.scale.float().contiguous().numpy()  # the kernel's scales (kept alive)
        native.kernel = Int8RowsLinear(layer.qweight.numpy(), native._scale32)
        return native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        y = self.kernel(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)
