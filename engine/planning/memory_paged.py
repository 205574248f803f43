"""The paged engine's memory (`memory_model.estimate` for ``paged`` and ``sparse`` plans): its
weights as the loader keeps them (the file's bytes for the CPU kernels, INT4 codes, INT8 or
dense), its KV pool, a prefill chunk's buffers, and the loader's transients; on a GPU, the
CUDA context and the libraries beside torch's allocator. How each figure was fitted or
measured: `memory_model`'s docstring and docs/performance.md."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmlocal.native.cpu.packed_cache import has_packed
from llmlocal.native.cpu.qlayout import q4_0_nbytes

from ..model.gguf_parts import activations
from ..plan import paged_kv_dtype
from .memory_parts import (
    BF16,
    DTYPE_BYTES,
    F16,
    F32,
    INT4_TYPES,
    KV_BYTES,
    LLAMACPP_OVERHEAD,
    LLAMACPP_OVERHEAD_PER_VOCAB,
    MIB,
    DeviceMemory,
    _cached,
    _layer_tensors,
    _rows_cols,
    default_kv_blocks,
)
from .native_support import FOUR_BIT_TYPES, NATIVE_TYPES

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec, TensorInfo

    from ..plan import Plan

PAGED_HEAP_CHUNKS = 5  # heap kept after loading, in units of the largest projection's codes
PAGED_ACT_PER_TOKEN = 38  # bytes per (chunk token x (d + ffn)) of a prefill step, fp32
# The same on the CPU's int8 kernels, per chunk token x d and x ffn: the MLP's activation is made
# inside the gate/up projection, its (chunk, 2 ffn) product never written (2026-11-29: the
# starter's peak at 512 fell from 175-207 MiB to 154-156), so d-sized buffers weigh most.
# Fitted on the starter, the 0.5B and the 1.5B at 512 and 2,048 (memory_check).
PAGED_ACT_PER_D_CPU, PAGED_ACT_PER_FFN_CPU = 80, 4
PAGED_ACT_PER_TOKEN_INT4 = 56  # the same through the INT4 kernels (fitted: 46 on a 1B of Q4_0, 47-62 on the starter:
# its serving peak at 512 varies 175-207 MiB between runs, and the planner covers that range)
PAGED_LOAD_EXTRA = 25 * MIB  # the loader's other transients
TILES_PANELS = 1 * MIB  # the bfloat16 tiles' dequantized panels, per thread
LOAD_THREADS = 4  # layers the loader packs at once, at most (loader.load_gguf's pool)
INT4_LOAD_BYTES = 8.5  # the INT4 loader's transients per element of the largest fused projection, a thread
EMBED_PAGES_PER_TOKEN = 8192  # an embedding row read from the mapping touches one or two pages

# Device memory of the paged engine's process that is not torch's reservation: the CUDA
# context, the libraries' workspaces, the kernels loaded (torch's, Triton's) and the captured
# graphs. Measured by the GPU check (packaging/gpu_check_measure.py memory) on an H200 with
# torch 2.11 and CUDA 13, 2026-11-26: 5.26 GiB in use at the peak, torch's peak reservation
# 3.90 GiB.
TORCH_CUDA_CONTEXT = 1400 * MIB
TORCH_CUDA_SLACK = 0.05  # caching-allocator fragmentation, as a fraction of the GPU total


# ---- paged engine -------------------------------------------------------------------------
def _int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + (k // 32) * n * 4  # codes + (scale, zero) in bf16 per group of 32


def _paged_group(parts: list[TensorInfo], mode: str, act_bytes: int, int8_acts: bool = False, q4_0: bool = False) -> int:
    """Bytes of one fused projection (loader._fuse): INT4 only if every part can be, and
    (``int8_acts``: the native kernels' int8 activations, `gguf_parts.activations`) not where
    the CPU kernels read every type in the file's own bytes; ``q4_0``: those of more bytes a
    weight as Q4_0 (a draft's, `paged_setup.load_draft`)."""
    shapes = [_rows_cols(t) for t in parts]
    n = sum(s[0] for s in shapes)
    k = shapes[0][1]
    native = mode == "auto" and act_bytes == 4 and _native(parts)
    exact_int4 = all(t.ggml_type in INT4_TYPES and t.shape[0] % 32 == 0 for t in parts)
    if mode in ("auto", "int4") and exact_int4 and not (native and int8_acts):
        return _int4_bytes(n, k)
    if native:  # the CPU kernels keep the file's bytes
        return sum(min(t.n_bytes, q4_0_nbytes(t.n_elements)) if q4_0 else t.n_bytes for t in parts)
    if mode == "int4" and k % 32 == 0:
        return _int4_bytes(n, k)
    if mode == "int8":
        return n * k + n * act_bytes
    return n * k * act_bytes


def _native(parts: list[TensorInfo]) -> bool:
    """Whether the native CPU kernels take these tensors in their own bytes (fp32 runs on a CPU)."""
    return all(t.ggml_type in NATIVE_TYPES and t.shape[0] % 32 == 0 for t in parts)


@dataclass(frozen=True)
class _PagedWeights:
    """The paged engine's model in memory (engine/model/loader.py), computed once per
    (spec, weight mode, dtype)."""

    body: int  # projections, norms, an untied output head
    embed: int  # the token embedding as kept: run dtype, or INT8 rows + fp32 scales
    embed_f32: int  # one float32 copy of the embedding (the loader's transients)
    int8_head: bool  # a tied embedding of a quantized file is requantized to INT8 at load
    largest_part: int  # elements of the largest projection (sizes the loader's heap leftovers)
    embed_mapped: bool = False  # rows read from the file's mapping as tokens ask (resident: those)
    loading_file: int = 0  # file bytes resident at once while loading (the head and the layers being packed)
    loading_anon: int = 0  # the loader's own transients beside them (decoded INT4 codes; 0: not the INT4 kernels)

    @property
    def total(self) -> int:
        return self.body + self.embed


def _paged_weights(spec: ModelSpec, mode: str, act_bytes: int, draft: str | None = None) -> _PagedWeights:
    """``draft``: the model as a draft loads it (int8 activations; ``draft`` is its
    `Plan.draft_weights`), else None."""
    q4_0 = draft == "auto"

    def build() -> _PagedWeights:
        t = _layer_tensors(spec)
        body = largest = fused = 0
        # int8 activations: every projection packed straight from the file's bytes in C (no
        # uint8 codes in numpy, so no heap left over from them)
        int8_acts = acts == "int8"
        for i in range(spec.n_layers):
            b = f"blk.{i}."
            for group in (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)):
                parts = [t[b + g + ".weight"] for g in group if b + g + ".weight" in t]
                if parts:
                    body += _paged_group(parts, mode, act_bytes, int8_acts, q4_0)
                    if not (int8_acts and _native(parts)):
                        largest = max(largest, *(p.n_elements for p in parts))
                    fused = max(fused, sum(p.n_elements for p in parts))
                body += sum(t[b + g + ".bias"].n_elements * act_bytes for g in group if b + g + ".bias" in t)
            body += 2 * spec.d_model * 4  # two RMSNorm weights, fp32
        body += spec.d_model * 4
        emb = t.get("token_embd.weight")
        n_emb = emb.n_elements if emb else spec.vocab_size * spec.d_model
        rows = n_emb // spec.d_model
        tied = "output.weight" not in t
        if not tied:
            body += _paged_group([t["output.weight"]], mode, act_bytes, int8_acts, q4_0)
        if emb is not None and mode == "auto" and act_bytes == 4 and _native([emb]):
            # the CPU path: token rows read from the file's mapped bytes, a tied head packed from
            # them. Loading holds the file's pages of what is being packed (GGUFTensors.
            # release_pages, PackAhead): with int8 activations each tensor is packed straight from
            # its pages in C, so at once a tied head's and the largest tensors in flight (measured:
            # 1-30 MiB above the loaded model on the Qwen2.5-Coder files and the starter).
            body += emb.n_bytes if tied else 0
            threads = min(LOAD_THREADS, os.cpu_count() or 1)  # the loader's (load_gguf)
            layers = [sum(x.n_bytes for n, x in t.items() if n.startswith(f"blk.{i}.")) for i in range(spec.n_layers)]
            # a tied head is packed first: its pages and its packed copy can outgrow the rest
            pages = threads * max(layers, default=0) + (max(0, 2 * emb.n_bytes - body) if tied else 0)
            # The INT4 kernels' codes are decoded in numpy, fused and repacked a projection at a
            # time per loader thread: fitted 8.5 B per element of the largest fused projection
            # and thread (measured 8.6 on a 1B of Q4_0, 7.4 on the starter, 2 threads).
            four_bit = all(x.ggml_type in FOUR_BIT_TYPES for n, x in t.items() if n.startswith("blk.") and len(x.shape) == 2)
            anon = int(INT4_LOAD_BYTES * threads * fused) if four_bit and not int8_acts else 0
            return _PagedWeights(body, emb.n_bytes, 0, False, largest, embed_mapped=True,
                                 loading_file=min(spec.weight_bytes, pages), loading_anon=anon)
        int8_head = tied and mode != "dense" and emb is not None and emb.ggml_type not in (F32, F16, BF16)
        embed = n_emb + rows * 4 if int8_head else n_emb * act_bytes  # INT8 rows + an fp32 scale per row
        return _PagedWeights(body, embed, n_emb * 4, int8_head, largest)

    acts = ("int8" if draft else activations(spec)) if mode == "auto" and act_bytes == 4 else ""
    return _cached(spec, ("paged", mode, act_bytes, acts, draft), build)


def paged_weight_bytes(spec: ModelSpec, plan: Plan, act_bytes: int, draft: bool = False) -> int:
    """Bytes of the paged engine's model once loaded (``draft``: as the draft model of
    ``plan``): weights, norms, RoPE table."""
    n_ctx = plan.n_ctx or spec.context_length
    rope = n_ctx * (spec.head_dim // 2) * 8  # complex64 rotation factors per position
    w = _paged_weights(spec, plan.weights, act_bytes, plan.draft_weights if draft else None)
    if w.embed_mapped:  # the embedding's pages a context touches: a row a token, two pages at most
        return w.body + min(w.embed, n_ctx * EMBED_PAGES_PER_TOKEN) + rope
    return w.total + rope


def paged_kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """Bytes of the paged engine's pool per token: K and V of every layer and KV head, a head
    row of head_dim values, or for q8_0 head_dim int8 values and an fp16 scale per 32 (kv_quant)."""
    row = spec.head_dim + spec.head_dim // 16 if kv_dtype == "q8_0" else int(spec.head_dim * KV_BYTES[kv_dtype])
    return 2 * spec.n_layers * spec.n_kv_heads * row


def _paged(spec: ModelSpec, plan: Plan, device: str, draft: ModelSpec | None) -> list[DeviceMemory]:
    on_gpu = device != "cpu"
    dtype = plan.dtype if plan.dtype != "auto" else ("bf16" if on_gpu else "fp32")
    act = DTYPE_BYTES[dtype]
    n_ctx = plan.n_ctx or spec.context_length
    blocks = plan.kv_blocks or default_kv_blocks(n_ctx, plan.block_size, plan.max_batch)
    tokens = blocks * plan.block_size
    # the draft loads with weights "auto" and its own KV pool of the same number of blocks
    models = [(spec, plan)] + ([(draft, plan.replace(weights="auto"))] if draft is not None else [])
    tables = [_paged_weights(m, p.weights, act, p.draft_weights if i else None) for i, (m, p) in enumerate(models)]
    weights = [paged_weight_bytes(m, p, act, draft=i > 0) for i, (m, p) in enumerate(models)]
    kv = [paged_kv_bytes_per_token(m, paged_kv_dtype(plan, dtype, on_gpu)) * tokens for m, _ in models]

    chunk = min(plan.max_batch_tokens, n_ctx)
    compute = 0
    for (m, _), w in zip(models, tables):
        if on_gpu or w.loading_anon:
            per_token = PAGED_ACT_PER_TOKEN_INT4 if w.loading_anon and not on_gpu else PAGED_ACT_PER_TOKEN
            layer_act = per_token * chunk * (m.d_model + m.d_ffn)
        else:
            layer_act = chunk * (PAGED_ACT_PER_D_CPU * m.d_model + PAGED_ACT_PER_FFN_CPU * m.d_ffn)
        # a prefill chunk at depth n_ctx gathers the context's K and V (and a copy in the run
        # dtype) and hands SDPA a (chunk, n_ctx) mask it turns into floats: no score matrix.
        # On the CPU SDPA reads the kv heads for their query heads (torch 2.5+,
        # attention._SDPA_GQA, measured); on a GPU, unmeasured, K and V expanded to every head
        heads = 2 * m.n_kv_heads if not on_gpu else m.n_kv_heads + m.n_heads
        gathered = 2 * n_ctx * heads * m.head_dim * act
        mask = chunk * n_ctx * 5
        logits = plan.max_batch * m.vocab_size * 4
        # prompt rows in bfloat16 for the AMX-BF16 tiles (a CPU with them), and each thread's
        # dequantized panels (at most 1 MiB; native/cpu/csrc/qmat_tiles.c)
        threads = plan.threads or os.cpu_count() or 1
        tiles = 0 if on_gpu else chunk * max(m.d_model, m.d_ffn) * 2 + TILES_PANELS * threads
        compute = max(compute, int(layer_act + gathered + mask + logits + tiles))
    if plan.kv_cache_dir:  # a request's blocks read from the disk tier wait in memory for their load
        compute = max(compute, kv[0] // max(1, blocks) * -(-n_ctx // plan.block_size))

    # The tokenizer (llama.cpp's vocabulary-only model, the target's only), and while loading the
    # heap of the arrays the loader frees (uint8 codes, below glibc's mmap threshold of at most
    # 32 MiB: fitted as a multiple of the largest projection's codes), which it gives back once
    # the model is built on the CPU (loader.trim_heap).
    tokenizer = int(LLAMACPP_OVERHEAD + LLAMACPP_OVERHEAD_PER_VOCAB * spec.vocab_size)
    heap = max(PAGED_HEAP_CHUNKS * min(w.largest_part, 32 * MIB) for w in tables)
    overhead = tokenizer

    # Loading, model by model (target, its tokenizer and KV pool, then the draft): the file's
    # pages stay mapped until the model is built; the embedding is dequantized in numpy (two
    # float32 copies at once) and, for an INT8 head, requantized in torch (three).
    host_before = gpu_before = 0
    host_peak = gpu_peak = files = 0
    for (m, _), w, wb, kb in zip(models, tables, weights, kv):
        file_pages = m.weight_bytes if m.format == "gguf" else 0
        if not on_gpu and w.embed_mapped:
            # weights packed by an earlier load are mapped from the packed cache: no file pages
            packed = plan.packed_cache_dir is not None and has_packed(plan.packed_cache_dir, m.path)
            file_pages = 0 if packed and activations(m) == "int8" else w.loading_file
        files = max(files, file_pages)
        if on_gpu:
            host_peak = max(host_peak, tokenizer + file_pages + 2 * w.embed_f32 + PAGED_LOAD_EXTRA)
            gpu_peak = max(gpu_peak, gpu_before + wb + (3 * w.embed_f32 if w.int8_head else 0) + TORCH_CUDA_CONTEXT)
            gpu_before += wb + kb
        else:
            # float32 copies of an embedding the model keeps (they come before it); none where its
            # rows are read from the file
            transient = w.loading_anon if w.embed_mapped else (3 if w.int8_head else 2) * w.embed_f32 - w.embed
            host_peak = max(host_peak, host_before + file_pages + wb + transient + heap + PAGED_LOAD_EXTRA)
            host_before += wb + kb + (tokenizer if not host_before else 0)
    if not on_gpu:
        return [DeviceMemory("cpu", sum(weights), sum(kv), compute, overhead, load_peak=host_peak, load_cache=files)]
    gpu_total = sum(weights) + sum(kv) + compute
    return [
        DeviceMemory("cpu", overhead=tokenizer, load_peak=host_peak, load_cache=files),
        DeviceMemory(device, sum(weights), sum(kv), compute, TORCH_CUDA_CONTEXT + int(TORCH_CUDA_SLACK * gpu_total),
                     load_peak=gpu_peak),
    ]
