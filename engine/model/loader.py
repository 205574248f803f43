"""Build a `LlamaModel` from a GGUF file or a Hugging Face checkpoint directory.

Weight storage (`weights`):
  "auto"  INT4 for tensors stored in a 4-bit GGUF format (exact, no requantization), the run
          dtype for everything else;
  "dense" everything dequantized to the run dtype;
  "int4"  like auto, and float tensors quantized to INT4 (group 32, min/max) at load;
  "int8"  per-channel INT8 for every projection.
Tensors are read one at a time from memory-mapped files, so peak memory stays near the
size of the loaded model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from llmlocal.models import ModelSpec
from llmlocal.models.errors import LLMLocalError, ModelFormatError
from llmlocal.models.tensor_names import PERMUTED_QK_ARCHS, permute_qk
from llmlocal.native.sparse_int4.qlayout import FORMATS as QUANT_FORMATS
from llmlocal.native.sparse_int4.qlayout import QuantCodes, decode

from .config import config_from_hf, config_from_spec

from .gguf_tensors import INT4_TYPES, GGUFTensors, Int4Codes, QuantEmbedding
from .linear import DenseLinear, Int4Linear, Int8Linear, Linear
from .llama import DecoderLayer, LlamaModel, RMSNorm

WEIGHT_MODES = ("auto", "dense", "int4", "int8")
FLOAT_TYPES = frozenset({0, 1, 30})  # ggml F32, F16, BF16


@dataclass
class _Part:
    """One projection's weight: exact INT4 codes when the source has them, else floats (each
    built only when the layer asks for it)."""

    int4: Callable[[], Int4Codes] | None
    dense: Callable[[], np.ndarray]  # (N, K) float32, materialized on demand
    bias: np.ndarray | None = None
    quant: Callable[[], QuantCodes] | None = None  # a GGUF type the native kernels read in its own bytes


def quantize_int4(w: np.ndarray, group: int = 32) -> Int4Codes:
    """Asymmetric min/max INT4 per group of `group` inputs, in the W = (q - 8) s + z form."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)  # (N, K/g)
    scale = np.maximum((hi - lo) / 15.0, 1e-12).astype(np.float32)
    codes = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return Int4Codes(codes.reshape(n, k), scale, (lo + 8.0 * scale).astype(np.float32), group)


# Builds the layer for exact INT4 codes (rows of the fused parts concatenated) and a bias;
# the default is `Int4Linear`, the sparse backend passes its own.
Int4Factory = Callable[[Int4Codes, "torch.Tensor | None"], nn.Module]
# Builds the layer for GGUF quantized parts in their own bytes (the native CPU path), or returns
# None to leave them to the INT4 / dense paths.
QuantFactory = Callable[[list[QuantCodes], "torch.Tensor | None"], "nn.Module | None"]


def _fuse(
    parts: list[_Part],
    mode: str,
    dtype: torch.dtype,
    device: torch.device,
    int4: Int4Factory | None = None,
    quant: QuantFactory | None = None,
) -> Linear:
    """Concatenate projections along their output rows into one linear layer."""
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.from_numpy(np.concatenate([p.bias if p.bias is not None else np.zeros(0) for p in parts]))
        bias = bias.to(device=device, dtype=dtype)
    if quant is not None and mode == "auto" and all(p.quant is not None for p in parts):
        layer = quant([p.quant() for p in parts if p.quant is not None], bias)
        if layer is not None:
            return layer  # type: ignore[return-value]
    codes: list[Int4Codes] | None = None
    if mode in ("auto", "int4") and all(p.int4 is not None for p in parts):
        codes = [p.int4() for p in parts if p.int4 is not None]
    elif mode == "int4":
        dense = [p.dense() for p in parts]
        if all(w.shape[1] % 32 == 0 for w in dense):
            codes = [quantize_int4(w) for w in dense]
        else:
            return DenseLinear(torch.from_numpy(np.concatenate(dense)).to(device=device, dtype=dtype), bias)
    if codes is None:
        w = torch.from_numpy(np.concatenate([p.dense() for p in parts])).to(dtype)
        if mode == "int8":
            return Int8Linear(w.to(device), bias)
        return DenseLinear(w.to(device), bias)
    if int4 is not None:
        fused = codes[0] if len(codes) == 1 else Int4Codes(
            np.concatenate([c.codes for c in codes]),
            np.concatenate([c.scale for c in codes]),
            np.concatenate([c.zero for c in codes]),
        )
        return int4(fused, bias)  # type: ignore[return-value]
    return Int4Linear(
        torch.from_numpy(np.concatenate([c.codes for c in codes]).astype(np.int32)),
        torch.from_numpy(np.concatenate([c.scale for c in codes])),
        torch.from_numpy(np.concatenate([c.zero for c in codes])),
        group_size=32,
        bias=bias,
        device=device,
    ).to(device)


def _check_mode(weights: str) -> None:
    if weights not in WEIGHT_MODES:
        raise LLMLocalError(f"Unknown weight mode '{weights}': choose one of {', '.join(WEIGHT_MODES)}.")


def load_gguf(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    weights: str = "auto",
    max_position: int | None = None,
    int4: Int4Factory | None = None,
    quant: QuantFactory | None = None,
) -> LlamaModel:
    """The model of a GGUF file. ``quant`` builds the projections (and the output head) whose
    parts are all in GGUF types the native kernels read in their own bytes; ``int4`` those
    whose source is INT4 (all parts of a fused projection must be), and the output head when
    its source is; the others follow ``weights``."""
    _check_mode(weights)
    cfg = config_from_spec(spec)
    t = GGUFTensors(spec)
    # the model wants q/k rows in the interleaved RoPE layout, which llama/mistral GGUFs have
    permute = cfg.architecture not in PERMUTED_QK_ARCHS

    def need(name: str) -> str:
        if name not in t:
            raise ModelFormatError(f"{spec.path} has no tensor '{name}': the file is incomplete; convert it again.")
        return name

    def part(name: str, heads: int | None = None) -> _Part:
        need(name)
        info = t.info(name)
        fix = (lambda a: permute_qk(a, heads)) if heads and permute else (lambda a: a)
        int4 = None
        if info.ggml_type in INT4_TYPES and info.shape[0] % 32 == 0:
            def int4() -> Int4Codes:
                c = t.int4(name)
                return Int4Codes(fix(c.codes), fix(c.scale), fix(c.zero))
        bias_name = name.replace(".weight", ".bias")
        bias = fix(t.float32(bias_name)) if bias_name in t else None
        q = None
        fmt = QUANT_FORMATS.get(info.ggml_type)
        if quant is not None and fmt is not None and info.shape[0] % fmt.dgroup == 0:
            q = lambda: _fix_rows(decode(t.raw(name), info.ggml_type), fix)  # noqa: E731
        return _Part(int4, lambda: fix(t.float32(name)), bias, q)

    def vec(name: str) -> torch.Tensor:
        return torch.from_numpy(t.float32(need(name)).copy()).to(device=device, dtype=torch.float32)

    def layer(i: int) -> DecoderLayer:
        b = f"blk.{i}."
        qkv = _fuse(
            [part(b + "attn_q.weight", cfg.n_heads), part(b + "attn_k.weight", cfg.n_kv_heads), part(b + "attn_v.weight")],
            weights, dtype, device, int4, quant,
        )
        o = _fuse([part(b + "attn_output.weight")], weights, dtype, device, int4, quant)
        gate_up = _fuse([part(b + "ffn_gate.weight"), part(b + "ffn_up.weight")], weights, dtype, device, int4, quant)
        down = _fuse([part(b + "ffn_down.weight")], weights, dtype, device, int4, quant)
        return DecoderLayer(cfg, RMSNorm(vec(b + "attn_norm.weight"), cfg.norm_eps), qkv, o,
                            RMSNorm(vec(b + "ffn_norm.weight"), cfg.norm_eps), gate_up, down)

    if device.type == "cpu":  # independent layers, built by a thread per core (numpy and the C packer release the GIL)
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            layers = list(pool.map(layer, range(cfg.n_layers)))
    else:
        layers = [layer(i) for i in range(cfg.n_layers)]
    head = "token_embd.weight" if cfg.tie_embeddings else "output.weight"
    native_head = None  # the file's own bytes: reads what the file holds, no more
    if quant is not None and weights == "auto":
        hp = part(head)
        native_head = quant([hp.quant()], None) if hp.quant is not None else None
    if native_head is None and int4 is not None and t.info(head).ggml_type in INT4_TYPES and t.info(head).shape[0] % 32 == 0:
        native_head = int4(t.int4(head), None)  # exact 4-bit codes: the head reads half of INT8's bytes
    lm_head = native_head
    if lm_head is None and not cfg.tie_embeddings:
        lm_head = _fuse([part("output.weight")], weights, dtype, device)
    emb_type = t.info(need("token_embd.weight")).ggml_type
    embed: torch.Tensor | QuantEmbedding
    if quant is not None and weights == "auto" and emb_type not in FLOAT_TYPES and (native_head is not None or not cfg.tie_embeddings):
        embed = t.embedding("token_embd.weight")  # rows read from the file as tokens ask for them
    else:
        embed = torch.from_numpy(t.float32("token_embd.weight").copy()).to(device=device, dtype=dtype)
    inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32)
    if "rope_freqs.weight" in t:  # llama3-style scaling, stored as per-frequency divisors
        inv_freq = inv_freq / torch.from_numpy(t.float32("rope_freqs.weight").copy())
    norm = RMSNorm(vec("output_norm.weight"), cfg.norm_eps)
    model = LlamaModel(cfg, embed, layers, norm, lm_head, inv_freq, max_position or cfg.max_position).eval()
    if model.embed is not None and weights != "dense" and cfg.tie_embeddings and emb_type not in FLOAT_TYPES:
        model.quantize_tied_head()  # a quantized source: INT8 rows lose next to nothing more
    return model


def _fix_rows(c: QuantCodes, fix: Callable[[np.ndarray], np.ndarray]) -> QuantCodes:
    """The same row permutation on the codes and every per-row factor array."""
    opt = lambda a: None if a is None else np.ascontiguousarray(fix(a))  # noqa: E731
    return QuantCodes(c.qtype, np.ascontiguousarray(fix(c.codes)), np.ascontiguousarray(fix(c.d)), opt(c.m), opt(c.sc), opt(c.mn))


def load_hf(
    directory: str | Path, device: torch.device, dtype: torch.dtype, weights: str = "auto", max_position: int | None = None
) -> LlamaModel:
    import json

    from safetensors import safe_open

    _check_mode(weights)
    directory = Path(directory)
    cfg = config_from_hf(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{directory} has no .safetensors files: only safetensors checkpoints are loaded.")
        weight_map = {}
        for f in files:
            with safe_open(str(f), framework="np") as sf:
                weight_map.update({k: f.name for k in sf.keys()})
    handles: dict[str, object] = {}

    def get(name: str) -> np.ndarray:
        if name not in weight_map:
            raise ModelFormatError(f"{directory} has no tensor '{name}': the checkpoint is incomplete.")
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(str(directory / fname), framework="pt")
        return handles[fname].get_tensor(name).float().numpy()  # type: ignore[attr-defined]

    def part(name: str, heads: int | None = None) -> _Part:
        """A projection; q and k (``heads`` given) permuted into the interleaved RoPE layout."""
        fix = (lambda a: permute_qk(a, heads)) if heads else (lambda a: a)
        bias_name = name.replace(".weight", ".bias")
        return _Part(None, lambda: fix(get(name)), fix(get(bias_name)) if bias_name in weight_map else None)

    def vec(name: str) -> torch.Tensor:
        return torch.from_numpy(get(name)).to(device=device, dtype=torch.float32)

    layers = []
    for i in range(cfg.n_layers):
        b = f"model.layers.{i}."
        a, m = b + "self_attn.", b + "mlp."
        qkv = _fuse(
            [part(a + "q_proj.weight", cfg.n_heads), part(a + "k_proj.weight", cfg.n_kv_heads), part(a + "v_proj.weight")],
            weights, dtype, device,
        )
        o = _fuse([part(a + "o_proj.weight")], weights, dtype, device)
        gate_up = _fuse([part(m + "gate_proj.weight"), part(m + "up_proj.weight")], weights, dtype, device)
        down = _fuse([part(m + "down_proj.weight")], weights, dtype, device)
        layers.append(
            DecoderLayer(cfg, RMSNorm(vec(b + "input_layernorm.weight"), cfg.norm_eps), qkv, o,
                         RMSNorm(vec(b + "post_attention_layernorm.weight"), cfg.norm_eps), gate_up, down)
        )
    embed = torch.from_numpy(get("model.embed_tokens.weight")).to(device=device, dtype=dtype)
    tied = cfg.tie_embeddings or "lm_head.weight" not in weight_map
    lm_head = None if tied else _fuse([part("lm_head.weight")], weights, dtype, device)
    inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32)
    norm = RMSNorm(vec("model.norm.weight"), cfg.norm_eps)
    return LlamaModel(cfg, embed, layers, norm, lm_head, inv_freq, max_position or cfg.max_position).eval()
