"""Which GGML type each tensor gets, following llama.cpp's conventions.

* Vectors (norm weights, biases, rope_freqs) stay F32: llama.cpp's kernels for them expect F32,
  and they are a rounding error of the file size.
* The output projection — ``output.weight``, or ``token_embd.weight`` when the embeddings are
  tied and it doubles as the output — decides every next-token distribution; llama.cpp keeps
  it at 6 bits or more (Q6_K) in its 4- and 5-bit files. Our own 4/5-bit formats keep it at
  Q8_0, the closest type we write.
* A weight whose row length is not a whole number of blocks cannot be stored in a block
  type; it falls back to F16, as llama.cpp's converter does.
"""

from __future__ import annotations

from .encode import block_size
from .formats import FLOAT_TYPES, Format
from .source import ModelSource, SourceTensor


def output_projection(source: ModelSource) -> str:
    names = {t.name for t in source.tensors}
    return "output.weight" if "output.weight" in names else "token_embd.weight"


def _is_vector(tensor: SourceTensor) -> bool:
    return len(tensor.shape) == 1 or not tensor.name.endswith(".weight")


def output_type(tensor: SourceTensor, fmt: Format, projection: str) -> str:
    """The type ``tensor`` gets in a file of format ``fmt`` written by llmlocal."""
    if _is_vector(tensor):
        return "F32"
    target = fmt.tensor_type
    if not fmt.is_float and tensor.name == projection and fmt.bits_per_weight < 8:
        target = "Q8_0"
    if tensor.row_length % block_size(target):
        return "F16"
    return target


def reference_type(tensor: SourceTensor) -> str:
    """The type ``tensor`` gets in the lossless copy of a float source (the reference for the
    quality report and the input of llama.cpp's quantizer): its own float type."""
    if _is_vector(tensor):
        return "F32"
    if tensor.ggml_type not in FLOAT_TYPES:
        raise ValueError(f"{tensor.name} is {tensor.ggml_type}: a quantized source is its own reference")
    return tensor.ggml_type


def plan(source: ModelSource, fmt: Format | None) -> list[tuple[SourceTensor, str]]:
    """(tensor, type) for every tensor: ``fmt``'s types, or the reference copy when None."""
    if fmt is None:
        return [(t, reference_type(t)) for t in source.tensors]
    projection = output_projection(source)
    return [(t, output_type(t, fmt, projection)) for t in source.tensors]


def fallbacks(planned: list[tuple[SourceTensor, str]], fmt: Format) -> list[str]:
    """Weights that could not take ``fmt``'s block type (kept F16), for a note to the user."""
    return [t.name for t, ggml_type in planned if ggml_type == "F16" and fmt.tensor_type != "F16" and not _is_vector(t)]
