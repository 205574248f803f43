"""GGUF blocks for the GGUF-type kernel tests (test_qmat.py, test_kernels_exact.py)."""

from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType
from llmlocal.native.cpu import qlayout as ql


def gguf_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, row bytes) of valid blocks: gguf-py's quantizer where it has one, else random code
    bytes with small positive fp16 scales (Q8_0 codes kept in [-127, 127] as llama.cpp's)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    try:
        return np.asarray(quants.quantize(w, GGMLQuantizationType(qtype)))
    except (NotImplementedError, ValueError, TypeError):
        pass
    f = ql.FORMATS[qtype]
    raw = rng.integers(0, 256, (n, k // f.block_values * f.block_bytes), dtype=np.uint8)
    blk = raw.reshape(n, -1, f.block_bytes)
    scale = np.frombuffer(np.float16(0.0123).tobytes(), np.uint8)
    if qtype == ql.Q6_K:
        blk[..., 208:210] = scale
    else:
        blk[..., 0:2] = scale
        if f.has_m:
            blk[..., 2:4] = np.frombuffer(np.float16(0.031).tobytes(), np.uint8)
    if qtype == ql.Q8_0:
        codes = blk[..., 2:]
        codes[codes == 128] = 129
    return raw
