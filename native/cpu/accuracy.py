"""What rounding activations to int8 costs, on a real file's tensors (a benchmark: it prints).

    python -m llmlocal.native.cpu.accuracy MODEL.gguf [tensor names...]

For each tensor (every type `qlayout` reads), the RMS error of W x relative to the exact
float64 product, x heavy-tailed as a language model's activations are (Student's t, 3 degrees
of freedom), for: fp32 activations; the QMatrix kernels' rounding (int8 per 32 inputs, the
min term on the rounded values: `qlayout.reference_gemv`, which the kernels match); prompt
rows on a CPU with AMX-BF16 (x and W rounded to bfloat16, sums in float32, as
`QMatrix.tiles` computes them); and llama.cpp's rounding for K-quants (Q8_K: int8 per 256
inputs).
"""

from __future__ import annotations

import sys

import numpy as np

from . import qlayout as ql

DEFAULT_TENSORS = ("blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight", "output.weight")
MAX_ROWS = 20000  # of a large output head


def _rounded(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded to int8 per `block` inputs (scale max |x| / 127), back in float64."""
    b, k = x.shape
    xb = x.astype(np.float64).reshape(b, k // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / 127
    return (np.rint(xb / np.where(d > 0, d, 1)) * d).reshape(b, k)


def _bfloat16(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16 (to nearest even), back in float64."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).bfloat16().double().numpy()


def main(argv: list[str]) -> int:
    from gguf import GGUFReader

    if not argv:
        print(__doc__)
        return 2
    reader = GGUFReader(argv[0])
    names = argv[1:] or DEFAULT_TENSORS
    rng = np.random.default_rng(0)
    for name in names:
        t = next((t for t in reader.tensors if t.name == name), None)
        if t is None or int(t.tensor_type) not in ql.FORMATS:
            print(f"{name}: not in the file, or not a type the kernels read")
            continue
        raw = np.asarray(t.data).reshape(int(t.shape[1]), -1).view(np.uint8)[:MAX_ROWS]
        c = ql.decode(raw, int(t.tensor_type))
        w = c.dequantize().astype(np.float64)
        x = rng.standard_t(3, size=(4, w.shape[1])).astype(np.float32)
        exact = x.astype(np.float64) @ w.T

        def rel(y: np.ndarray) -> float:
            return float(np.sqrt(((y - exact) ** 2).mean() / (exact**2).mean()))

        fp32 = (x @ w.astype(np.float32).T).astype(np.float64)
        ours = ql.reference_gemv(c, x).astype(np.float64)
        q8k = _rounded(x, 256) @ w.T
        bf16 = _bfloat16(x) @ _bfloat16(w).T
        print(f"{name} ({t.tensor_type.name}): relative RMS error  fp32 activations {rel(fp32):.1e}  "
              f"int8 per 32 (llmlocal decode) {rel(ours):.1e}  bfloat16 x and W (llmlocal prompt rows, AMX-BF16) "
              f"{rel(bf16):.1e}  int8 per 256 (llama.cpp Q8_K) {rel(q8k):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
