"""`config.json` of a supported checkpoint -> GGUF hyperparameters and the tensors to expect.

llama, mistral, qwen2, qwen3, gemma3_text and phi3 share one decoder block with per-family
parts (see `llmlocal.models.tensor_names`); they differ in ways that matter for a correct file:

* llama and mistral are written as GGUF architecture ``llama`` and their q/k rows are
  permuted into llama.cpp's interleaved RoPE order; the others keep HF order (NEOX RoPE).
  qwen2 has q/k/v biases; qwen3 and gemma3 normalise each q and k head (QK-norm).
* Llama 3.1+ ``rope_scaling`` of type ``llama3`` becomes a ``rope_freqs.weight`` tensor of
  per-frequency divisors (below); ``linear`` and ``yarn`` become ``rope.scaling.*`` keys.
* Mistral's ``sliding_window`` becomes ``llama.attention.sliding_window`` and phi3's
  ``phi3.attention.sliding_window``, as llama.cpp's converter writes them; llama.cpp's llama and
  phi3 architectures nevertheless attend to the whole context (the conversion warns).
* gemma3: Hugging Face's RMSNorm computes ``x * (1 + w)``, llama.cpp's ``x * w``, so every norm
  weight is written plus one (`norm_offset`). llama.cpp hard-codes Gemma 3's layout: five
  sliding-window layers with RoPE base 10000 then one global layer, an attention scale of
  1/sqrt(head_dim) (1/sqrt(d_model / n_heads) for the 62-layer 27B), no logit soft-capping;
  configs that differ are refused rather than converted into a file that computes something
  else.
* phi3: fused ``qkv_proj`` and ``gate_up_proj`` tensors, partial rotary dimensions, and
  LongRoPE (``rope_scaling`` of type ``longrope``/``su``) as ``rope_factors_long`` /
  ``rope_factors_short`` tensors plus ``rope.scaling.attn_factor``. llama.cpp picks the long
  factors when its context (rounded up to a multiple of 256) exceeds the original one,
  transformers when the sequence does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import Keys
from llmlocal.models.shape import ModelShape
from llmlocal.models.tensor_names import HF_TO_GGUF_ARCH

from .errors import CheckpointError
from .gguf_writer import KV

# HF model_type -> GGUF arch
SUPPORTED = dict(HF_TO_GGUF_ARCH)
PERMUTED_QK = frozenset({"llama", "mistral"})
QK_NORM = frozenset({"qwen3", "gemma3_text"})

# Checkpoint tensors that carry nothing the GGUF needs (precomputed RoPE tables).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# What llama.cpp fixes for Gemma 3 (see the module docstring).
GEMMA3_SWA_PERIOD = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


@dataclass(frozen=True)
class LlamaFamilyConfig(ModelShape):
    """A checkpoint's sizes (`ModelShape`) and what its conversion to GGUF depends on."""

    model_type: str  # HF spelling: "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"
    context_length: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    explicit_head_dim: bool
    rope_scaling: dict[str, Any] | None
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (itself included)
    rope_dims: int = 0  # rotated dimensions per head (0: all of head_dim)
    original_context_length: int | None = None  # phi3: the pre-training context LongRoPE extends

    @property
    def architecture(self) -> str:
        return SUPPORTED[self.model_type]

    @property
    def permutes_qk(self) -> bool:
        return self.model_type in PERMUTED_QK

    @property
    def qk_norm(self) -> bool:
        return self.model_type in QK_NORM

    @property
    def norm_offset(self) -> float:
        """Added to every norm weight on the way out (Gemma's ``1 + w`` RMSNorm)."""
        return 1.0 if self.model_type == "gemma3_text" else 0.0

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

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
                p + "self_attn.o_proj.weight": (d, q_rows),
                p + "mlp.down_proj.weight": (d, self.d_ffn),
            })
            if self.model_type == "phi3":
                shapes.update({
                    p + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, d),
                    p + "mlp.gate_up_proj.weight": (2 * self.d_ffn, d),
                })
            else:
                shapes.update({
                    p + "self_attn.q_proj.weight": (q_rows, d),
                    p + "self_attn.k_proj.weight": (kv_rows, d),
                    p + "self_attn.v_proj.weight": (kv_rows, d),
                    p + "mlp.gate_proj.weight": (self.d_ffn, d),
                    p + "mlp.up_proj.weight": (self.d_ffn, d),
                })
            if self.qk_norm:
                shapes.update({
                    p + "self_attn.q_norm.weight": (self.head_dim,),
                    p + "self_attn.k_norm.weight": (self.head_dim,),
                })
            if self.model_type == "gemma3_text":
                shapes.update({
                    p + "pre_feedforward_layernorm.weight": (d,),
                    p + "post_feedforward_layernorm.weight": (d,),
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

    def adds_to(self, gguf_name: str) -> float:
        """What to add to every value of a tensor on the way out (0: write it as stored)."""
        return self.norm_offset if gguf_name.endswith("norm.weight") else 0.0

    def extra_tensors(self) -> dict[str, np.ndarray]:
        """Tensors the GGUF needs that the checkpoint does not store."""
        scaling = self.rope_scaling or {}
        if scaling.get("type") == "llama3":
            return {"rope_freqs.weight": llama3_rope_divisors(self)}
        if scaling.get("type") == "longrope":
            return {
                "rope_factors_long.weight": np.asarray(scaling["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.asarray(scaling["short_factor"], dtype=np.float32),
            }
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
            KV.u32(Keys.Rope.DIMENSION_COUNT.format(arch=arch), self.rotary_dims),
        ]
        if self.explicit_head_dim or self.model_type in ("qwen3", "gemma3_text"):
            kvs += [
                KV.u32(Keys.Attention.KEY_LENGTH.format(arch=arch), self.head_dim),
                KV.u32(Keys.Attention.VALUE_LENGTH.format(arch=arch), self.head_dim),
            ]
        if self.sliding_window:
            kvs.append(KV.u32(Keys.Attention.SLIDING_WINDOW.format(arch=arch), self.sliding_window))
        scaling = self.rope_scaling or {}
        if scaling.get("type") in ("linear", "yarn"):
            kvs += [
                KV.string(Keys.Rope.SCALING_TYPE.format(arch=arch), scaling["type"]),
                KV.f32(Keys.Rope.SCALING_FACTOR.format(arch=arch), float(scaling["factor"])),
            ]
            if scaling["type"] == "yarn" and scaling.get("original_max_position_embeddings"):
                kvs.append(KV.u32(Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch),
                                  int(scaling["original_max_position_embeddings"])))
        if scaling.get("type") == "longrope":
            kvs.append(KV.f32(Keys.Rope.SCALING_ATTN_FACTOR.format(arch=arch), float(scaling["attention_factor"])))
        if self.original_context_length:
            kvs.append(KV.u32(Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch), self.original_context_length))
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


def _rope_kind(raw: dict[str, Any]) -> str:
    return str(raw.get("rope_type") or raw.get("type") or "default").lower()


def _rope_scaling(config: dict[str, Any], where: str, allowed: tuple[str, ...] = ("linear", "yarn", "llama3"),
                  raw: dict[str, Any] | None = None) -> dict[str, Any] | None:
    if raw is None:
        raw = config.get("rope_scaling")
        if raw is None and isinstance(config.get("rope_parameters"), dict):  # transformers >= 5
            raw = config["rope_parameters"]
    if not isinstance(raw, dict):
        return None
    kind = _rope_kind(raw)
    if kind == "su":
        kind = "longrope"
    if kind == "default":
        return None
    if kind not in allowed:
        raise CheckpointError(
            f"{where} uses rope_scaling of type '{kind}', which llmlocal does not convert for "
            f"{config.get('model_type')} models: remove rope_scaling from config.json to run it at its original "
            "context length."
        )
    if kind in ("linear", "yarn") and "factor" not in raw:
        raise CheckpointError(f"{where} has rope_scaling of type '{kind}' without a factor: fix config.json.")
    return {**raw, "type": kind}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _gemma3_rope(config: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's global-layer RoPE (base, scaling); refuses local RoPE llama.cpp cannot match."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # transformers >= 5
        full = params["full_attention"]
        local = params.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", GEMMA3_LOCAL_ROPE_BASE)
        local_kind = _rope_kind(local)
    else:  # transformers 4: rope_theta, rope_local_base_freq, rope_scaling (global layers only)
        full = {"rope_theta": config.get("rope_theta", 1_000_000.0), **(config.get("rope_scaling") or {})}
        local_theta = config.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE)
        local_kind = "default"
    if local_kind != "default" or float(local_theta) != GEMMA3_LOCAL_ROPE_BASE:
        raise CheckpointError(
            f"{where} gives its sliding-window layers RoPE base {local_theta} ({local_kind}), but llama.cpp runs "
            f"Gemma 3's local layers at base {GEMMA3_LOCAL_ROPE_BASE:g} without scaling: it cannot be converted."
        )
    scaling = _rope_scaling(config, where, allowed=("linear",), raw=full)
    return float(full.get("rope_theta", 1_000_000.0)), scaling


def _check_gemma3(config: dict[str, Any], where: str, n_layers: int, d_model: int, n_heads: int, head_dim: int) -> int:
    """Refuse Gemma 3 configs llama.cpp would run differently; returns the sliding window."""
    window = _positive_int(config.get("sliding_window"))
    if window is None:
        raise CheckpointError(f"{where} lacks a positive 'sliding_window', which llama.cpp needs for Gemma 3: fix config.json.")
    expected = ["full_attention" if (i + 1) % GEMMA3_SWA_PERIOD == 0 else "sliding_attention" for i in range(n_layers)]
    layer_types = config.get("layer_types")
    period = config.get("sliding_window_pattern", config.get("_sliding_window_pattern"))
    if (layer_types is not None and list(layer_types) != expected) or (
            layer_types is None and period is not None and period != GEMMA3_SWA_PERIOD):
        raise CheckpointError(
            f"{where} does not alternate five sliding-window layers with one global layer, the only Gemma 3 "
            "layout llama.cpp runs: it cannot be converted."
        )
    scalar = config.get("query_pre_attn_scalar", head_dim)
    llama_cpp_scalar = d_model / n_heads if n_layers == GEMMA3_27B_LAYERS else head_dim
    if scalar is None or float(scalar) != float(llama_cpp_scalar):
        raise CheckpointError(
            f"{where} scales attention by query_pre_attn_scalar={scalar}, but llama.cpp uses {llama_cpp_scalar:g} "
            f"for a {n_layers}-layer Gemma 3: it cannot be converted."
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise CheckpointError(f"{where} sets {key}, which llama.cpp's Gemma 3 does not apply: it cannot be converted.")
    if config.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{where} is a bidirectional (embedding) Gemma 3, which llmlocal quantize does not convert."
        )
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise CheckpointError(
            f"{where} uses activation '{act}', but llama.cpp's Gemma 3 uses tanh-approximated GELU: it cannot be converted."
        )
    return window


def _phi3_rope(config: dict[str, Any], where: str, head_dim: int, context: int) -> tuple[int, dict[str, Any] | None, int]:
    """phi3: (rotary dims, LongRoPE scaling or None, original context length)."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    scaling = _rope_scaling(config, where, allowed=("longrope",))
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    rope_dims = int(head_dim * float(factor if factor is not None else 1.0))
    if rope_dims <= 0 or rope_dims > head_dim or rope_dims % 2:
        raise CheckpointError(
            f"{where} rotates {rope_dims} of {head_dim} head dimensions (partial_rotary_factor={factor}), which "
            "llama.cpp cannot do: fix config.json."
        )
    original = (config.get("original_max_position_embeddings") or (scaling or {}).get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings") or context)
    if scaling is not None:
        long_f, short_f = scaling.get("long_factor"), scaling.get("short_factor")
        if not isinstance(long_f, list) or not isinstance(short_f, list) or not (len(long_f) == len(short_f) == rope_dims // 2):
            raise CheckpointError(
                f"{where} has LongRoPE factors that are not two lists of {rope_dims // 2} numbers (half the rotary "
                "dimensions): fix config.json."
            )
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            factor = scaling.get("factor") or context / original
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        scaling = {**scaling, "attention_factor": float(attention_factor)}
    return rope_dims, scaling, int(original)


def parse_config(config: dict[str, Any], where: str) -> LlamaFamilyConfig:
    """Validate ``config`` (the parsed config.json found at ``where``)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        archs = config.get("architectures") or [model_type]
        raise CheckpointError(
            f"{where} is a '{model_type}' model ({', '.join(map(str, archs))}); llmlocal quantize "
            "converts llama, mistral, qwen2, qwen3, gemma3_text (Gemma 3 text models) and phi3 checkpoints only."
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        raise CheckpointError(
            f"{where} is already quantized ({method}): convert the original BF16/F16 checkpoint instead."
        )
    if config.get("mlp_bias"):
        raise CheckpointError(f"{where} has MLP biases, which llama.cpp's {SUPPORTED[model_type]} architecture lacks: it cannot be converted.")
    if config.get("attention_bias") and model_type in ("qwen3", "gemma3_text", "phi3"):
        raise CheckpointError(
            f"{where} has attention biases, which llama.cpp's {SUPPORTED[model_type]} architecture lacks: it cannot be converted."
        )

    def need(key: str) -> int:
        value = _positive_int(config.get(key))
        if value is None:
            raise CheckpointError(f"{where} lacks a positive integer '{key}': the config.json is incomplete.")
        return value

    n_layers = need("num_hidden_layers")
    n_heads = need("num_attention_heads")
    d_model = need("hidden_size")
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or d_model // n_heads
    if n_heads % n_kv or head_dim % 2:
        raise CheckpointError(
            f"{where} has {n_heads} attention heads, {n_kv} KV heads and head size {head_dim}, "
            "which do not fit together: fix config.json."
        )
    context = int(config.get("max_position_embeddings") or 4096)
    rope_theta = config.get("rope_theta")
    if rope_theta is None and isinstance(config.get("rope_parameters"), dict):
        rope_theta = config["rope_parameters"].get("rope_theta")
    sliding_window: int | None = None
    rope_dims = 0
    original_context: int | None = None

    if model_type == "gemma3_text":
        sliding_window = _check_gemma3(config, where, n_layers, d_model, n_heads, int(head_dim))
        rope_theta, rope_scaling = _gemma3_rope(config, where)
    elif model_type == "phi3":
        if n_heads * head_dim != d_model:
            raise CheckpointError(
                f"{where} has {n_heads} heads of {head_dim} dimensions for a hidden size of {d_model}; llama.cpp's "
                "phi3 needs them to match: it cannot be converted."
            )
        rope_dims, rope_scaling, original_context = _phi3_rope(config, where, int(head_dim), context)
        sliding_window = _positive_int(config.get("sliding_window"))
    else:
        rope_scaling = _rope_scaling(config, where)
        if model_type == "mistral":
            sliding_window = _positive_int(config.get("sliding_window"))
        if model_type == "qwen3" and config.get("use_sliding_window"):
            raise CheckpointError(
                f"{where} enables use_sliding_window, which llama.cpp's qwen3 does not implement: it cannot be converted."
            )
    if rope_dims == int(head_dim):
        rope_dims = 0
    return LlamaFamilyConfig(
        model_type=model_type,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        d_ffn=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        context_length=context,
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rms_eps=float(config.get("rms_norm_eps") or 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", model_type == "gemma3_text")),
        qkv_bias=model_type == "qwen2" or (model_type in PERMUTED_QK and bool(config.get("attention_bias"))),
        o_bias=model_type in PERMUTED_QK and bool(config.get("attention_bias")),
        explicit_head_dim=config.get("head_dim") is not None and head_dim != d_model // n_heads,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
        rope_dims=rope_dims,
        original_context_length=original_context,
    )
