"""Hugging Face checkpoints built by the tests, in the form users bring them.

* `build_starter_checkpoint`: the bundled starter model (SmolLM2-135M-Instruct) turned back
  into a checkpoint: its GGUF tensors dequantized to float32, q/k rows returned to HF order,
  config.json, tokenizer.json (rebuilt from the GGUF vocabulary and merges with the
  `tokenizers` library), tokenizer_config.json with the chat template.
* `build_random_checkpoint`: random weights of any llama-family shape, optionally sharded,
  written tensor by tensor (a 2.5 GB checkpoint never sits in memory).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


# ---- safetensors, written by hand so a tensor can be streamed or a header broken ------------
def _dtype_info(dtype: str) -> tuple[str, int]:
    return {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}[dtype]


def to_storage(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the bits safetensors stores for ``dtype`` (BF16: top half, rounded)."""
    if dtype == "F32":
        return np.ascontiguousarray(array, dtype="<f4")
    if dtype == "F16":
        return np.ascontiguousarray(array, dtype="<f2")
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even


def write_safetensors(path: Path, tensors: Iterable[tuple[str, tuple[int, ...], str, Any]]) -> None:
    """``tensors``: (name, shape, dtype, producer) where producer() returns the storage array.
    Producers are called one at a time while writing, so memory holds one tensor."""
    items = list(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in items:
        n = int(np.prod(shape)) * _dtype_info(dtype)[1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype, producer in items:
            data = producer()
            assert data.shape == tuple(shape) and data.dtype == np.dtype(_dtype_info(dtype)[0]), name
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))


def write_shards(directory: Path, tensors: list[tuple[str, tuple[int, ...], str, Any]], shards: int) -> None:
    if shards <= 1:
        write_safetensors(directory / "model.safetensors", tensors)
        return
    per = -(-len(tensors) // shards)
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = tensors[k * per : (k + 1) * per]
        write_safetensors(directory / name, part)
        weight_map.update({t[0]: name for t in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---- tokenizer -------------------------------------------------------------------------------
def write_tokenizer(
    directory: Path,
    tokens: list[str],
    merges: list[str],
    special: list[int],
    pre_tokenizer: dict[str, Any],
    tokenizer_config: dict[str, Any],
) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    data = json.loads(tok.to_str())
    data["pre_tokenizer"] = pre_tokenizer
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    added = {str(i): {"content": tokens[i], "special": True, "normalized": False, "lstrip": False,
                      "rstrip": False, "single_word": False} for i in special}
    (directory / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added, **tokenizer_config}))


# ---- the starter model ---------------------------------------------------------------------
def starter_tensors(gguf_path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in GGUF row order) for every tensor of the starter model."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    for t in reader.tensors:
        yield t.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)


def build_starter_checkpoint(gguf_path: str, directory: Path, dtype: str = "F32") -> None:
    from gguf import GGUFReader

    from llmlocal.models.tensor_names import gguf_to_hf_name, unpermute_qk

    directory.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    f = reader.fields
    n_heads = int(f["llama.attention.head_count"].contents())
    n_kv = int(f["llama.attention.head_count_kv"].contents())
    tensors = []
    for name, array in starter_tensors(gguf_path):
        if ".attn_q." in name:
            array = unpermute_qk(array, n_heads)
        elif ".attn_k." in name:
            array = unpermute_qk(array, n_kv)
        hf = gguf_to_hf_name(name)
        assert hf is not None, name
        stored = to_storage(array, dtype)
        tensors.append((hf, stored.shape, dtype, lambda s=stored: s))
    tensors.sort(key=lambda t: t[0])
    write_safetensors(directory / "model.safetensors", tensors)

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "num_attention_heads": n_heads, "num_hidden_layers": 30, "num_key_value_heads": n_kv,
        "rms_norm_eps": 1e-05, "rope_theta": 100000, "rope_scaling": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 49152, "use_cache": True,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n\n# SmolLM2-135M-Instruct\n")
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    special = [i for i, kind in enumerate(types) if kind == 3]
    write_tokenizer(directory, tokens, merges, special, SMOLLM_PRE_TOKENIZER, {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>", "chat_template": f["tokenizer.chat_template"].contents(),
        "clean_up_tokenization_spaces": False, "model_max_length": 8192, "tokenizer_class": "GPT2Tokenizer",
    })


# ---- random weights -----------------------------------------------------------------------
def byte_level_vocab(n_merges: int = 40) -> tuple[list[str], list[str]]:
    """A small GPT-2 style vocabulary: the 256 byte symbols, two specials, a few merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet
    merges = []
    for a, b in zip("the quick brown fox jumps over lazy dog", "he quick brown fox jumps over lazy dogs"):
        if len(merges) >= n_merges:
            break
        if a.strip() and b.strip() and f"{a} {b}" not in merges:
            merges.append(f"{a} {b}")
            if a + b not in tokens:
                tokens.append(a + b)
    return tokens, merges


def build_random_checkpoint(
    directory: Path,
    *,
    model_type: str = "llama",
    layers: int = 2,
    d: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int | None = None,
    dtype: str = "BF16",
    shards: int = 1,
    tie: bool = False,
    seed: int = 0,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a random-weight checkpoint; returns its config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens, merges = byte_level_vocab()
    vocab = vocab or len(tokens)
    head_dim = d // heads
    qkv_bias = model_type == "qwen2"
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, d)), (p + "self_attn.k_proj.weight", (kv_heads * head_dim, d)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, d)), (p + "self_attn.o_proj.weight", (d, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (ffn, d)), (p + "mlp.up_proj.weight", (ffn, d)), (p + "mlp.down_proj.weight", (d, ffn)),
        ]
        if qkv_bias:
            shapes += [(p + "self_attn.q_proj.bias", (heads * head_dim,)), (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
                       (p + "self_attn.v_proj.bias", (kv_heads * head_dim,))]
    shapes.append(("model.norm.weight", (d,)))
    if not tie:
        shapes.append(("lm_head.weight", (vocab, d)))

    def producer(name: str, shape: tuple[int, ...], k: int) -> Any:
        def make() -> np.ndarray:
            rng = np.random.default_rng(seed * 7919 + k)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                values = 0.02 * rng.standard_normal(shape, dtype=np.float32)
            return to_storage(values, dtype)
        return make

    tensors = [(n, s, dtype, producer(n, s, k)) for k, (n, s) in enumerate(shapes)]
    write_shards(directory, tensors, shards)
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(model_type, "X")],
        "model_type": model_type, "hidden_size": d, "intermediate_size": ffn, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tie,
        "bos_token_id": 1, "eos_token_id": 2, **(extra_config or {}),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, tokens, merges, [0, 1, 2], {"type": "ByteLevel", "add_prefix_space": False,
                    "trim_offsets": True, "use_regex": True},
                    {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template":
                     "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"})
    return config
