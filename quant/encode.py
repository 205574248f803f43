"""Rows of values <-> GGML storage types: the conversion applied to every chunk of a tensor.

`decode` turns stored rows (whatever the source holds) into float32; `encode` turns float32
rows into the bytes of a GGML type. Float types are plain casts; block types use gguf-py's
numpy quantizers, which reproduce ggml's reference quantizers bit for bit (the tests check
this against ggml's own `ggml_quantize_chunk`). Rows are independent in every format, so a
tensor can be converted any number of rows at a time.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

# Types `encode` writes with our own code (the rest come from llama.cpp's quantizer).
ENCODABLE = frozenset({"F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"})


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32: they are the high half of the float32 bits."""
    out = np.left_shift(bits, 16, dtype=np.uint32)
    return out.view(np.float32)


def decode(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """Stored rows -> float32 rows of the same shape. ``raw`` is (rows, row_length) for float
    types, or (rows, bytes_per_row) uint8 for block types (then the result is
    (rows, row_length))."""
    if ggml_type == "F32":
        return raw.astype(np.float32, copy=False)
    if ggml_type == "F16":
        return raw.astype(np.float32)
    if ggml_type == "BF16":
        return bf16_to_f32(raw.view(np.uint16))
    return dequantize(raw.view(np.uint8), GGMLQuantizationType[ggml_type])


def encode(rows: np.ndarray, ggml_type: str) -> np.ndarray:
    """float32 rows (rows, row_length) -> a C-contiguous array holding their ``ggml_type`` bytes.

    F16 rounds to nearest even as ggml's own conversion does. BF16 rounds to nearest even too,
    quieting NaNs (ggml's `ggml_compute_fp32_to_bf16`).
    """
    if ggml_type == "F32":
        return np.ascontiguousarray(rows, dtype=np.float32)
    if ggml_type == "F16":
        return rows.astype(np.float16)
    if ggml_type not in ENCODABLE:
        raise ValueError(f"llmlocal does not encode {ggml_type} itself")
    return quantize(np.ascontiguousarray(rows, dtype=np.float32), GGMLQuantizationType[ggml_type])


def block_size(ggml_type: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0]


def row_bytes(row_length: int, ggml_type: str) -> int:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return row_length // block * type_size
