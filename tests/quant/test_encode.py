"""Our block quantizers and float casts, bit for bit against ggml's own (`ggml_quantize_chunk`,
`ggml_fp32_to_fp16_row`, ... from the libggml that llama-cpp-python ships)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmlocal.quant.encode import ENCODABLE, bf16_to_f32, decode, encode
from llmlocal.quant.formats import FORMATS


@pytest.fixture(scope="module")
def ggml() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    for name in ("ggml_fp32_to_fp16_row", "ggml_fp32_to_bf16_row_ref"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


def _ggml_encode(lib: ctypes.CDLL, rows: np.ndarray, type_name: str) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if type_name == "F16":
        out = np.empty(rows.size, dtype=np.uint16)
        lib.ggml_fp32_to_fp16_row(rows.ctypes.data, out.ctypes.data, rows.size)
        return out.view(np.uint8)
    if type_name == "BF16":
        out = np.empty(rows.size, dtype=np.uint16)
        lib.ggml_fp32_to_bf16_row_ref(rows.ctypes.data, out.ctypes.data, rows.size)
        return out.view(np.uint8)
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    out = np.empty(rows.size // block * type_size, dtype=np.uint8)
    written = lib.ggml_quantize_chunk(int(GGMLQuantizationType[type_name]), rows.ctypes.data, out.ctypes.data,
                                      0, rows.shape[0], rows.shape[1], None)
    assert written == out.size
    return out


def _hard_rows(rng: np.random.Generator) -> np.ndarray:
    """Weights plus the cases rounding gets wrong: ties, zeros, constant blocks, huge and tiny values."""
    rows = (0.02 * rng.standard_normal((64, 256))).astype(np.float32)
    rows[0, :32] = np.arange(32, dtype=np.float32) - 15.5  # exact .5 ties after scaling
    rows[1, :64] = 0.0  # all-zero blocks: scale 0
    rows[2, :32] = 3.0  # constant block: max == min
    rows[3] *= 1e4
    rows[4] *= 1e-6
    rows[5, ::7] = -rows[5, ::7] * 40  # outliers
    rows[6] = np.float32(65504.0) * np.sign(rows[6])  # the f16 maximum
    return rows


@pytest.mark.parametrize("type_name", sorted(ENCODABLE - {"F32"}))
def test_encode_matches_ggml_bit_for_bit(ggml: ctypes.CDLL, type_name: str) -> None:
    rows = _hard_rows(np.random.default_rng(0))
    ours = encode(rows, type_name)
    theirs = _ggml_encode(ggml, rows, type_name)
    assert ours.view(np.uint8).ravel().tobytes() == theirs.tobytes()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_decode_inverts_encode_within_the_format_error(type_name: str) -> None:
    rows = (0.02 * np.random.default_rng(1).standard_normal((16, 128))).astype(np.float32)
    back = decode(encode(rows, type_name).reshape(16, -1), type_name)
    assert back.shape == rows.shape
    bits = {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_0": 4, "Q4_1": 4}[type_name]
    # each block's error is at most one quantization step of its range
    assert np.abs(back - rows).max() <= 2 * np.abs(rows).max() / (2 ** bits - 1) * 1.01


def test_bf16_bits_widen_exactly_to_float32() -> None:
    values = np.array([1.0, -2.5, 3.140625, 2.0**-100, -0.0, np.inf], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bf16
    assert np.array_equal(bf16_to_f32(bits).view(np.uint32), values.view(np.uint32))
    assert np.array_equal(decode(bits.reshape(2, 3), "BF16").ravel(), values)


def test_every_llmlocal_format_is_encodable() -> None:
    for fmt in FORMATS.values():
        assert (fmt.tensor_type in ENCODABLE) == (fmt.writer == "llmlocal"), fmt.name
