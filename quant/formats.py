"""The output formats of `llmlocal quantize`: the one table every other module reads.

A format names the GGML type most 2-D weights get, the `general.file_type` written in the
header, and who writes it:

* ``llmlocal`` — our own code, tensor by tensor (float types and the 32-value block formats,
  quantized with gguf-py's numpy reference quantizers, which match ggml bit for bit);
* ``llama.cpp`` — `llama_model_quantize` from an intermediate F16/BF16/F32 GGUF. These are the
  K-quant mixes, whose per-tensor choices (Q6_K for the output projection and some V/down
  projections in a `_m` mix, ...) are llama.cpp's own rules.

Block sizes and bytes per block come from gguf-py's ``GGML_QUANT_SIZES``:

    F32  1 value  -> 4 bytes                Q8_0 32 values -> 2 (f16 scale) + 32 (int8)
    F16  1 value  -> 2 bytes                Q4_0 32 values -> 2 (f16 scale) + 16 (nibbles)
    BF16 1 value  -> 2 bytes                Q4_1 32 values -> 2 + 2 (f16 scale, min) + 16
    Q5_0 32 -> 2 + 4 (high bits) + 16       Q5_1 32 -> 2 + 2 + 4 + 16
    Q4_K 256 -> 2 + 2 + 12 (6-bit sub-block scales/mins) + 128      Q6_K 256 -> 210 bytes

This module imports nothing heavy (no numpy, no gguf): the CLI builds `--help` from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from llmlocal.models.errors import LLMLocalError

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, LlamaFileType

Writer = Literal["llmlocal", "llama.cpp"]


@dataclass(frozen=True)
class Format:
    name: str  # how the user spells it: "q4_k_m"
    tensor_type: str  # GGMLQuantizationType name of most 2-D weights: "Q4_K"
    file_type: str  # LlamaFileType name written as general.file_type: "MOSTLY_Q4_K_M"
    writer: Writer
    description: str

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType[self.tensor_type]

    @property
    def llama_file_type(self) -> LlamaFileType:
        from gguf import LlamaFileType

        return LlamaFileType[self.file_type]

    @property
    def block_size(self) -> int:
        from gguf import GGML_QUANT_SIZES

        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def bits_per_weight(self) -> float:
        """Bits per value of the main tensor type (a K-quant mix averages slightly higher)."""
        from gguf import GGML_QUANT_SIZES

        block, nbytes = GGML_QUANT_SIZES[self.ggml_type]
        return 8 * nbytes / block

    @property
    def is_float(self) -> bool:
        return self.tensor_type in FLOAT_TYPES

    @property
    def label(self) -> str:
        """The spelling used in file names and reports: 'Q4_K_M', 'F16'."""
        return self.name.upper()


FLOAT_TYPES = ("F32", "F16", "BF16")

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("f32", "F32", "ALL_F32", "llmlocal", "32-bit float, lossless, 4 bytes per weight"),
        Format("f16", "F16", "MOSTLY_F16", "llmlocal", "16-bit float, 2 bytes per weight"),
        Format("bf16", "BF16", "MOSTLY_BF16", "llmlocal", "bfloat16, lossless for BF16 checkpoints"),
        Format("q8_0", "Q8_0", "MOSTLY_Q8_0", "llmlocal", "8-bit, 8.5 bits per weight, near lossless"),
        Format("q5_1", "Q5_1", "MOSTLY_Q5_1", "llmlocal", "5-bit with scale and minimum, 6 bits per weight"),
        Format("q5_0", "Q5_0", "MOSTLY_Q5_0", "llmlocal", "5-bit with scale, 5.5 bits per weight"),
        Format("q4_1", "Q4_1", "MOSTLY_Q4_1", "llmlocal", "4-bit with scale and minimum, 5 bits per weight"),
        Format("q4_0", "Q4_0", "MOSTLY_Q4_0", "llmlocal", "4-bit with scale, 4.5 bits per weight"),
        Format("q6_k", "Q6_K", "MOSTLY_Q6_K", "llama.cpp", "6-bit K-quant, 6.6 bits per weight"),
        Format("q5_k_m", "Q5_K", "MOSTLY_Q5_K_M", "llama.cpp", "5-bit K-quant mix, about 5.7 bits per weight"),
        Format("q5_k_s", "Q5_K", "MOSTLY_Q5_K_S", "llama.cpp", "5-bit K-quant, about 5.5 bits per weight"),
        Format("q4_k_m", "Q4_K", "MOSTLY_Q4_K_M", "llama.cpp", "4-bit K-quant mix, about 4.9 bits per weight (default)"),
        Format("q4_k_s", "Q4_K", "MOSTLY_Q4_K_S", "llama.cpp", "4-bit K-quant, about 4.6 bits per weight"),
        Format("q3_k_m", "Q3_K", "MOSTLY_Q3_K_M", "llama.cpp", "3-bit K-quant mix, about 3.9 bits per weight"),
        Format("q2_k", "Q2_K", "MOSTLY_Q2_K", "llama.cpp", "2-bit K-quant mix, about 3.2 bits per weight, lossy"),
    )
}
DEFAULT_FORMAT = "q4_k_m"


def get_format(name: str) -> Format:
    """The format called ``name`` (case-insensitive); raises with the list of valid names."""
    fmt = FORMATS.get(name.lower())
    if fmt is None:
        raise LLMLocalError(f"Unknown type '{name}': choose one of {', '.join(FORMATS)}.")
    return fmt
