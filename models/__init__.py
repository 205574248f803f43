"""Model names -> files, and what a file holds (`ModelSpec`) without loading weights."""

from .errors import LLMLocalError, ModelFormatError, ModelNotFoundError
from .gguf_header import GGUFHeader, TensorInfo, read_gguf_header
from .hf_spec import spec_from_hf
from .resolve import DEFAULT_MODEL, STARTER_MODELS, ResolvedModel, resolve, starter_path
from .shape import ModelShape
from .spec import ModelSpec, SpecialTokens, spec_from_gguf

__all__ = [
    "DEFAULT_MODEL",
    "STARTER_MODELS",
    "GGUFHeader",
    "LLMLocalError",
    "ModelFormatError",
    "ModelNotFoundError",
    "ModelShape",
    "ModelSpec",
    "ResolvedModel",
    "SpecialTokens",
    "TensorInfo",
    "read_gguf_header",
    "resolve",
    "spec_from_gguf",
    "spec_from_hf",
    "starter_path",
]
