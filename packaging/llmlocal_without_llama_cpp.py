"""The `llmlocal` CLI for the GPU check, on a machine without llama-cpp-python.

The paged engine tokenizes a GGUF with llama.cpp's own vocabulary (a vocab-only
llama-cpp-python model, `engine/prompt/tokenizer.py`), so that its token ids are llama.cpp's. The GPU
machines have no llama-cpp-python, and the check's model is a GGUF that `llmlocal quantize`
made from a checkpoint whose `tokenizer.json` the check wrote: that file gives the same ids.
So here, and only where llama_cpp cannot be imported, a GGUF is tokenized by the
`tokenizer.json` in the directory that LLMLOCAL_GPU_CHECK_TOKENIZER names. Nothing else
changes: the weights, the kernels and the scheduler are the engine's own.

LLMLOCAL_GPU_CHECK_HIDE_LLAMA_CPP=1 makes llama_cpp unimportable in this process: the dry run
sets it, so that CI walks the same path the GPU machine does.

    python packaging/llmlocal_without_llama_cpp.py bench decode --model m.gguf --json

The patch is applied at import, at the top of this file: `bench decode` loads each engine in
a process of its own (multiprocessing's spawn), which runs this file again as `__mp_main__`,
so the children are patched too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def llama_cpp_importable() -> bool:
    if "llama_cpp" in sys.modules:
        return sys.modules["llama_cpp"] is not None
    return importlib.util.find_spec("llama_cpp") is not None


def install() -> None:
    """Hide llama_cpp if asked to; tokenize GGUFs by the named tokenizer.json without it."""
    if os.environ.get("LLMLOCAL_GPU_CHECK_HIDE_LLAMA_CPP") == "1":
        sys.modules["llama_cpp"] = None  # type: ignore[assignment]  # `import llama_cpp` now raises ImportError
    directory = os.environ.get("LLMLOCAL_GPU_CHECK_TOKENIZER")
    if llama_cpp_importable() or not directory:
        return
    from llmlocal.engine.prompt import tokenizer

    if getattr(tokenizer.open_tokenizer, "gpu_check", False):
        return
    original = tokenizer.open_tokenizer

    def open_tokenizer(path: str | Path, gguf: bool) -> tokenizer.Tokenizer:
        if gguf:
            return tokenizer.HFTokenizer(directory)
        return original(path, gguf)

    open_tokenizer.gpu_check = True  # type: ignore[attr-defined]
    tokenizer.open_tokenizer = open_tokenizer  # start_tokenizer looks it up at each call


install()

if __name__ == "__main__":
    from llmlocal.app import cli

    sys.exit(cli.main(sys.argv[1:]))
