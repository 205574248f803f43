"""Random-weight GGUFs of real model shapes, for speed and memory measurements.

Decode speed and memory use depend on a model's shapes and tensor types, not on its values,
so a 1B-parameter benchmark needs no 1B-parameter download. The file borrows the starter
model's tokenizer (a real BPE vocabulary llama.cpp loads), padded with unused control tokens
up to the shape's vocabulary size, so llama.cpp and llmlocal's engines both load it:

    random_gguf("/tmp/llama-1b-q4_0.gguf", shape="llama-3.2-1b", qtype="q4_0")

Quantized blocks are random bytes with their fp16 scales overwritten by a small constant, so
weights stay in a sane range (|w| <= 8 * 2^-9) and activations do not overflow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from llmlocal.models import resolve

from .gguf_source import _copy_field
from .gguf_writer import KV, GGUFStreamWriter


@dataclass(frozen=True)
class Shape:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    tied: bool = True


SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(30, 576, 9, 3, 1536, 49152, 8192, 100000.0),
    "llama-3.2-1b": Shape(16, 2048, 32, 8, 8192, 128256, 131072, 500000.0),
    "llama-3.2-3b": Shape(28, 3072, 24, 8, 8192, 128256, 131072, 500000.0),
    "llama-3.1-8b": Shape(32, 4096, 32, 8, 14336, 128256, 131072, 500000.0, tied=False),
}

QTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
# fp16 scale bit patterns: 2^-9 for d (and a zero min for q4_1's m)
_SCALE = np.float16(2.0**-9).view(np.uint16)


def _tokenizer_fields(vocab: int) -> list[KV]:
    """The starter's tokenizer metadata, its token list padded to ``vocab`` entries."""
    reader = GGUFReader(resolve("smollm2-135m").path)
    out = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kv = _copy_field(field)
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            values = list(kv.value)
            pad = vocab - len(values)
            if pad < 0:
                raise ValueError(f"shape vocabulary {vocab} is smaller than the starter's {len(values)}")
            if name == "tokenizer.ggml.tokens":
                values += [f"<|reserved_{i}|>".encode() for i in range(pad)]
            elif name == "tokenizer.ggml.token_type":
                values = np.concatenate([np.asarray(values, dtype=np.int32), np.full(pad, 3, np.int32)])  # 3: control
            else:
                values = np.concatenate([np.asarray(values, dtype=np.float32), np.zeros(pad, np.float32)])
            kv = KV.array(name, values, kv.elem_type)
        out.append(kv)
    return out


def _tensors(s: Shape, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, ggml type) in llama.cpp's naming; norms stay F32."""
    w = qtype.upper()
    head_dim = s.dim // s.heads
    out = [("token_embd.weight", (s.vocab, s.dim), w)]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (s.dim,), "F32"),
            (p + "attn_q.weight", (s.heads * head_dim, s.dim), w),
            (p + "attn_k.weight", (s.kv_heads * head_dim, s.dim), w),
            (p + "attn_v.weight", (s.kv_heads * head_dim, s.dim), w),
            (p + "attn_output.weight", (s.dim, s.heads * head_dim), w),
            (p + "ffn_norm.weight", (s.dim,), "F32"),
            (p + "ffn_gate.weight", (s.ffn, s.dim), w),
            (p + "ffn_up.weight", (s.ffn, s.dim), w),
            (p + "ffn_down.weight", (s.dim, s.ffn), w),
        ]
    out.append(("output_norm.weight", (s.dim,), "F32"))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.dim), w))
    return out


def _random_data(shape: tuple[int, ...], ggml_type: str, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(shape))
    if ggml_type == "F32":
        return np.ones(n, np.float32) if len(shape) == 1 else (rng.standard_normal(n, np.float32) * 0.02)
    if ggml_type == "F16":
        return (rng.standard_normal(n, np.float32) * 0.02).astype(np.float16)
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, size=(n // block, nbytes), dtype=np.uint8)
    scales = blocks[:, :2].view(np.uint16)  # (blocks, 1): d, first in every block
    scales[:] = _SCALE
    if ggml_type == "Q4_1":
        blocks[:, 2:4] = 0  # m = 0
    return blocks


def random_gguf(path: str | os.PathLike[str], shape: str = "llama-3.2-1b", qtype: str = "q4_0", seed: int = 0) -> Path:
    """Write a random-weight llama GGUF of a named shape; returns its path. Reuses an existing
    file of the same name (the content is a pure function of the arguments)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    if qtype not in QTYPES:
        raise ValueError(f"unknown type {qtype!r}: choose one of {', '.join(QTYPES)}")
    out = Path(path)
    if out.exists():
        return out
    s = SHAPES[shape]
    metadata = [
        KV.string("general.architecture", "llama"),
        KV.string("general.name", f"random {shape} {qtype}"),
        KV.u32("general.file_type", {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}[qtype]),
        KV.u32("llama.block_count", s.layers),
        KV.u32("llama.context_length", s.context),
        KV.u32("llama.embedding_length", s.dim),
        KV.u32("llama.feed_forward_length", s.ffn),
        KV.u32("llama.attention.head_count", s.heads),
        KV.u32("llama.attention.head_count_kv", s.kv_heads),
        KV.u32("llama.rope.dimension_count", s.dim // s.heads),
        KV.f32("llama.rope.freq_base", s.rope_theta),
        KV.f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
        KV.u32("llama.vocab_size", s.vocab),
        *_tokenizer_fields(s.vocab),
    ]
    tensors = _tensors(s, qtype)
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            writer = GGUFStreamWriter(f, metadata, [(n, shp, t) for n, shp, t in tensors])
            writer.write_header()
            for _, shp, t in tensors:
                writer.write(_random_data(shp, t, rng))
                writer.end_tensor()
            writer.finish()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a random-weight GGUF of a real model's shape.")
    p.add_argument("path")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--type", default="q4_0", choices=QTYPES)
    args = p.parse_args()
    print(random_gguf(args.path, args.shape, args.type))


if __name__ == "__main__":
    main()
