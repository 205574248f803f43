"""Bytes a plan will use, per device, from the `ModelSpec` alone (no weight is loaded).

    total = weights + KV cache + compute buffers + overhead        (what loading adds to RSS)
    peak  = max(total, load_peak)                                    (the paged loader's transient)
    need  = max(total - reclaimable, load_peak - load_cache)         (what must fit the budget)

Weights are exact, tensor by tensor from the GGUF directory (or safetensors header):

* llama.cpp memory-maps the file and touches every page at load, so all tensor bytes are
  resident. Tensors its CPU backend repacks for faster matmuls (Q4_0 and Q4_K on AVX2, ...)
  get a second, anonymous copy; their mapped pages are never read again, so the kernel may
  drop them (``reclaimable``). A tied output matrix is repacked from the token embedding.
* The paged engine keeps Q4_0/Q4_1/Q4_K projections as INT4 (N*K/2 bytes of codes plus a
  bf16 scale and zero per 32 inputs); a fused group (q|k|v, gate|up) is INT4 only when every
  part is; everything else, and the token embedding, is dequantized to the run dtype.

KV cache: 2 x layers x KV heads x head dim x bytes per value, times the cells: llama.cpp
pads n_ctx to a multiple of 256; the paged engine allocates ``kv_blocks`` x ``block_size``.

Compute buffers and overhead were fitted to RSS measurements (`memory_check`: a fresh
process per configuration; the prompt fills the whole context, then 4 tokens are generated;
peak RSS over baseline), on this machine: AVX-512 CPU, llama-cpp-python 0.3.36, torch 2.13;
SmolLM2-135M (Q4_1, vocab 49152) and a random-weight Llama-3.2-1B shape (Q4_0, vocab
128256) at n_ctx 512, 2048 and 8192, n_batch 512, KV f16 and q8_0. The starter's Q4_K_M
quantization (Q4_K/Q5_0/Q6_K/Q8_0 tensors) was held out and lands within 1%.

* llama.cpp, CPU. The anonymous RSS at load minus the KV cache and the repacked copies is
  the overhead: 7.5 MiB + 346 B per vocabulary entry + 190 B per context cell (both models,
  every context; the fixed part includes ~3 MiB of library pages the kernels touch).
  Compute is what a prefill at full depth adds: llama.cpp reserves logits for a whole
  ubatch (96 MiB for SmolLM2) but writes one row when generating, so only touched pages
  count. Without flash attention the scores of a ubatch against the whole cache are
  materialized: KQ in f32, its f16 copy for the KQV product, the f32 mask: n_kv x ubatch x
  (6 x heads + 4) bytes (within 6% of the measured compute from 512 to 8192). The rest, per
  (ubatch token x (d + ffn)): 6.0 B without flash attention, 12.8 B with it (plus 2.5 B
  per cell and token for its mask).
* Validation (the same measurements, 20 configurations, 1B at 8192 and the Q4_K_M file held
  out): peak error at most 5.3% (paged, SmolLM2, 8192: glibc heap growth while serving),
  median 0.3%.
* paged engine, CPU. Files run the kernels that read each type's own bytes with int8
  activations, which keep the file's bytes; files of 4-bit types only run the INT4 kernels
  with fp32 activations where asked (LLMLOCAL_NATIVE_ACTIVATIONS=fp32) and on the sparse
  backend (`gguf_parts.activations`). Loading holds the
  weights built so far, the file's pages of what is being packed (a tied head's, and the
  tensors in flight) and, for the INT4 kernels, decoded codes and repacking copies (with the
  pages, about the file's size: a 1B of Q4_0 on 2 threads peaked at 1.40-1.73 GiB for 0.79
  GiB loaded), glibc heap of freed arrays (fitted: 5 x the largest projection's uint8 codes,
  capped at the 32 MiB mmap threshold; given back once loaded, `loader.trim_heap`) + 25 MiB.
  Serving adds a prefill chunk at full depth: 38 B per (chunk token x (d + ffn)), the
  context's K/V gathered and expanded to every query head, and the float mask SDPA builds
  (chunk x n_ctx x 5 B); CPU SDPA takes the flash path with a mask, so no score matrix.
  Tokenizer: llama.cpp's vocabulary-only model, the llama.cpp overhead. Validation
  (`memory_check`-style, 2026-11-26, Qwen2.5-Coder 0.5B / 1.5B Q4_K_M, the starter, Gemma 3
  270M, a 1B of Q4_0; context 512 and 4096): see docs/performance.md.

GPU figures (CUDA context, llama.cpp's CUDA compute buffer, torch's allocator slack) could not
be measured here (no GPU): CUDA buffers are committed in full, so they use llama.cpp's own
reserve formula (logits of a ubatch + 2 x d per token, or the attention scores without flash
attention), a 400 MiB CUDA context and 5% allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .memory_paged import _paged
from .memory_parts import (
    IQ4_NL,
    KV_BYTES,
    LLAMACPP_OVERHEAD,
    LLAMACPP_OVERHEAD_PER_VOCAB,
    MIB,
    Q2_K,
    Q4_0,
    Q4_K,
    Q8_0,
    DeviceMemory,
    _block,
    _cached,
    _layer_tensors,
    _rows_cols,
)

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec, TensorInfo

    from ..plan import Plan

__all__ = ["DeviceMemory", "estimate", "gib", "llamacpp_flash_attn", "llamacpp_kv_cells", "total_bytes"]

LLAMACPP_CTX_PAD = 256  # llama.cpp rounds n_ctx up to a multiple of this

# ---- fitted constants (see the module docstring; `python -m llmlocal.app.bench.memory_check`) ----
LLAMACPP_OVERHEAD_PER_CTX = 190  # bytes per context cell (cell metadata, token buffers)
LLAMACPP_ACT_PER_TOKEN = 6.0  # bytes per (ubatch token x (d + ffn)), without flash attention
LLAMACPP_ACT_PER_TOKEN_FA = 12.8  # the same with flash attention
LLAMACPP_SCORE_BYTES_FA = 2.5  # bytes per (KV cell x ubatch token) with flash attention (the mask)
# ---- assumed (no GPU to measure on) ----
CUDA_CONTEXT = 400 * MIB  # llama.cpp's driver context + cuBLAS workspace, per process and GPU


def llamacpp_flash_attn(kv_dtype: str) -> bool:
    """Whether the llamacpp backend turns flash attention on: a quantized V cache requires it."""
    return kv_dtype == "q8_0"


def llamacpp_kv_cells(n_ctx: int) -> int:
    return -(-n_ctx // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD


# ---- llama.cpp ----------------------------------------------------------------------------
def _repacks(t: TensorInfo, simd: frozenset[str]) -> bool:
    """Whether llama.cpp's CPU backend keeps an interleaved copy of this matmul weight
    (llama.cpp as bundled with llama-cpp-python 0.3: Q4_0, Q4_K, Q2_K and IQ4_NL on AVX2;
    Q4_0, Q4_K, IQ4_NL and, with int8 matmul, Q8_0 on Arm with dot-product instructions)."""
    if len(t.shape) != 2:
        return False
    n, _ = _rows_cols(t)
    if "avx2" in simd:
        return t.ggml_type in (Q4_0, Q4_K, Q2_K, IQ4_NL) and n % 8 == 0
    if "asimddp" in simd or "i8mm" in simd:
        arm = {Q4_0, Q4_K, IQ4_NL} | ({Q8_0} if "i8mm" in simd else set())
        return t.ggml_type in arm and n % 4 == 0
    return False


@dataclass(frozen=True)
class _LlamaCppWeights:
    """Byte sums of one model file for llama.cpp, computed once per (spec, CPU)."""

    layer: tuple[int, ...]  # bytes of each repeating layer
    layer_repacked: tuple[int, ...]  # of those, bytes that get a repacked copy on this CPU
    other: int  # embedding, output, final norm
    output_gpu: int  # what offloading the output layer puts on the GPU (matrix and final norm)
    output_gpu_cold: int  # mapped bytes nothing reads once the output layer is offloaded
    output_repacked: int  # bytes of the output's repacked copy (the embedding's, when tied)
    output_mapped_cold: int  # mapped output bytes nothing reads once repacked


def _llamacpp_weights(spec: ModelSpec, simd: frozenset[str]) -> _LlamaCppWeights:
    def build() -> _LlamaCppWeights:
        layer = [0] * spec.n_layers
        repacked = [0] * spec.n_layers
        other = 0
        for name, t in _layer_tensors(spec).items():
            i = _block(name)
            if i is None or i >= spec.n_layers:
                other += t.n_bytes
                continue
            layer[i] += t.n_bytes
            if _repacks(t, simd):
                repacked[i] += t.n_bytes
        tensors = _layer_tensors(spec)
        out = tensors.get("output.weight")
        emb = tensors.get("token_embd.weight")
        norm = tensors["output_norm.weight"].n_bytes if "output_norm.weight" in tensors else 0
        if out is not None:
            out_rep = out.n_bytes if _repacks(out, simd) else 0
            return _LlamaCppWeights(tuple(layer), tuple(repacked), other, out.n_bytes + norm, out.n_bytes + norm, out_rep, out_rep)
        # tied: the output is a copy of the embedding (repacked on the CPU, uploaded on the GPU);
        # the embedding's own mapped pages stay hot: get_rows reads them
        emb_bytes = emb.n_bytes if emb is not None else 0
        emb_rep = emb_bytes if emb is not None and _repacks(emb, simd) else 0
        return _LlamaCppWeights(tuple(layer), tuple(repacked), other, emb_bytes + norm, norm, emb_rep, 0)

    return _cached(spec, ("llamacpp", simd), build)


def _llamacpp(spec: ModelSpec, plan: Plan, simd: frozenset[str], gpu: str | None) -> list[DeviceMemory]:
    w = _llamacpp_weights(spec, simd)
    n_layers = spec.n_layers
    # llama.cpp offloads the last gpu_layers repeating layers; n_layers + 1 adds the output.
    on_gpu = min(plan.gpu_layers, n_layers + 1) if gpu else 0
    gpu_layers = min(on_gpu, n_layers)
    output_on_gpu = on_gpu > n_layers
    cpu_layers = n_layers - gpu_layers

    mapped = sum(w.layer) + w.other  # the whole file is mapped and populated at load
    gpu_weights = sum(w.layer[cpu_layers:]) + (w.output_gpu if output_on_gpu else 0)
    repacked = sum(w.layer_repacked[:cpu_layers]) + (0 if output_on_gpu else w.output_repacked)
    # cold mapped pages: offloaded tensors, and CPU tensors read from their repacked copy
    reclaimable = sum(w.layer[cpu_layers:]) + sum(w.layer_repacked[:cpu_layers])
    reclaimable += w.output_gpu_cold if output_on_gpu else w.output_mapped_cold

    cells = llamacpp_kv_cells(plan.n_ctx or spec.context_length)
    kv_dtype = plan.kv_dtype if plan.kv_dtype != "auto" else "f16"
    kv_layer = 2 * spec.n_kv_heads * spec.head_dim * KV_BYTES[kv_dtype] * cells  # one layer, K and V
    ubatch = min(plan.n_batch, cells)
    flash = llamacpp_flash_attn(kv_dtype)
    per_token = LLAMACPP_ACT_PER_TOKEN_FA if flash else LLAMACPP_ACT_PER_TOKEN
    scores = cells * ubatch * (LLAMACPP_SCORE_BYTES_FA if flash else 6 * spec.n_heads + 4)
    act = per_token * ubatch * (spec.d_model + spec.d_ffn)
    overhead = LLAMACPP_OVERHEAD + LLAMACPP_OVERHEAD_PER_VOCAB * spec.vocab_size + LLAMACPP_OVERHEAD_PER_CTX * cells

    out = [
        DeviceMemory(
            "cpu",
            weights=mapped + repacked,
            kv=int(kv_layer * cpu_layers),
            compute=int(act + (scores if cpu_layers else 0)),  # layers left on the CPU attend there
            overhead=int(overhead),
            reclaimable=reclaimable,
        )
    ]
    if gpu and on_gpu:
        # CUDA buffers are committed in full: llama.cpp's reserve, logits of a whole ubatch included
        logits = ubatch * (spec.vocab_size + 2 * spec.d_model) * 4 if output_on_gpu else ubatch * spec.d_model * 8
        gpu_scores = cells * ubatch * (4 if flash else 4 * spec.n_heads + 4)
        out.append(
            DeviceMemory(
                gpu,
                weights=gpu_weights,
                kv=int(kv_layer * gpu_layers),
                compute=max(logits, gpu_scores + ubatch * spec.d_model * 24),
                overhead=CUDA_CONTEXT,
            )
        )
    return out


# ---- entry point --------------------------------------------------------------------------
def estimate(
    spec: ModelSpec, plan: Plan, simd: frozenset[str] = frozenset(), draft: ModelSpec | None = None
) -> list[DeviceMemory]:
    """Per-device memory of ``plan`` (backend and device resolved, not "auto") for ``spec``.

    ``simd`` is the CPU's feature set (`Hardware.simd`): it decides which tensors llama.cpp
    repacks. ``draft`` is the speculative-decoding draft model, if the plan has one.
    """
    if plan.backend == "llamacpp":
        gpu = "cuda:0" if plan.device in ("cuda", "auto") and plan.gpu_layers > 0 else None
        return _llamacpp(spec, plan, simd, gpu)
    if plan.backend in ("paged", "sparse"):
        device = "cuda:0" if plan.device == "cuda" else "cpu"
        return _paged(spec, plan, device, draft)
    if plan.backend == "remote":
        return [DeviceMemory("cpu")]
    raise ValueError(f"estimate needs a resolved backend, got {plan.backend!r}")


def total_bytes(devices: list[DeviceMemory]) -> int:
    return sum(d.total for d in devices)


def gib(n: float) -> str:
    """Bytes as a short human figure (9.1 GiB, 512 MiB): llmlocal's one size formatter."""
    from llmlocal.models.sizes import format_size

    return format_size(n)
