"""`SparseInt4Linear`: one packed INT4 weight and its sparse / dense GEMV.

    lin = SparseInt4Linear.from_codes(codes, scale, zero, group_size=32)   # Int4Codes' arrays
    y = lin(x, threshold=0.1)        # x (K,) or (B, K) float32, torch (CPU) or numpy
    lin.kept_columns, lin.sparsity   # of that call: columns read, fraction skipped
    y = lin(x)                       # dense: every column, through the same kernel

Inputs with |x_j| <= threshold count as zero and their weight columns are not read. With a
batch (B rows, e.g. speculative verification) a column is read once when any row keeps it;
`kept_per_row()` gives each row's own count. More than 8 rows run in chunks of 8 (each chunk
reads the weight once; `kept_columns` is then the largest chunk's, `kept_per_row` the last
chunk's). Over the whole call, `rows_kept` sums every row's own count (the row-level
sparsity) and `columns_read` every chunk's union (the bytes actually read).
From 48 rows on (torch tensors: prefill), the product is torch's GEMM on the weight
dequantized in tiles, which reads every column: faster than decoding the codes for every 8
rows, and the same products up to the order of the sums.
No copies: x must be a C-contiguous float32 array (torch CPU tensor or numpy); the result
(or `out`, if given: float32, C-contiguous, shape (N,) or (B, N)) has x's type.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from .layout import PackedInt4, ScaleDtype, pack_int4
from .pack_ahead import PackAhead, type_runs
from .qlayout import PackedQuant, QuantCodes, QuantRows, pack, pack_rows
from .runtime import kernels

MAX_BATCH = 8
# From this many rows (prefill) torch's GEMM on the dequantized weight beats the GEMV, which
# decodes the codes again for every 8 rows (measured on the starter's shapes: 128 rows, 3.3 ms
# vs 1.6 ms including the dequantization; 32 rows, 0.9 ms vs 0.8 ms).
MATMUL_MIN_ROWS = 48
MATMUL_TILE_BYTES = 4 << 20  # dequantized weight per GEMM: a tile of output rows stays in cache
_scratch = threading.local()
# Rows of a call from this one on are a prompt's (prefill), set by the engine for a step:
# None, every row is a decode row. See `prompt_rows`.
_PROMPT_FROM: ContextVar[int | None] = ContextVar("llmlocal_prompt_rows_from", default=None)
# A draft model's chunks take the AMX-BF16 tiles from this many rows (`ModelRunner`'s
# `prompt_chunk_min`; a target's prompt rows take them in any number, for a prompt's numbers
# not to depend on its chunks): each call dequantizes the whole weight (the 1.5B's in about
# 0.12 s on two threads). Against the int8 kernels on the 1.5B's layers: 16 rows 0.89x,
# 32 rows 1.32x, 64 rows 1.73x.
TILES_MIN_ROWS = 16


@contextmanager
def prompt_rows(first: int) -> Iterator[None]:
    """Within this block, rows ``first`` on of every `QuantLinear` call are prompt rows: on a CPU
    with AMX-BF16 tiles (`runtime.qmat_tiles`) they are computed with the weight dequantized to
    bfloat16 and x rounded to bfloat16 (sums in float32), 3-4x closer to the exact product than
    int8 activations and 1.5-3.5x faster at 512 rows. Decode rows keep the int8 kernels, so a
    decoded token's numbers do not depend on the prompts beside it."""
    token = _PROMPT_FROM.set(first)
    try:
        yield
    finally:
        _PROMPT_FROM.reset(token)


def prompt_rows_from() -> int | None:
    """The first prompt row of the step being computed (`prompt_rows`), or None."""
    return _PROMPT_FROM.get()


class SparseInt4Linear:
    """y = W x for a weight (N out, K in) stored as 4-bit codes with per-group factors."""

    def __init__(self, packed: PackedInt4) -> None:
        self.packed = packed
        self.in_features = packed.k
        self.out_features = packed.n
        self._matrix = kernels().Matrix(packed.codes, packed.sz, packed.n, packed.k, packed.group_size, packed.sz_f16)
        self._counts = np.zeros(MAX_BATCH, dtype=np.int32)  # per-row kept counts of the last call
        self._counts_ptr = self._counts.ctypes.data
        self._last_batch = 0
        self.kept_columns = -1  # columns read by the last call (union over its rows); -1 before any
        self.rows_kept = 0  # the last call: sum over rows of the inputs each kept
        self.columns_read = 0  # the last call: sum over 8-row chunks of the columns read

    @classmethod
    def from_codes(
        cls,
        codes: Any,
        scale: Any,
        zero: Any,
        group_size: int = 32,
        scale_dtype: ScaleDtype = "auto",
    ) -> SparseInt4Linear:
        """From (N, K) codes in [0, 15] and (N, K // group_size) scale and zero (numpy or torch),
        W = (codes - 8) * scale + zero; repacks once (see layout.py)."""
        return cls(pack_int4(_numpy(codes), _numpy(scale), _numpy(zero), group_size, scale_dtype))

    @classmethod
    def from_int4(cls, w: Any, scale_dtype: ScaleDtype = "auto") -> SparseInt4Linear:
        """From an object with `codes`, `scale`, `zero`, `group_size` (the engine's Int4Codes)."""
        return cls.from_codes(w.codes, w.scale, w.zero, w.group_size, scale_dtype)

    @property
    def sparsity(self) -> float:
        """Fraction of columns the last call skipped (0.0 before any call)."""
        return 0.0 if self.kept_columns < 0 else 1.0 - self.kept_columns / self.in_features

    def kept_per_row(self) -> list[int]:
        """Inputs each row of the last call kept (its own count, not the union)."""
        return self._counts[: self._last_batch].tolist()

    def weight_bytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: Any, threshold: float | None = None, out: Any = None) -> Any:
        return self.forward(x, threshold, out)

    def forward(self, x: Any, threshold: float | None = None, out: Any = None) -> Any:
        """y = W x' where x' zeroes |x_j| <= threshold (None: dense). x (K,) or (B, K)."""
        k, n = self.in_features, self.out_features
        if isinstance(x, np.ndarray):
            # the kernel checks the buffers' format, contiguity and size
            if out is None:
                out = np.empty(x.shape[:-1] + (n,), dtype=np.float32)
            elif out.shape != x.shape[:-1] + (n,):
                raise ValueError(f"out must have shape {x.shape[:-1] + (n,)}, not {out.shape}")
            px, py = x, out
        else:
            f32 = _torch_float32()
            if x.dtype is not f32 or not x.is_cpu or not x.is_contiguous():
                raise ValueError(f"x must be a contiguous float32 CPU tensor, got {x.dtype} on {x.device}")
            if out is None:
                out = x.new_empty(x.shape[:-1] + (n,))
            elif out.dtype is not f32 or not out.is_cpu or not out.is_contiguous() or out.shape != x.shape[:-1] + (n,):
                raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {tuple(x.shape[:-1]) + (n,)}")
            px, py = x.data_ptr(), out.data_ptr()
        if x.ndim == 1:
            batch = 1
        elif x.ndim == 2:
            batch = x.shape[0]
        else:
            batch = -1
        if batch < 0 or x.shape[-1] != k:
            raise ValueError(f"x must be ({k},) or (B, {k}), got {tuple(x.shape)}")
        dense = threshold is None
        t = 0.0 if dense else threshold
        if 0 < batch <= MAX_BATCH:
            self.kept_columns = self._matrix.gemv(px, py, batch, k, n, t, dense, self._counts_ptr)
            self._last_batch = batch
            self.columns_read = self.kept_columns
            self.rows_kept = batch * k if dense else int(self._counts[:batch].sum())
        elif batch >= MATMUL_MIN_ROWS and not isinstance(x, np.ndarray):
            self._matmul(x, out, t, dense)
        elif batch > MAX_BATCH:
            self._forward_chunks(x, out, batch, t, dense)
        return out

    def _matmul(self, x: Any, out: Any, t: float, dense: bool) -> None:
        """out = x' W^T by torch's GEMM on the dequantized weight, a tile of output rows at a
        time (every column is read: ``columns_read`` counts them all)."""
        import torch

        k, n, npad = self.in_features, self.out_features, self.packed.npad
        x, self.rows_kept = _thresholded(x, t, dense)
        tile = max(32, min(npad, MATMUL_TILE_BYTES // (4 * k) // 32 * 32))
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < k * tile:
            buf = _scratch.buf = torch.empty(k * tile, dtype=torch.float32)
        for r0 in range(0, n, tile):
            r1 = min(npad, r0 + tile)
            w = buf[: k * (r1 - r0)].view(k, r1 - r0)
            self._matrix.dequantize(w.data_ptr(), r0, r1, r1 - r0)
            c1 = min(n, r1)
            if r0 == 0 and c1 == n:
                torch.mm(x, w[:, :n], out=out)
            else:
                out[:, r0:c1] = x @ w[:, : c1 - r0]
        self.kept_columns = self.columns_read = k
        self._last_batch = 0

    def _forward_chunks(self, x: Any, out: Any, batch: int, t: float, dense: bool) -> None:
        k, n = self.in_features, self.out_features
        kept = read = rows = 0
        for b0 in range(0, batch, MAX_BATCH):
            bb = min(MAX_BATCH, batch - b0)
            xb, yb = x[b0 : b0 + bb], out[b0 : b0 + bb]  # contiguous row ranges: views, no copies
            if not isinstance(x, np.ndarray):
                xb, yb = xb.data_ptr(), yb.data_ptr()
            chunk = self._matrix.gemv(xb, yb, bb, k, n, t, dense, self._counts_ptr)
            kept, read = max(kept, chunk), read + chunk
            rows += bb * k if dense else int(self._counts[:bb].sum())
            self._last_batch = bb
        self.kept_columns, self.columns_read, self.rows_kept = kept, read, rows


QM_MAX_BATCH = 64  # rows of x per QMatrix call (csrc/qmat.h)


def _pack(parts: list[QuantCodes | QuantRows], interleaved: bool, ahead: PackAhead | None = None) -> PackedQuant:
    """One matrix of stacked parts of one type: the file's rows packed in one pass where they
    can be (or taken from ``ahead`` if it packed them)."""
    if interleaved and all(isinstance(p, QuantRows) for p in parts):
        rows: list[QuantRows] = parts  # type: ignore[assignment]
        packed = (ahead.take(rows) if ahead is not None else None) or pack_rows(rows)
        if packed is not None:
            return packed
    codes = [p.decode() if isinstance(p, QuantRows) else p for p in parts]
    return pack(QuantCodes.concat(codes), interleaved)


class QuantLinear:
    """y = W x' for a weight in GGUF quantized types, in their own bytes (see qlayout.py): the
    rows of one or more tensors stacked (a fused projection whose parts differ in type is one
    QMatrix per run of one type). x is quantized to int8 per 32 inputs inside the kernels.

    Same calling convention and counters as `SparseInt4Linear`: batches of up to 8 rows run
    the GEMV (more in chunks of 8), torch tensors of 48 rows or more (prefill) torch's GEMM on
    the weight dequantized in tiles, on the activations rounded as the GEMV rounds them."""

    # Prefill (48+ rows): the quad-interleaved layout runs it through the int8 kernel, 64 rows
    # of x a call in blocks of 256 weight rows (csrc/qmat_body.h, kernel_il); measured on the
    # 1.5B, a 329-token prompt took 7.4-7.8 s that way and 9.4-10.5 s as torch's fp32 GEMM on
    # the dequantized weight. The column layout (sparse files) takes the same kernel where it
    # runs on AMX tiles (the quads read from the columns' runs), else keeps the GEMM, faster
    # than its own batched kernel there.
    prefill_matmul: bool

    def __init__(self, parts: list[QuantCodes | QuantRows], interleaved: bool = False, ahead: PackAhead | None = None) -> None:
        """``parts``: decoded codes, or a file's rows (`QuantRows`), which the interleaved layout
        packs straight from the file's bytes (or takes from ``ahead``, which packed them
        beforehand). Consecutive parts of one type share a matrix."""
        self.packed: list[PackedQuant] = [_pack(r, interleaved, ahead) for r in type_runs(parts)]
        self.prefill_matmul = not interleaved and kernels().qmat_kernel() != "avx512vnni-amx"
        k = {p.k for p in self.packed}
        if len(k) != 1:
            raise ValueError(f"stacked tensors must share their input size, not {sorted(k)}")
        self.in_features = k.pop()
        self.out_features = sum(p.n for p in self.packed)
        K = kernels()
        self.matrices = tuple(K.QMatrix(p.qtype, p.codes, p.d, p.m, p.sc, p.mn, p.n, p.k, interleaved) for p in self.packed)
        self.row0 = [sum(p.n for p in self.packed[:i]) for i in range(len(self.packed))]
        self._counts = np.zeros(QM_MAX_BATCH, dtype=np.int32)
        self._counts_ptr = self._counts.ctypes.data
        self.kept_columns = -1
        self.rows_kept = 0
        self.columns_read = 0

    @property
    def tiles(self) -> bool:
        """Whether prompt rows take the AMX-BF16 tiles now (the switch is read at each call)."""
        return bool(kernels().qmat_tiles())

    @property
    def qtypes(self) -> list[int]:
        return [p.qtype for p in self.packed]

    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.packed)

    def __call__(self, x: Any, threshold: float | None = None, out: Any = None) -> Any:
        return self.forward(x, threshold, out)

    def forward(self, x: Any, threshold: float | None = None, out: Any = None) -> Any:
        """y = W x' where x' zeroes |x_j| <= threshold (None: dense). x (K,) or (B, K)."""
        k, n = self.in_features, self.out_features
        numpy_in = isinstance(x, np.ndarray)
        if not numpy_in:
            f32 = _torch_float32()
            if x.dtype is not f32 or not x.is_cpu or not x.is_contiguous():
                raise ValueError(f"x must be a contiguous float32 CPU tensor, got {x.dtype} on {x.device}")
        if x.ndim not in (1, 2) or x.shape[-1] != k:
            raise ValueError(f"x must be ({k},) or (B, {k}), got {tuple(x.shape)}")
        batch = 1 if x.ndim == 1 else x.shape[0]
        if out is None:
            out = np.empty(x.shape[:-1] + (n,), dtype=np.float32) if numpy_in else x.new_empty(x.shape[:-1] + (n,))
        elif tuple(out.shape) != tuple(x.shape[:-1]) + (n,):
            raise ValueError(f"out must have shape {tuple(x.shape[:-1]) + (n,)}, not {tuple(out.shape)}")
        dense = threshold is None
        t = 0.0 if dense else threshold
        px = x.ctypes.data if numpy_in else x.data_ptr()
        py = out.ctypes.data if numpy_in else out.data_ptr()
        first = _PROMPT_FROM.get()
        tiled = first is not None and batch > first and self.tiles
        if tiled:
            tiled_kept = self._tiles(px + 4 * first * k, py + 4 * first * n, batch - first, t, dense)
            batch = first  # the decode rows before them (if any): the int8 kernels
        elif batch >= MATMUL_MIN_ROWS and not numpy_in and self.prefill_matmul:
            self._matmul(x, out, t, dense)
            return out
        kept = read = rows = 0
        for b0 in range(0, batch, QM_MAX_BATCH):
            bb = min(QM_MAX_BATCH, batch - b0)
            for m, r0 in zip(self.matrices, self.row0):
                chunk = m.gemv(px + 4 * b0 * k, py + 4 * (b0 * n + r0), bb, k, n, t, dense, self._counts_ptr)
            kept, read = max(kept, chunk), read + chunk
            rows += bb * k if dense else int(self._counts[:bb].sum())
        if tiled:  # the tiles read every column
            kept, read, rows = k, read + k, rows + tiled_kept
        self.kept_columns, self.columns_read, self.rows_kept = kept, read, rows
        return out

    def gated(self, x: Any, activation: int) -> Any | None:
        """act(gate x) * (up x), (B, N / 2), for a gated MLP's fused projection (rows [gate; up]);
        activation 0 silu, 1 gelu-tanh. Where the int8 kernels take the rows and one matrix holds
        both halves, they make it as their threads finish each piece of rows of both halves, so the
        (B, N) product is never written (on two Zen 5 threads SiLU times up was 5% of the 1.5B's
        prefill as torch's passes); None where they do not (tiles, the column layout's GEMM,
        halves of different types, f not a multiple of 32): the caller takes `forward`."""
        k, f = self.in_features, self.out_features // 2
        first = _PROMPT_FROM.get()
        if (len(self.matrices) != 1 or not self.packed[0].interleaved or self.out_features % 64
                or (first is not None and x.shape[0] > first and self.tiles)):
            return None
        if x.dtype is not _torch_float32() or not x.is_cpu or not x.is_contiguous() or x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"x must be a contiguous float32 CPU tensor of shape (B, {k}), got {tuple(x.shape)} {x.dtype}")
        batch = x.shape[0]
        out = x.new_empty((batch, f))
        px, py, m = x.data_ptr(), out.data_ptr(), self.matrices[0]
        for b0 in range(0, batch, QM_MAX_BATCH):
            m.gemv_glu(px + 4 * b0 * k, py + 4 * b0 * f, min(QM_MAX_BATCH, batch - b0), k, f, activation)
        self.kept_columns, self.columns_read, self.rows_kept = k, k * -(-batch // QM_MAX_BATCH), batch * k
        return out

    def _tiles(self, px: int, py: int, batch: int, t: float, dense: bool) -> int:
        """Rows of prompt through the AMX-BF16 tiles (see `prompt_rows`); returns the inputs kept."""
        k, n = self.in_features, self.out_features
        kept = 0
        for m, r0 in zip(self.matrices, self.row0):
            kept = m.tiles(px, py + 4 * r0, batch, k, n, t, dense)
        return kept

    def _matmul(self, x: Any, out: Any, t: float, dense: bool) -> None:
        """out = x^ W^T by torch's GEMM on the weight dequantized a tile of rows at a time, x^
        the activations rounded as the GEMV rounds them: a prompt gives the same numbers
        whether it is computed in one chunk or token by token (prefix caching changes which)."""
        import torch

        k = self.in_features
        x, self.rows_kept = _thresholded(x, t, dense)
        x = quantize_dequantize(x)
        buf = getattr(_scratch, "buf", None)
        for m, r0, p in zip(self.matrices, self.row0, self.packed):
            tile = max(32, min(p.npad, MATMUL_TILE_BYTES // (4 * k) // 32 * 32))
            if buf is None or buf.numel() < k * tile:
                buf = _scratch.buf = torch.empty(k * tile, dtype=torch.float32)
            for a in range(0, p.n, tile):
                b = min(p.npad, a + tile)
                w = buf[: k * (b - a)].view(k, b - a)
                m.dequantize(w.data_ptr(), a, b, b - a)
                c = min(p.n, b)
                out[:, r0 + a : r0 + c] = x @ w[:, : c - a]
        self.kept_columns = self.columns_read = k


def _thresholded(x: Any, t: float, dense: bool) -> tuple[Any, int]:
    """(x with |x| <= t zeroed, the inputs kept) for a (B, K) tensor; dense keeps them all."""
    if dense:
        return x, x.numel()
    keep = x.abs() > t
    return x * keep, int(keep.sum())


def quantize_dequantize(x: Any) -> Any:
    """(B, K) float32 tensor -> dx * qx, the int8 activations of the QMatrix kernels per 32
    inputs (dx = max |x| / 127, qx = round-half-even(x * (1 / dx)), all in float32)."""
    import torch

    b, k = x.shape
    xb = x.reshape(b, k // 32, 32)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(b, k)


class Int8RowsLinear:
    """y = W x for a row-major INT8 weight (N out, K in) with one float32 scale per row: an
    output head, read once per decode step by the same thread pool as the INT4 kernels.

    No copies: ``w`` (N, K) int8 and ``scale`` (N,) float32 must be C-contiguous numpy arrays
    (kept alive by the matrix); x (B, K) and out (B, N) contiguous float32 CPU tensors."""

    def __init__(self, w: np.ndarray, scale: np.ndarray) -> None:
        self._matrix = kernels().Int8Matrix(w, scale)
        self.out_features, self.in_features = self._matrix.shape

    def forward(self, x: Any, out: Any = None) -> Any:
        n, k = self.out_features, self.in_features
        f32 = _torch_float32()
        if x.dtype is not f32 or not x.is_cpu or not x.is_contiguous() or x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"x must be a contiguous float32 CPU tensor of shape (B, {k}), got {tuple(x.shape)} {x.dtype}")
        if out is None:
            out = x.new_empty((x.shape[0], n))
        if x.shape[0]:
            self._matrix.gemv(x.data_ptr(), out.data_ptr(), x.shape[0], k, n)
        return out

    __call__ = forward


_F32: Any = None


def _torch_float32() -> Any:
    global _F32
    if _F32 is None:
        import torch

        _F32 = torch.float32
    return _F32


def _numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return a.detach().cpu().numpy()
