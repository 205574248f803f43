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

import ctypes
import ctypes.util
import functools
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
from llmlocal.models.tensor_names import gguf_to_hf_name, text_tensor_name
from llmlocal.native.cpu.qlayout import QuantRows

from .config import ModelConfig, config_from_hf, config_from_spec
from .draft_head import DraftHead
from .gguf_parts import RowFix, file_rows, head_tensor, layer_projections, native_reads, permutes_qk, qk_fixes, same
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
    quant: Callable[[], QuantRows] | None = None  # a GGUF type the native kernels read in its own bytes


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
QuantFactory = Callable[[list[QuantRows], "torch.Tensor | None"], "nn.Module | None"]


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


class _Tensors:
    """What the layer builder reads from a source, by GGUF tensor name."""

    def has(self, name: str) -> bool: ...

    def part(self, name: str, fix: RowFix = same) -> _Part: ...

    def vec(self, name: str, fix: RowFix = same) -> torch.Tensor: ...


def _build_layer(
    cfg: ModelConfig,
    src: _Tensors,
    i: int,
    permute: bool,
    fuse: Callable[[list[_Part]], Linear],
) -> DecoderLayer:
    """Layer ``i`` of any family: its parts by GGUF name, the family's options from ``cfg``."""
    b = f"blk.{i}."
    fix_head = qk_fixes(cfg, permute)[3]
    qkv, o, gate_up, down = (fuse([src.part(name, fix) for name, fix in parts])
                             for parts in layer_projections(cfg, src.has, i, permute).values())
    eps = cfg.norm_eps
    extra: dict[str, RMSNorm] = {}
    if cfg.qk_norm:
        extra["q_norm"] = RMSNorm(src.vec(b + "attn_q_norm.weight", fix_head), eps)
        extra["k_norm"] = RMSNorm(src.vec(b + "attn_k_norm.weight", fix_head), eps)
    if cfg.sandwich_norms:
        extra["post_attn_norm"] = RMSNorm(src.vec(b + "post_attention_norm.weight"), eps)
        extra["post_mlp_norm"] = RMSNorm(src.vec(b + "post_ffw_norm.weight"), eps)
    return DecoderLayer(cfg, i, RMSNorm(src.vec(b + "attn_norm.weight"), eps), qkv, o,
                        RMSNorm(src.vec(b + "ffn_norm.weight"), eps), gate_up, down, **extra)


def _rope(cfg: ModelConfig, divisors: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(inv_freq, the windowed layers' inv_freq or None); ``divisors``: per-frequency
    divisors stored in the file (llama3's rope_freqs, Phi-3's rope_factors)."""
    inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32)
    if divisors is not None:  # (one per rotating pair: ones for the pairs that do not rotate)
        div = np.ones(inv_freq.shape[0], dtype=np.float32)
        div[: len(divisors)] = divisors
        inv_freq = inv_freq / torch.from_numpy(div)
    local = torch.tensor(cfg.local_inv_freq(), dtype=torch.float32) if cfg.rope_local_theta is not None else None
    return inv_freq, local


def load_gguf(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    weights: str = "auto",
    max_position: int | None = None,
    int4: Int4Factory | None = None,
    quant: QuantFactory | None = None,
    head_rows: int | None = None,
) -> LlamaModel:
    """The model of a GGUF file. ``quant`` builds the projections (and the output head) whose
    parts are all in GGUF types the native kernels read in their own bytes; ``int4`` those
    whose source is INT4 (all parts of a fused projection must be), and the output head when
    its source is; the others follow ``weights``. ``head_rows``: a native output head of the
    vocabulary's first ids only, and the rows of other tokens as they are seen (a draft
    model's: `DraftHead`, `paged_setup.load_draft`)."""
    _check_mode(weights)
    cfg = config_from_spec(spec)
    t = GGUFTensors(spec)
    # the model wants q/k rows in the interleaved RoPE layout, which llama/mistral GGUFs have
    permute = permutes_qk(cfg)
    positions = max_position or cfg.max_position

    def need(name: str) -> str:
        if name not in t:
            raise ModelFormatError(f"{spec.path} has no tensor '{name}': the file is incomplete; convert it again.")
        return name

    class File(_Tensors):
        def has(self, name: str) -> bool:
            return name in t

        def part(self, name: str, fix: RowFix = same) -> _Part:
            need(name)
            info = t.info(name)
            int4 = None
            if info.ggml_type in INT4_TYPES and info.shape[0] % 32 == 0:
                def int4() -> Int4Codes:
                    c = t.int4(name)
                    return Int4Codes(fix(c.codes), fix(c.scale), fix(c.zero))
            bias_name = name.replace(".weight", ".bias")
            bias = fix(t.float32(bias_name)) if bias_name in t else None
            q = None
            if quant is not None and native_reads(info):
                q = lambda: file_rows(t.raw(name), info.ggml_type, fix, name)  # noqa: E731
            return _Part(int4, lambda: fix(t.float32(name)), bias, q)

        def vec(self, name: str, fix: RowFix = same) -> torch.Tensor:
            return torch.from_numpy(np.array(fix(t.float32(need(name))), dtype=np.float32)).to(device=device, dtype=torch.float32)

    src = File()

    def fuse(parts: list[_Part]) -> Linear:
        return _fuse(parts, weights, dtype, device, int4, quant)

    def layer(i: int) -> DecoderLayer:
        built = _build_layer(cfg, src, i, permute, fuse)
        t.release_pages([n for n in t.names() if n.startswith(f"blk.{i}.")])  # packed: its file pages may go
        return built

    head = head_tensor(cfg)

    def file_head() -> nn.Module | None:
        """The output head in the file's own bytes (reads what the file holds, no more), or None."""
        built = None
        if quant is not None and weights == "auto":
            hp = src.part(head, (lambda a: a[:head_rows]) if head_rows else same)
            built = quant([hp.quant()], None) if hp.quant is not None else None
            if built is not None and head_rows:
                built = DraftHead(built, head_rows, t.embedding(head), cfg.vocab_size)
        if built is None and int4 is not None and t.info(head).ggml_type in INT4_TYPES and t.info(head).shape[0] % 32 == 0:
            built = int4(t.int4(head), None)  # exact 4-bit codes: the head reads half of INT8's bytes
        return built

    if device.type == "cpu":  # independent layers, built by a thread per core (numpy and the C packer release the GIL)
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            # the head first: the largest single matrix (the 1.5B's packs in 0.5 s), beside the layers
            head_job = pool.submit(file_head)
            layers = list(pool.map(layer, range(cfg.n_layers)))
            native_head = head_job.result()
    else:
        layers = [layer(i) for i in range(cfg.n_layers)]
        native_head = file_head()
    lm_head = native_head
    if lm_head is None and not cfg.tie_embeddings:
        lm_head = _fuse([src.part("output.weight")], weights, dtype, device)
    emb_type = t.info(need("token_embd.weight")).ggml_type
    embed: torch.Tensor | QuantEmbedding
    if quant is not None and weights == "auto" and emb_type not in FLOAT_TYPES and (native_head is not None or not cfg.tie_embeddings):
        embed = t.embedding("token_embd.weight")  # rows read from the file as tokens ask for them
    else:
        embed = torch.from_numpy(t.float32("token_embd.weight").copy()).to(device=device, dtype=dtype)
    divisors = None
    if "rope_freqs.weight" in t:  # llama3-style scaling, stored as per-frequency divisors
        divisors = t.float32("rope_freqs.weight")
    elif cfg.rope_scaling.kind == "longrope":  # Phi-3: the long factors past the original context
        long = positions > cfg.rope_scaling.original_max_position
        divisors = t.float32(need("rope_factors_long.weight" if long else "rope_factors_short.weight"))
    inv_freq, local_inv_freq = _rope(cfg, divisors)
    norm = RMSNorm(src.vec("output_norm.weight"), cfg.norm_eps)
    model = LlamaModel(cfg, embed, layers, norm, lm_head, inv_freq, positions, local_inv_freq).eval()
    if model.embed is not None and weights != "dense" and cfg.tie_embeddings and emb_type not in FLOAT_TYPES:
        model.quantize_tied_head()  # a quantized source: INT8 rows lose next to nothing more
    t.release_pages()
    if device.type == "cpu":
        trim_heap()
    return model


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim, every arena).
    Loading on the CPU frees many arrays under glibc's mmap threshold (decoded codes, the
    loader threads' transients) that the heap would otherwise keep: about 210 MiB after loading
    a 1B of 4-bit types, which the model never uses again. A few milliseconds; a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim (musl and macOS have none)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def load_hf(
    directory: str | Path, device: torch.device, dtype: torch.dtype, weights: str = "auto", max_position: int | None = None
) -> LlamaModel:
    import json

    from safetensors import safe_open

    _check_mode(weights)
    directory = Path(directory)
    cfg = config_from_hf(directory, max_position)
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
    # the language model's tensors by their text-model names (a multimodal checkpoint stores
    # them under a prefix, beside a vision tower the engine does not read)
    stored_as = {text: name for name in weight_map if (text := text_tensor_name(name)) is not None}
    weight_map = {text: weight_map[name] for text, name in stored_as.items()}
    handles: dict[str, object] = {}
    # Gemma's RMSNorms multiply by (1 + w): its checkpoints store w
    norm_shift = 1.0 if cfg.architecture == "gemma3" else 0.0

    def hf(name: str) -> str:
        """The checkpoint's name of a GGUF tensor name."""
        return gguf_to_hf_name(name, cfg.architecture) or name

    def get(name: str) -> np.ndarray:
        if name not in weight_map:
            raise ModelFormatError(f"{directory} has no tensor '{name}': the checkpoint is incomplete.")
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(str(directory / fname), framework="pt")
        return handles[fname].get_tensor(stored_as[name]).float().numpy()  # type: ignore[attr-defined]

    class Checkpoint(_Tensors):
        def has(self, name: str) -> bool:
            return hf(name) in weight_map

        def part(self, name: str, fix: RowFix = same) -> _Part:
            w = hf(name)
            bias_name = w.replace(".weight", ".bias")
            return _Part(None, lambda: fix(get(w)), fix(get(bias_name)) if bias_name in weight_map else None)

        def vec(self, name: str, fix: RowFix = same) -> torch.Tensor:
            w = fix(get(hf(name)))
            return torch.from_numpy(np.ascontiguousarray(w + norm_shift)).to(device=device, dtype=torch.float32)

    src = Checkpoint()

    def fuse(parts: list[_Part]) -> Linear:
        return _fuse(parts, weights, dtype, device)

    layers = [_build_layer(cfg, src, i, True, fuse) for i in range(cfg.n_layers)]  # HF q/k rows: always permuted
    embed = torch.from_numpy(get(hf("token_embd.weight"))).to(device=device, dtype=dtype)
    tied = cfg.tie_embeddings or not src.has("output.weight")
    lm_head = None if tied else fuse([src.part("output.weight")])
    inv_freq, local_inv_freq = _rope(cfg, None)
    norm = RMSNorm(src.vec("output_norm.weight"), cfg.norm_eps)
    return LlamaModel(cfg, embed, layers, norm, lm_head, inv_freq, max_position or cfg.max_position, local_inv_freq).eval()
