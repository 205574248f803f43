"""`ModelConfig`: the hyperparameters of the engine's one decoder, from GGUF or HF.

The families the engine runs (llama, mistral, qwen2, qwen3, gemma3, phi3) are one decoder with
options, and a family is the set of options it turns on (`_FAMILY` below; tensor names in
`llmlocal.models.tensor_names`):

* ``qk_norm``: an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3);
* ``sandwich_norms``: RMSNorms after the attention and after the MLP too, before each
  residual add (Gemma 3);
* ``activation``: the gated MLP's nonlinearity, SiLU or GELU-tanh (Gemma 3);
* ``embed_scale``: embeddings multiplied by sqrt(d_model) (Gemma 3);
* ``layer_windows``: per layer, the sliding window it attends over (0: the whole context),
  with ``rope_local_theta`` the RoPE base of the windowed layers (Gemma 3: five local layers
  of window 512 and base 10^4, then a global one of base 10^6; Mistral and Phi-3: one window
  for all layers);
* ``attn_scale``: the softmax scale, when it is not head_dim^-1/2 (Gemma 3's
  query_pre_attn_scalar); ``final_softcap``: logits squashed as c tanh(z / c) (Gemma 2 style);
* RoPE scaling: linear, llama3 (Llama 3.1+), longrope (Phi-3's per-frequency factors with
  a magnitude on cos and sin).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmlocal.models import ModelSpec
from llmlocal.models.errors import ModelFormatError
from llmlocal.models.shape import ModelShape
from llmlocal.models.tensor_names import ENGINE_ARCHS, gguf_arch, text_config


class UnsupportedArchitectureError(ModelFormatError):
    """The paged engine does not implement this architecture."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "none" | "linear" | "llama3" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    divisors: tuple[float, ...] = ()  # longrope: the per-frequency factors chosen for the context
    magnitude: float = 1.0  # longrope: cos and sin are multiplied by it (the attention factor)


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The decoder the paged engine runs: its sizes (`ModelShape`) and the family's options."""

    architecture: str
    max_position: int
    rope_theta: float
    rope_scaling: RopeScaling
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    layer_windows: tuple[int, ...] = ()  # per layer (0: whole context); () for none windowed
    rope_local_theta: float | None = None  # RoPE base of windowed layers, None: rope_theta
    final_softcap: float = 0.0
    rope_dims: int = 0  # dimensions of each q/k head that rotate (0: all; Phi-4-mini rotates 3/4)

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def local_rope(self, layer: int) -> bool:
        """Whether the layer rotates with the windowed layers' own RoPE table."""
        return self.rope_local_theta is not None and self.window(layer) > 0

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies theta^(-2i/D), with the model's scaling applied.

        llama3 scaling (Llama 3.1+): wavelengths longer than original_max / low_freq_factor are
        divided by `factor`, those shorter than original_max / high_freq_factor are kept, and
        the band between is interpolated smoothly.
        """
        d = self.rotary_dims
        freqs = [self.rope_theta ** (-(2 * i) / d) for i in range(d // 2)]
        return self._scaled(freqs) + self._still()

    def _still(self) -> list[float]:
        """Frequency 0 for the pairs past the rotary dimensions: they do not rotate."""
        return [0.0] * ((self.head_dim - self.rotary_dims) // 2)

    def _scaled(self, freqs: list[float]) -> list[float]:
        s = self.rope_scaling
        if s.kind == "longrope":  # (a GGUF stores the factors as tensors, which the loader applies)
            return [f / r for f, r in zip(freqs, s.divisors)] if s.divisors else freqs
        if s.kind == "linear":
            return [f / s.factor for f in freqs]
        if s.kind == "llama3":
            low_wavelen = s.original_max_position / s.low_freq_factor
            high_wavelen = s.original_max_position / s.high_freq_factor
            out = []
            for f in freqs:
                wavelen = 2 * math.pi / f
                if wavelen < high_wavelen:
                    out.append(f)
                elif wavelen > low_wavelen:
                    out.append(f / s.factor)
                else:
                    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                        s.high_freq_factor - s.low_freq_factor
                    )
                    out.append((1 - smooth) * f / s.factor + smooth * f)
            return out
        return freqs

    def local_inv_freq(self) -> list[float]:
        """RoPE inverse frequencies of the windowed layers (unscaled, base rope_local_theta)."""
        d, base = self.rotary_dims, self.rope_local_theta or self.rope_theta
        return [base ** (-(2 * i) / d) for i in range(d // 2)] + self._still()


# What each GGUF architecture turns on, beyond the llama block (see the module docstring).
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3": {"qk_norm": True},
    "gemma3": {"qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh"},
}
GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: layers 5, 11, 17, ... attend globally, the others in a window
GEMMA3_LOCAL_THETA = 10000.0


def _windows(arch: str, n_layers: int, window: int, layer_types: list[str] | None = None) -> tuple[int, ...]:
    """Per-layer windows: Hugging Face's layer_types when given; else Gemma 3's pattern, or the
    one window on every layer."""
    if not window:
        return ()
    if layer_types:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if arch == "gemma3":
        return tuple(0 if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window for i in range(n_layers))
    return (window,) * n_layers


def _check_arch(arch: str, where: str) -> None:
    if gguf_arch(arch) not in ENGINE_ARCHS:
        raise UnsupportedArchitectureError(
            f"The paged engine runs llama, mistral, qwen2, qwen3, gemma3 and phi3 models, not '{arch}' "
            f"({where}): use --backend llamacpp."
        )


def config_from_spec(spec: ModelSpec) -> ModelConfig:
    """Hyperparameters of a GGUF model from its header (llama.cpp's keys for each family)."""
    _check_arch(spec.architecture, spec.path)
    arch = gguf_arch(spec.architecture)
    md = spec.metadata
    names = {t.name for t in spec.tensors}

    def key(suffix: str, default: Any = None) -> Any:
        return md.get(f"{spec.architecture}.{suffix}", default)

    kind = str(key("rope.scaling.type", "none"))
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    if "rope_factors_long.weight" in names:  # Phi-3 longrope: the loader divides by the chosen factors
        scaling = RopeScaling("longrope", original_max_position=int(key("rope.scaling.original_context_length", 4096)),
                              magnitude=float(key("rope.scaling.attn_factor", 1.0) or 1.0))
    elif kind == "linear" and factor != 1.0:
        scaling = RopeScaling("linear", factor)
    elif kind in ("none", "linear"):
        # llama3-style scaling is stored in GGUF as a `rope_freqs.weight` tensor of per-frequency
        # divisors, which the weight loader applies; nothing to do here.
        scaling = RopeScaling("none")
    else:
        raise UnsupportedArchitectureError(
            f"{spec.path} uses '{kind}' RoPE scaling, which the paged engine does not implement: use --backend llamacpp."
        )
    gemma = arch == "gemma3"
    return ModelConfig(
        architecture=arch,
        n_layers=spec.n_layers,
        d_model=spec.d_model,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        d_ffn=spec.d_ffn,
        vocab_size=spec.vocab_size,
        max_position=spec.context_length,
        rope_theta=spec.rope_freq_base or 10000.0,
        rope_scaling=scaling,
        norm_eps=spec.norm_eps or 1e-5,
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        **_FAMILY.get(arch, {}),
        embed_scale=math.sqrt(spec.d_model) if gemma else 1.0,
        # llama.cpp scales Gemma 3 27B's queries by (d / heads)^-1/2, the others by head_dim^-1/2
        attn_scale=(spec.d_model / spec.n_heads) ** -0.5 if gemma and spec.n_layers == 62 else None,
        layer_windows=_windows(arch, spec.n_layers, int(key("attention.sliding_window", 0) or 0)),
        rope_local_theta=GEMMA3_LOCAL_THETA if gemma else None,
        final_softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
        rope_dims=_rope_dims(int(key("rope.dimension_count", 0) or 0), spec.head_dim, spec.path),
    )


def _rope_dims(dims: int, head_dim: int, where: str) -> int:
    """The rotated dimensions of a head (0: all of them)."""
    if dims in (0, head_dim):
        return 0
    if dims > head_dim or dims % 2:
        raise ModelFormatError(f"{where} rotates {dims} of {head_dim} head dimensions, which cannot be: fix the file.")
    return dims


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _rope_parameters(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global, windowed layers') RoPE parameters: transformers >= 5 writes `rope_parameters`
    (per layer type for Gemma 3), older versions `rope_theta` and `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return params["full_attention"], params.get("sliding_attention")
    if isinstance(params, dict):
        return params, None
    out = dict(raw.get("rope_scaling") or {})
    out.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    local = {"rope_theta": raw["rope_local_base_freq"]} if "rope_local_base_freq" in raw else None
    return out, local


def _hf_scaling(rs: dict[str, Any], raw: dict[str, Any], context: int | None, path: Path) -> RopeScaling:
    kind = rs.get("rope_type", rs.get("type", "none"))
    if kind in (None, "default", "none"):
        return RopeScaling("none")
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    if kind in ("longrope", "su"):
        # Phi-3: long factors when the context runs past the original one (as llama.cpp picks
        # them, by the context it is given), cos and sin scaled by the attention factor
        original = int(rs.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or 4096)
        longest = int(raw.get("max_position_embeddings", original))
        long = (context or longest) > original
        magnitude = rs.get("attention_factor")
        if magnitude is None:
            stretch = longest / original
            magnitude = 1.0 if stretch <= 1.0 else math.sqrt(1 + math.log(stretch) / math.log(original))
        factors = rs["long_factor" if long else "short_factor"]
        return RopeScaling("longrope", original_max_position=original, divisors=tuple(map(float, factors)),
                           magnitude=float(magnitude))
    raise UnsupportedArchitectureError(
        f"{path} uses '{kind}' RoPE scaling, which the paged engine does not implement: use --backend llamacpp."
    )


def config_from_hf(directory: str | Path, context: int | None = None) -> ModelConfig:
    """Hyperparameters of a Hugging Face checkpoint from its config.json (``context``: the
    context the model will run with, for RoPE scalings that depend on it)."""
    path = Path(directory) / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{directory} has no config.json: pass a Hugging Face checkpoint directory.") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path} is not valid JSON ({e.msg}): restore the file from the checkpoint.") from None
    raw = text_config(raw)  # a multimodal checkpoint (Gemma 3 4B and up): its language model
    model_type = str(raw.get("model_type", "unknown"))
    _check_arch(model_type, str(path))
    arch = gguf_arch(model_type)
    n_heads = int(raw["num_attention_heads"])
    d_model = int(raw["hidden_size"])
    n_layers = int(raw["num_hidden_layers"])
    rope, local_rope = _rope_parameters(raw)
    act_name = str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu")
    if act_name not in _ACTIVATIONS:
        raise UnsupportedArchitectureError(f"{path} uses the activation '{act_name}', which the paged engine does not implement: use --backend llamacpp.")
    gemma = arch == "gemma3"
    window = int(raw.get("sliding_window") or 0)
    if arch in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = 0
    layer_types = raw.get("layer_types")
    if gemma and not layer_types:
        every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or GEMMA3_GLOBAL_EVERY)
        layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
    head_dim = int(raw.get("head_dim") or d_model // n_heads)
    return ModelConfig(
        architecture=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        d_ffn=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=_hf_scaling(rope, raw, context, path),
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        qkv_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        **{**_FAMILY.get(arch, {}), "activation": _ACTIVATIONS[act_name]},
        embed_scale=math.sqrt(d_model) if gemma else 1.0,
        attn_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if raw.get("query_pre_attn_scalar") else None,
        layer_windows=_windows(arch, n_layers, window, layer_types),
        rope_local_theta=float((local_rope or {}).get("rope_theta", GEMMA3_LOCAL_THETA)) if gemma else None,
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        rope_dims=_rope_dims(int(head_dim * float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)),
                             head_dim, str(path)),
    )
