"""Which tensors make each of a layer's projections, in the row order the network wants, and
the native kernels' packing of a GGUF file's projections started before torch is imported.

A layer's q, k and v (or Phi-3's fused qkv) are one projection, its gate and up another; q and k
rows move into the interleaved RoPE layout unless the file stores them so. The loader builds
every layer from `layer_projections`. `start_packing` packs the same rows in worker threads the
moment a load starts: the C packer releases the GIL, and `import torch` (over a second on a
laptop), which runs meanwhile, needs only the main thread. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from llmlocal.models import ModelSpec, TensorInfo
from llmlocal.models.errors import LLMLocalError
from llmlocal.models.fingerprint import model_fingerprint
from llmlocal.models.tensor_names import PERMUTED_QK_ARCHS, permute_qk
from llmlocal.native.cpu import runtime
from llmlocal.native.cpu.pack_ahead import PackAhead
from llmlocal.native.cpu.packed_cache import PackedCache
from llmlocal.native.cpu.qlayout import FORMATS, QuantRows

from ..planning.native_support import four_bit_only
from .config import ModelConfig, config_from_spec
from .gguf_tensors import GGUFTensors

RowFix = Callable[[np.ndarray], np.ndarray]  # rows of a tensor (or their indices) in the order wanted


def same(a: np.ndarray) -> np.ndarray:
    return a


def permutes_qk(cfg: ModelConfig) -> bool:
    """Whether a GGUF file of this architecture stores q and k rows in HF order, which the
    network wants interleaved (llama and mistral files already are)."""
    return cfg.architecture not in PERMUTED_QK_ARCHS


def qk_fixes(cfg: ModelConfig, permute: bool) -> tuple[RowFix, RowFix, RowFix, RowFix]:
    """Row permutations into the interleaved RoPE layout: of q, of k, of a fused [q; k; v]
    (Phi-3), and of a QK-norm weight (one head); identities when ``permute`` is false."""
    if not permute:
        return same, same, same, same
    nq, nk, rot = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.rotary_dims

    def fused(a: np.ndarray) -> np.ndarray:
        return np.concatenate([permute_qk(a[:nq], cfg.n_heads, rot), permute_qk(a[nq : nq + nk], cfg.n_kv_heads, rot), a[nq + nk :]])

    return ((lambda a: permute_qk(a, cfg.n_heads, rot)), (lambda a: permute_qk(a, cfg.n_kv_heads, rot)), fused,
            (lambda a: permute_qk(a, 1, rot)))


def layer_projections(cfg: ModelConfig, has: Callable[[str], bool], i: int, permute: bool) -> dict[str, list[tuple[str, RowFix]]]:
    """Layer ``i``'s projections (qkv, o, gate_up, down), each the GGUF tensors stacked by rows
    into it with their row orders; ``has`` says whether the source holds a tensor."""
    b = f"blk.{i}."
    fix_q, fix_k, fix_qkv, _ = qk_fixes(cfg, permute)
    if has(b + "attn_qkv.weight"):  # fused q, k, v (Phi-3)
        qkv = [(b + "attn_qkv.weight", fix_qkv)]
    else:
        qkv = [(b + "attn_q.weight", fix_q), (b + "attn_k.weight", fix_k), (b + "attn_v.weight", same)]
    if has(b + "ffn_gate.weight"):
        gate_up = [(b + "ffn_gate.weight", same), (b + "ffn_up.weight", same)]
    else:  # gate and up in one tensor, gate rows first (Phi-3)
        gate_up = [(b + "ffn_up.weight", same)]
    return {"qkv": qkv, "o": [(b + "attn_output.weight", same)], "gate_up": gate_up, "down": [(b + "ffn_down.weight", same)]}


def head_tensor(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tie_embeddings else "output.weight"


def file_rows(raw: np.ndarray, qtype: int, fix: RowFix, name: str = "") -> QuantRows:
    """A tensor's rows in the file, in the order ``fix`` puts them (a row permutation, applied
    to the row indices: nothing is decoded or copied here)."""
    if fix is same:
        return QuantRows(qtype, raw, name=name)
    return QuantRows(qtype, raw, fix(np.arange(raw.shape[0])), name=name)


def native_reads(info: TensorInfo) -> bool:
    """Whether the native kernels read this tensor in its own bytes: its type, whole blocks a row."""
    fmt = FORMATS.get(info.ggml_type)
    return fmt is not None and info.shape[0] % fmt.dgroup == 0


def native_rows(t: GGUFTensors, name: str, fix: RowFix = same) -> QuantRows | None:
    """The tensor's rows for the native kernels, or None if they do not read it."""
    info = t.info(name)
    return file_rows(t.raw(name), info.ggml_type, fix, name) if native_reads(info) else None


def default_activations(spec: ModelSpec, sparse: bool = False) -> str:
    """int8 (the activations rounded per 32 inputs, the int8 kernels) for the paged engine on
    every file and CPU; fp32 for the sparse backend's 4-bit files, whose INT4 kernels take fp32
    activations and skip the columns of zeroed inputs, what that backend is for.

    fp32 (`LLMLOCAL_NATIVE_ACTIVATIONS=fp32`, a 4-bit-only file) is closer to the exact run of
    the weights but slower: on a Zen 5 (AVX-512) the starter's Q4_1 decoded 162 tok/s against
    int8's 275 (`bench decode`), 16 concurrent requests 156-176 tok/s against 301-361, and a
    1,037-token prompt took 1.84-1.92 s against 0.60-0.69 s; its mean |log p - exact| on two
    texts was 0.0137 and 0.0106 against int8's 0.0271 and 0.0249, llama.cpp's 0.0291 and 0.0257.
    Both give every row its own numbers whatever the batch: the int8 kernels each row's floats
    bit for bit, the INT4 kernels to float rounding."""
    return "fp32" if sparse and four_bit_only(spec) else "int8"


def activations(spec: ModelSpec, sparse: bool = False) -> str:
    """The native kernels' activations for this file: LLMLOCAL_NATIVE_ACTIVATIONS=int8|fp32, or
    `default_activations`."""
    mode = (os.environ.get("LLMLOCAL_NATIVE_ACTIVATIONS") or default_activations(spec, sparse)).strip().lower()
    if mode not in ("int8", "fp32"):
        raise LLMLocalError(f"LLMLOCAL_NATIVE_ACTIVATIONS must be int8 or fp32, not {mode!r}.")
    return mode


def start_packing(spec: ModelSpec, cache: PackedCache | None = None) -> PackAhead | None:
    """The dense native layout of every projection and the output head of ``spec``'s file,
    packing in worker threads from now on, in the order the loader builds them; None where the
    loader would not pack them so (no kernels, not a GGUF file, fp32 activations: the INT4
    kernels). Each tensor's file pages leave the process once packed. Runs ``cache`` holds for
    this file are mapped from it instead (`save_packing` fills it)."""
    if spec.format != "gguf" or not runtime.built() or activations(spec) != "int8":
        return None
    try:
        cfg = config_from_spec(spec)
        t = GGUFTensors(spec)
        projections = [[(head_tensor(cfg), same)]]
        for i in range(cfg.n_layers):
            projections += layer_projections(cfg, t.__contains__, i, permutes_qk(cfg)).values()
        groups = []
        for parts in projections:
            rows = [native_rows(t, name, fix) for name, fix in parts if name in t]
            if rows and all(r is not None for r in rows):
                groups.append([r for r in rows if r is not None])
    except (LLMLocalError, ValueError, KeyError):
        return None  # a file the loader refuses, with its own sentence: nothing to pack ahead
    saved = cache.load(model_fingerprint(spec.path)) if cache is not None else None
    # a core left to the main thread, whose import of torch is the load's longest step
    workers = max(1, min(4, (os.cpu_count() or 2) - 1))
    return PackAhead(groups, workers, packed=lambda run: t.release_pages([r.name for r in run]), saved=saved)


def save_packing(ahead: PackAhead, spec: ModelSpec, cache: PackedCache) -> None:
    """After a load that took everything ``ahead`` offered and packed some of it anew: keep it
    all in ``cache`` for the next load (written behind, on a thread of its own)."""
    if ahead.packed_anew and not ahead.untaken():
        cache.save_behind(model_fingerprint(spec.path), ahead.handed, {"model": spec.name, "path": spec.path})
