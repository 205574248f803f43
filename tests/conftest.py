"""Shared fixtures: the real starter model, and small GGUF files built by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from llmlocal.engine import Engine, Plan
from llmlocal.models import resolve


def _import_triton_for_its_interpreter() -> None:
    """Triton wraps its own language library (tl.zeros, tl.sum, ...) for the compiler or for
    its CPU interpreter once, when it is first imported, by TRITON_INTERPRET at that moment.
    The kernel tests switch the interpreter on per test (tests/native/conftest.py), which only
    works if the library was wrapped for it: transformers (the reference of the model-family
    tests) imports triton as it builds a model, without the variable. So on a machine without
    CUDA, import triton first, with the interpreter chosen; the variable is restored at once."""
    import importlib.util
    import os

    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_its_interpreter()


def _private_kv_cache() -> None:
    """The paged engine keeps KV blocks and packed weights on disk where the CLI runs it
    (LLMLOCAL_KV_CACHE_DIR, LLMLOCAL_PACKED_CACHE_DIR, else the user's cache directory): every
    test, and every process a test starts, gets directories of its own run instead, so no test
    reads or writes the user's cache."""
    import os
    import tempfile

    os.environ["LLMLOCAL_KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmlocal-test-kv-")
    os.environ["LLMLOCAL_PACKED_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmlocal-test-packed-")


_private_kv_cache()


def _ctrl_c_reaches_children() -> None:
    """Tests press Ctrl-C on the processes they start (`serve`, `quantize`). A suite run as a
    background job of a non-interactive shell starts with SIGINT ignored, and children inherit an
    ignored signal across exec: they would never see the interrupt (a server left running, a
    quantization run to its end). A handler of our own is reset to the default in a child, so the
    child's Python turns SIGINT into KeyboardInterrupt, as in a terminal."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_ctrl_c_reaches_children()


@pytest.fixture(scope="session")
def starter_path() -> str:
    return resolve().path


@pytest.fixture(scope="session")
def starter_cpu_backend() -> str:
    """The backend `auto` runs the starter with on this CPU with the disk KV cache on (the
    CLI's default): the paged engine where its native kernels were measured faster than
    llama.cpp (AVX512-VNNI) or as fast (AVX2), llama.cpp elsewhere."""
    from llmlocal.engine.planning.hardware import simd_features
    from llmlocal.engine.planning.native_support import paged_pays

    return "paged" if paged_pays(resolve().spec, simd_features(), disk_cache=True) else "llamacpp"


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The starter model in the llamacpp backend, shared by the tests that only read from it."""
    with Engine.load(Plan(backend="llamacpp", n_ctx=2048)) as e:
        yield e


@pytest.fixture(scope="session")
def sparse_starter(tmp_path_factory: pytest.TempPathFactory, starter_path: str) -> tuple[Path, dict]:
    """The starter GGUF calibrated at 50% activation sparsity through `llmlocal quantize
    ... --sparsity 0.5 --json` (tensors copied, thresholds added), and the command's report."""
    import io
    import json
    from contextlib import redirect_stdout

    from llmlocal.app import cli

    out = tmp_path_factory.mktemp("sparse") / "starter-sparse.gguf"
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        code = cli.main(["quantize", starter_path, "--sparsity", "0.5", "-o", str(out), "--no-eval", "--json"])
    assert code == 0
    return out, json.loads(stdout.getvalue())


@pytest.fixture
def make_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Write a tiny GGUF with the given architecture name (shape keys and a toy vocab)."""

    def make(arch: str = "llama", name: str = "tiny.gguf", layers: int = 1) -> Path:
        import gguf

        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(layers)
        w.add_embedding_length(32)
        w.add_feed_forward_length(64)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_context_length(128)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        tokens = ["<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)]
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * 26)
        w.add_token_merges([])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        rng = np.random.default_rng(0)
        w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), 32), dtype=np.float32))
        w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    return make
