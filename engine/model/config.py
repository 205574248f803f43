"""`ModelConfig`: the hyperparameters the Llama-family model code needs, from GGUF or HF."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmlocal.models import ModelSpec
from llmlocal.models.errors import ModelFormatError
from llmlocal.models.tensor_names import LLAMA_FAMILY


class UnsupportedArchitectureError(ModelFormatError):
    """The paged engine does not implement this architecture."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "none" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rope_scaling: RopeScaling
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies theta^(-2i/D), with the model's scaling applied.

        llama3 scaling (Llama 3.1+): wavelengths longer than original_max / low_freq_factor are
        divided by `factor`, those shorter than original_max / high_freq_factor are kept, and
        the band between is interpolated smoothly.
        """
        d = self.head_dim
        freqs = [self.rope_theta ** (-(2 * i) / d) for i in range(d // 2)]
        s = self.rope_scaling
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


def _check_arch(arch: str, where: str) -> None:
    if arch not in LLAMA_FAMILY:
        raise UnsupportedArchitectureError(
            f"The paged engine runs llama, mistral and qwen2 models, not '{arch}' ({where}): "
            "use --backend llamacpp."
        )


def config_from_spec(spec: ModelSpec) -> ModelConfig:
    """Hyperparameters of a GGUF model from its header."""
    arch = spec.architecture
    _check_arch(arch, spec.path)
    md = spec.metadata
    names = {t.name for t in spec.tensors}
    kind = str(md.get(f"{arch}.rope.scaling.type", "none"))
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind == "linear" and factor != 1.0:
        scaling = RopeScaling("linear", factor)
    elif kind in ("none", "linear"):
        # llama3-style scaling is stored in GGUF as a `rope_freqs.weight` tensor of per-frequency
        # divisors, which the weight loader applies; nothing to do here.
        scaling = RopeScaling("none")
    else:
        raise UnsupportedArchitectureError(
            f"{spec.path} uses '{kind}' RoPE scaling, which the paged engine does not implement: use --backend llamacpp."
        )
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
        qkv_bias="blk.0.attn_q.bias" in names,
    )


def config_from_hf(directory: str | Path) -> ModelConfig:
    """Hyperparameters of a Hugging Face checkpoint from its config.json."""
    path = Path(directory) / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{directory} has no config.json: pass a Hugging Face checkpoint directory.") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path} is not valid JSON ({e.msg}): restore the file from the checkpoint.") from None
    arch = str(raw.get("model_type", "unknown"))
    _check_arch(arch, str(path))
    n_heads = int(raw["num_attention_heads"])
    d_model = int(raw["hidden_size"])
    rs = raw.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "none")) if rs else "none"
    if kind in (None, "default", "none"):
        scaling = RopeScaling("none")
    elif kind == "linear":
        scaling = RopeScaling("linear", float(rs["factor"]))
    elif kind == "llama3":
        scaling = RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    else:
        raise UnsupportedArchitectureError(
            f"{path} uses '{kind}' RoPE scaling, which the paged engine does not implement: use --backend llamacpp."
        )
    return ModelConfig(
        architecture=arch,
        n_layers=int(raw["num_hidden_layers"]),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d_model // n_heads),
        d_ffn=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", arch == "qwen2")),
    )
