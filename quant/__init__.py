"""Conversion of Hugging Face checkpoints and GGUF files to GGUF, and quality evaluation.

    from llmlocal.quant import QuantizeJob, quantize
    result = quantize(QuantizeJob(src="~/models/Llama-3.2-1B-Instruct", type="q4_k_m"))
    print(result.quality.table())

The pieces, in the order data flows through them:

    open_source      SRC -> ModelSource (checkpoint.py + hf_config.py + hf_tokenizer.py,
                     gguf_source.py, hub.py for repo ids in the local cache)
    tensor_types     which GGML type each tensor gets (formats.py is the table of formats)
    convert          streams tensors through encode.py into gguf_writer.py
    llama_quantize   K-quant mixes through llama.cpp's quantizer, in a child process
    evaluate         perplexity, KL divergence and top-1 agreement through the Engine API
    pipeline         `quantize(job)`: all of the above, with temporary files and clean-up

Importing this package is cheap (no numpy): the names below load their modules on first use.
"""

from __future__ import annotations

from typing import Any

from .formats import DEFAULT_FORMAT, FORMATS, Format, get_format

_LAZY = {
    "QuantizeJob": "pipeline",
    "QuantizeResult": "pipeline",
    "quantize": "pipeline",
    "QualityReport": "evaluate",
    "evaluate_quality": "evaluate",
}

__all__ = ["DEFAULT_FORMAT", "FORMATS", "Format", "get_format", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
