"""Tensor names of the decoder families the engine runs, in GGUF and Hugging Face form, and
llama.cpp's Q/K row order.

Every family is one block with per-family parts (the model code reads them as options; see
`engine/model/config.py`):

* llama, mistral, qwen2: attention (q, k, v, o; qwen2 adds q/k/v biases), a SwiGLU MLP
  (gate, up, down), an RMSNorm before each;
* qwen3: llama's block plus an RMSNorm on each q and k head (QK-norm), no biases;
* gemma3: QK-norm, and RMSNorms both before and after the attention and the MLP ("sandwich"
  norms; Hugging Face's ``post_attention_layernorm`` is the norm *after* the attention here,
  not the one before the MLP as in llama);
* phi3: q, k, v in one fused ``qkv_proj`` and gate, up in one ``gate_up_proj``.

GGUF architecture names are llama.cpp's: a Hugging Face ``mistral`` checkpoint is written as
``llama``, ``gemma3_text`` as ``gemma3``.

Q/K row order. Hugging Face llama checkpoints apply RoPE with `rotate_half`: within a head of
dimension D, rows i and i + D/2 form the rotated pair. llama.cpp's converter reorders the
rows of q and k (for the `llama` architecture, which covers mistral) so that pairs are
adjacent, rows 2i and 2i + 1, which its "normal" RoPE expects:

    HF   per head: (2, D/2, ...)  [x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}]
    GGUF per head: (D/2, 2, ...)  [x_0, y_0, x_1, y_1, ...]

qwen2, qwen3, gemma3 and phi3 GGUFs keep the HF order (llama.cpp runs them with NEOX RoPE,
which is `rotate_half`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy only for the permutations: the planner imports the tables at startup
    import numpy as np

_CORE: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_SEPARATE_QKV: dict[str, str] = {
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
}
_QK_NORM: dict[str, str] = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
_LLAMA_MLP_NORM = {"blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}

# GGUF architecture -> {GGUF name (with {i} for the block) -> Hugging Face name}
FAMILY_TENSORS: dict[str, dict[str, str]] = {
    "llama": _CORE | _SEPARATE_QKV | _LLAMA_MLP_NORM,
    "qwen2": _CORE | _SEPARATE_QKV | _LLAMA_MLP_NORM,
    "qwen3": _CORE | _SEPARATE_QKV | _LLAMA_MLP_NORM | _QK_NORM,
    "gemma3": _CORE | _SEPARATE_QKV | _QK_NORM | {
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
    "phi3": _CORE | _LLAMA_MLP_NORM | {
        "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
        "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",  # gate rows, then up rows
    },
}
FAMILY_TENSORS["mistral"] = FAMILY_TENSORS["llama"]

# Hugging Face model_type -> GGUF architecture
HF_TO_GGUF_ARCH: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # a multimodal checkpoint: its language model (`text_config`)
    "phi3": "phi3",
}
# Multimodal checkpoints whose language model is one of the families (Gemma 3 4B and up): the
# config nests the text model's keys under `text_config`, the weights sit under a prefix, and
# the vision tower and its projector are not the language model (llama.cpp writes those to a
# separate mmproj file).
MULTIMODAL_TEXT: dict[str, str] = {"gemma3": "gemma3_text"}
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(raw: dict) -> dict:
    """The language model's config.json: a multimodal checkpoint's `text_config` (its
    model_type made the text model's), or ``raw`` itself."""
    kind = raw.get("model_type")
    inner = raw.get("text_config")
    if kind not in MULTIMODAL_TEXT or not isinstance(inner, dict):
        return raw
    out = dict(inner)
    out["model_type"] = MULTIMODAL_TEXT[kind]
    if "tie_word_embeddings" in raw:
        out.setdefault("tie_word_embeddings", raw["tie_word_embeddings"])
    return out


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model's terms (``model.layers...``), or None for
    another tower's tensor (vision, projector)."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith(_OTHER_TOWERS):
        return None
    return name


# GGUF architectures the engine's own decoder runs
ENGINE_ARCHS = frozenset(FAMILY_TENSORS)
LLAMA_FAMILY = ENGINE_ARCHS  # the name older callers use

# Architectures whose GGUF q/k rows are in llama.cpp's interleaved order.
PERMUTED_QK_ARCHS = frozenset({"llama", "mistral"})

# What the paged engine's model code runs: GGUF architectures and Hugging Face model types.
PAGED_ARCHS = ENGINE_ARCHS | frozenset(HF_TO_GGUF_ARCH)

# the llama tables, by their old names
GGUF_TO_HF: dict[str, str] = FAMILY_TENSORS["llama"]
HF_TO_GGUF: dict[str, str] = {v: k for k, v in GGUF_TO_HF.items()}


def gguf_arch(arch: str) -> str:
    """The GGUF architecture name of ``arch`` (a GGUF name, or a Hugging Face model_type)."""
    return HF_TO_GGUF_ARCH.get(arch, arch)


_BLOCK = re.compile(r"\.(\d+)\.")


def _pattern(name: str) -> tuple[str, int | None]:
    m = _BLOCK.search(name)
    if not m:
        return name, None
    return name[: m.start()] + ".{i}." + name[m.end() :], int(m.group(1))


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of ``arch``, or None if the family has no such tensor."""
    pattern, i = _pattern(name)
    hf = FAMILY_TENSORS.get(gguf_arch(arch), {}).get(pattern)
    return hf.format(i=i) if hf is not None else None


def hf_to_gguf_name(name: str, arch: str = "llama") -> str | None:
    """The GGUF name of a Hugging Face tensor of ``arch`` (GGUF name or model_type), or None."""
    pattern, i = _pattern(name)
    table = FAMILY_TENSORS.get(gguf_arch(arch), {})
    g = next((k for k, v in table.items() if v == pattern), None)
    return g.format(i=i) if g is not None else None


def permute_qk(w: np.ndarray, n_heads: int, rotary: int = 0) -> np.ndarray:
    """HF row order -> llama.cpp's interleaved order (what the converter does to q and k).

    ``w`` is (n_heads * head_dim, ...) — a weight (rows x in) or a bias (rows,). ``rotary`` > 0:
    only the first ``rotary`` rows of each head rotate (partial RoPE); the rest keep their order.
    """
    head_dim = w.shape[0] // n_heads
    if rotary and rotary < head_dim:
        import numpy as np

        heads = w.reshape(n_heads, head_dim, *w.shape[1:])
        rot = heads[:, :rotary].reshape(n_heads * rotary, *w.shape[1:])
        rot = permute_qk(rot, n_heads).reshape(n_heads, rotary, *w.shape[1:])
        return np.concatenate([rot, heads[:, rotary:]], axis=1).reshape(w.shape)
    # (H, 2, D/2, ...) -> (H, D/2, 2, ...)
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved row order -> HF order (the inverse of `permute_qk`)."""
    head_dim = w.shape[0] // n_heads
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...)
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
