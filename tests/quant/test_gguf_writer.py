"""The streaming GGUF writer, read back by gguf-py's reader and by llmlocal's own header parser."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from llmlocal.models import read_gguf_header
from llmlocal.quant.encode import encode
from llmlocal.quant.gguf_writer import KV, GGUFStreamWriter


def test_metadata_and_tensors_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    vector = rng.standard_normal(5).astype(np.float32)
    metadata = [
        KV.string("general.architecture", "llama"),
        KV.u32("llama.block_count", 3),
        KV.f32("llama.rope.freq_base", 500000.0),
        KV.boolean("tokenizer.ggml.add_bos_token", True),
        KV.array("tokenizer.ggml.tokens", ["a", "é", "<|x|>"], GGUFValueType.STRING),
        KV.array("tokenizer.ggml.token_type", [1, 1, 3], GGUFValueType.INT32),
        KV.string("raw.bytes", b"\xffkept verbatim"),
    ]
    path = tmp_path / "t.gguf"
    with open(path, "wb") as f:
        w = GGUFStreamWriter(f, metadata, [("w", (8, 64), "Q8_0"), ("v", (5,), "F32")])
        w.write_header()
        q = encode(weight, "Q8_0")
        w.write(q[:3])  # a tensor may arrive in pieces
        w.write(q[3:])
        w.end_tensor()
        w.write(vector)
        w.end_tensor()
        w.finish()
    assert path.stat().st_size == w.total_bytes

    r = GGUFReader(path)
    assert r.fields["llama.block_count"].contents() == 3
    assert r.fields["llama.rope.freq_base"].contents() == 500000.0
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "é", "<|x|>"]
    assert r.fields["tokenizer.ggml.token_type"].contents() == [1, 1, 3]
    assert bytes(r.fields["raw.bytes"].parts[-1]) == b"\xffkept verbatim"
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors["w"].shape) == [64, 8]  # GGUF lists the fastest dimension first
    assert np.array_equal(np.asarray(tensors["w"].data).ravel(), q.ravel())
    assert np.array_equal(np.asarray(tensors["v"].data), vector)
    assert all(t.data_offset % 32 == 0 for t in r.tensors)

    header = read_gguf_header(path)  # llmlocal's own parser agrees on layout and sizes
    assert [t.name for t in header.tensors] == ["w", "v"]
    assert header.tensors[0].n_bytes == q.nbytes


def test_writing_the_wrong_amount_of_data_is_caught(tmp_path: Path) -> None:
    with open(tmp_path / "t.gguf", "wb") as f:
        w = GGUFStreamWriter(f, [KV.string("general.architecture", "llama")], [("v", (4,), "F32")])
        w.write_header()
        with pytest.raises(AssertionError):
            w.write(np.zeros(5, dtype=np.float32))
        w.write(np.zeros(3, dtype=np.float32))
        with pytest.raises(AssertionError):
            w.end_tensor()
