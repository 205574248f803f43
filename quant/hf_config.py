"""`config.json` of a llama-family checkpoint -> GGUF hyperparameters and the tensors to expect.

llama, mistral and qwen2 share one block (see `llmlocal.models.tensor_names`); they differ in
small ways that matter for a correct file:

* llama and mistral are written as GGUF architecture ``llama`` and their q/k rows are
  permuted into llama.cpp's interleaved RoPE order; qwen2 keeps HF order (NEOX RoPE) and has
  q/k/v biases.
* Llama 3.1+ ``rope_scaling`` of type ``llama3`` becomes a ``rope_freqs.weight`` tensor of
  per-frequency divisors (below); ``linear`` and ``yarn`` become ``rope.scaling.*`` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import Keys

from .errors import CheckpointError
from .gguf_writer import KV

SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # HF model_type -> GGUF arch
PERMUTED_QK = frozenset({"llama", "mistral"})

# Checkpoint tensors that carry nothing the GGUF needs (precomputed RoPE tables).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LlamaFamilyConfig:
    model_type: str  # HF spelling: "llama", "mistral", "qwen2"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    explicit_head_dim: bool
    rope_scaling: dict[str, Any] | None

    @property
    def architecture(self) -> str:
        return SUPPORTED[self.model_type]

    @property
    def permutes_qk(self) -> bool:
        return self.model_type in PERMUTED_QK

    # ---- tensors ------------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name this config implies -> its shape (numpy order). ``lm_head`` is
        listed even when the embeddings are tied; the checkpoint may omit it."""
        d, q_rows, kv_rows = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, d),
            "model.norm.weight": (d,),
            "lm_head.weight": (self.vocab_size, d),
        }
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q_rows, d),
                p + "self_attn.k_proj.weight": (kv_rows, d),
                p + "self_attn.v_proj.weight": (kv_rows, d),
                p + "self_attn.o_proj.weight": (d, q_rows),
                p + "mlp.gate_proj.weight": (self.d_ffn, d),
                p + "mlp.up_proj.weight": (self.d_ffn, d),
                p + "mlp.down_proj.weight": (d, self.d_ffn),
            })
            if self.qkv_bias:
                shapes.update({
                    p + "self_attn.q_proj.bias": (q_rows,),
                    p + "self_attn.k_proj.bias": (kv_rows,),
                    p + "self_attn.v_proj.bias": (kv_rows,),
                })
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (d,)
        return shapes

    def permute_heads(self, gguf_name: str) -> int:
        """Heads to permute a tensor's rows with (0: keep the order). K uses the KV head count."""
        if not self.permutes_qk:
            return 0
        if ".attn_q." in gguf_name:
            return self.n_heads
        if ".attn_k." in gguf_name:
            return self.n_kv_heads
        return 0

    def extra_tensors(self) -> dict[str, np.ndarray]:
        """Tensors the GGUF needs that the checkpoint does not store."""
        if self.rope_scaling and self.rope_scaling.get("type") == "llama3":
            return {"rope_freqs.weight": llama3_rope_divisors(self)}
        return {}

    # ---- metadata -----------------------------------------------------------------------
    def metadata(self) -> list[KV]:
        arch = self.architecture
        kvs = [
            KV.u32(Keys.LLM.VOCAB_SIZE.format(arch=arch), self.vocab_size),
            KV.u32(Keys.LLM.CONTEXT_LENGTH.format(arch=arch), self.context_length),
            KV.u32(Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), self.d_model),
            KV.u32(Keys.LLM.BLOCK_COUNT.format(arch=arch), self.n_layers),
            KV.u32(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch), self.d_ffn),
            KV.u32(Keys.Attention.HEAD_COUNT.format(arch=arch), self.n_heads),
            KV.u32(Keys.Attention.HEAD_COUNT_KV.format(arch=arch), self.n_kv_heads),
            KV.f32(Keys.Rope.FREQ_BASE.format(arch=arch), self.rope_theta),
            KV.f32(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch), self.rms_eps),
            KV.u32(Keys.Rope.DIMENSION_COUNT.format(arch=arch), self.head_dim),
        ]
        if self.explicit_head_dim:
            kvs += [
                KV.u32(Keys.Attention.KEY_LENGTH.format(arch=arch), self.head_dim),
                KV.u32(Keys.Attention.VALUE_LENGTH.format(arch=arch), self.head_dim),
            ]
        scaling = self.rope_scaling or {}
        if scaling.get("type") in ("linear", "yarn"):
            kvs += [
                KV.string(Keys.Rope.SCALING_TYPE.format(arch=arch), scaling["type"]),
                KV.f32(Keys.Rope.SCALING_FACTOR.format(arch=arch), float(scaling["factor"])),
            ]
            if scaling["type"] == "yarn" and scaling.get("original_max_position_embeddings"):
                kvs.append(KV.u32(Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch),
                                  int(scaling["original_max_position_embeddings"])))
        return kvs


def llama3_rope_divisors(cfg: LlamaFamilyConfig) -> np.ndarray:
    """Llama 3.1's long-context RoPE as llama.cpp applies it: frequency i is divided by f_i.

    With wavelength w_i = 2 pi / theta_i, original context L, factor s, and low/high frequency
    factors a < b: f_i = 1 when w_i < L / b (high frequencies untouched), f_i = s when
    w_i > L / a (low frequencies stretched s times), and between them
    f_i = 1 / ((1 - t) / s + t) with t = (L / w_i - a) / (b - a), a smooth blend.
    """
    scaling = cfg.rope_scaling or {}
    s = float(scaling.get("factor", 8.0))
    a = float(scaling.get("low_freq_factor", 1.0))
    b = float(scaling.get("high_freq_factor", 4.0))
    length = float(scaling.get("original_max_position_embeddings", 8192))
    dim = cfg.head_dim
    thetas = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))  # (dim/2,)
    divisors = []
    for theta in thetas.astype(np.float64):
        wavelength = 2 * math.pi / theta
        if wavelength < length / b:
            divisors.append(1.0)
        elif wavelength > length / a:
            divisors.append(s)
        else:
            t = (length / wavelength - a) / (b - a)
            divisors.append(1.0 / ((1 - t) / s + t))
    return np.asarray(divisors, dtype=np.float32)


def _rope_scaling(config: dict[str, Any], where: str) -> dict[str, Any] | None:
    raw = config.get("rope_scaling")
    if raw is None and isinstance(config.get("rope_parameters"), dict):  # transformers >= 5
        raw = config["rope_parameters"]
    if not isinstance(raw, dict):
        return None
    kind = str(raw.get("rope_type") or raw.get("type") or "default").lower()
    if kind == "default":
        return None
    if kind not in ("linear", "yarn", "llama3"):
        raise CheckpointError(
            f"{where} uses rope_scaling of type '{kind}', which llmlocal does not convert: remove "
            "rope_scaling from config.json to run it at its original context length."
        )
    if kind != "llama3" and "factor" not in raw:
        raise CheckpointError(f"{where} has rope_scaling of type '{kind}' without a factor: fix config.json.")
    return {**raw, "type": kind}


def parse_config(config: dict[str, Any], where: str) -> LlamaFamilyConfig:
    """Validate ``config`` (the parsed config.json found at ``where``)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        archs = config.get("architectures") or [model_type]
        raise CheckpointError(
            f"{where} is a '{model_type}' model ({', '.join(map(str, archs))}); llmlocal quantize "
            "converts llama, mistral and qwen2 checkpoints only."
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        raise CheckpointError(
            f"{where} is already quantized ({method}): convert the original BF16/F16 checkpoint instead."
        )
    if config.get("mlp_bias"):
        raise CheckpointError(f"{where} has MLP biases, which llama.cpp's llama architecture lacks: it cannot be converted.")

    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{where} lacks a positive integer '{key}': the config.json is incomplete.")
        return value

    n_heads = need("num_attention_heads")
    d_model = need("hidden_size")
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or d_model // n_heads
    if n_heads % n_kv or head_dim % 2:
        raise CheckpointError(
            f"{where} has {n_heads} attention heads, {n_kv} KV heads and head size {head_dim}, "
            "which do not fit together: fix config.json."
        )
    rope_theta = config.get("rope_theta")
    if rope_theta is None and isinstance(config.get("rope_parameters"), dict):
        rope_theta = config["rope_parameters"].get("rope_theta")
    return LlamaFamilyConfig(
        model_type=model_type,
        n_layers=need("num_hidden_layers"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        d_ffn=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        context_length=int(config.get("max_position_embeddings") or 4096),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rms_eps=float(config.get("rms_norm_eps") or 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias")),
        o_bias=model_type != "qwen2" and bool(config.get("attention_bias")),
        explicit_head_dim=config.get("head_dim") is not None and head_dim != d_model // n_heads,
        rope_scaling=_rope_scaling(config, where),
    )
