"""Llama-family tensor names in GGUF and Hugging Face form, and llama.cpp's Q/K row order.

llama, mistral and qwen2 share one layout: per block an attention (q, k, v, o; qwen2 adds
q/k/v biases), a SwiGLU MLP (gate, up, down) and two RMSNorms.

Q/K row order. Hugging Face llama checkpoints apply RoPE with `rotate_half`: within a head of
dimension D, rows i and i + D/2 form the rotated pair. llama.cpp's converter reorders the
rows of q and k (for the `llama` architecture, which covers mistral) so that pairs are
adjacent, rows 2i and 2i + 1, which its "normal" RoPE expects:

    HF   per head: (2, D/2, ...)  [x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}]
    GGUF per head: (D/2, 2, ...)  [x_0, y_0, x_1, y_1, ...]

qwen2 GGUFs keep the HF order (llama.cpp runs them with NEOX RoPE, which is `rotate_half`).
"""

from __future__ import annotations

import re

import numpy as np

# GGUF name (with {i} for the block) -> Hugging Face name
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
HF_TO_GGUF: dict[str, str] = {v: k for k, v in GGUF_TO_HF.items()}

# Architectures whose GGUF q/k rows are in llama.cpp's interleaved order.
PERMUTED_QK_ARCHS = frozenset({"llama", "mistral"})
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})

_BLOCK = re.compile(r"\.(\d+)\.")


def _pattern(name: str) -> tuple[str, int | None]:
    m = _BLOCK.search(name)
    if not m:
        return name, None
    return name[: m.start()] + ".{i}." + name[m.end() :], int(m.group(1))


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if it is not a llama-family tensor."""
    pattern, i = _pattern(name)
    hf = GGUF_TO_HF.get(pattern)
    return hf.format(i=i) if hf is not None else None


def hf_to_gguf_name(name: str) -> str | None:
    pattern, i = _pattern(name)
    g = HF_TO_GGUF.get(pattern)
    return g.format(i=i) if g is not None else None


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF row order -> llama.cpp's interleaved order (what the converter does to q and k).

    ``w`` is (n_heads * head_dim, ...) — a weight (rows x in) or a bias (rows,).
    """
    head_dim = w.shape[0] // n_heads
    # (H, 2, D/2, ...) -> (H, D/2, 2, ...)
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved row order -> HF order (the inverse of `permute_qk`)."""
    head_dim = w.shape[0] // n_heads
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...)
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
