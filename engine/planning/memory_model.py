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
* paged engine, CPU. Files of 4-bit types only run the INT4 kernels with fp32 activations;
  others (Q4_K_M mixes, Q8_0) the kernels that read each type's own bytes with int8
  activations (`gguf_parts.activations`), which keep the file's bytes. Loading holds the
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

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.gguf_parts import activations
from ..plan import paged_kv_dtype
from .native_support import FOUR_BIT_TYPES, NATIVE_TYPES

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec, TensorInfo

    from ..plan import Plan

MIB = 1 << 20

# ggml type ids (gguf-py's GGMLQuantizationType), kept here so planning imports nothing heavy
F32, F16, Q4_0, Q4_1, Q8_0, Q2_K, Q4_K, Q6_K, IQ4_NL, BF16 = 0, 1, 2, 3, 8, 10, 12, 14, 20, 30
INT4_TYPES = frozenset({Q4_0, Q4_1, Q4_K})  # the paged engine keeps these as exact INT4

KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 values + an fp16 scale
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
LLAMACPP_CTX_PAD = 256  # llama.cpp rounds n_ctx up to a multiple of this

# ---- fitted constants (see the module docstring; `python -m llmlocal.app.bench.memory_check`) ----
LLAMACPP_OVERHEAD = int(7.5 * MIB)  # graph metadata, sampler, library pages the kernels touch: fixed part
LLAMACPP_OVERHEAD_PER_VOCAB = 346  # bytes per vocabulary entry
LLAMACPP_OVERHEAD_PER_CTX = 190  # bytes per context cell (cell metadata, token buffers)
LLAMACPP_ACT_PER_TOKEN = 6.0  # bytes per (ubatch token x (d + ffn)), without flash attention
LLAMACPP_ACT_PER_TOKEN_FA = 12.8  # the same with flash attention
LLAMACPP_SCORE_BYTES_FA = 2.5  # bytes per (KV cell x ubatch token) with flash attention (the mask)
PAGED_HEAP_CHUNKS = 5  # heap kept after loading, in units of the largest projection's codes
PAGED_ACT_PER_TOKEN = 38  # bytes per (chunk token x (d + ffn)) of a prefill step, fp32
PAGED_ACT_PER_TOKEN_INT4 = 50  # the same through the INT4 kernels (fitted: 46 on a 1B of Q4_0, 47-62 on the starter)
PAGED_LOAD_EXTRA = 25 * MIB  # the loader's other transients
LOAD_THREADS = 4  # layers the loader packs at once, at most (loader.load_gguf's pool)
INT4_LOAD_BYTES = 8.5  # the INT4 loader's transients per element of the largest fused projection, a thread
EMBED_PAGES_PER_TOKEN = 8192  # an embedding row read from the mapping touches one or two pages
# Device memory of the paged engine's process that is not torch's reservation: the CUDA
# context, the libraries' workspaces, the kernels loaded (torch's, Triton's) and the captured
# graphs. Measured by the GPU check (packaging/gpu_check_measure.py memory) on an H200 with
# torch 2.11 and CUDA 13, 2026-11-26: 5.26 GiB in use at the peak, torch's peak reservation
# 3.90 GiB.
TORCH_CUDA_CONTEXT = 1400 * MIB
# ---- assumed (no GPU to measure on) ----
CUDA_CONTEXT = 400 * MIB  # llama.cpp's driver context + cuBLAS workspace, per process and GPU
TORCH_CUDA_SLACK = 0.05  # caching-allocator fragmentation, as a fraction of the GPU total


def llamacpp_flash_attn(kv_dtype: str) -> bool:
    """Whether the llamacpp backend turns flash attention on: a quantized V cache requires it."""
    return kv_dtype == "q8_0"


def llamacpp_kv_cells(n_ctx: int) -> int:
    return -(-n_ctx // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD


def default_kv_blocks(n_ctx: int, block_size: int, max_batch: int) -> int:
    """The paged backend's pool when the plan names none: a full window for up to 4 slots."""
    return -(-n_ctx // block_size) * min(max_batch, 4)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds for a loaded plan."""

    device: str  # "cpu" or "cuda:N"
    weights: int = 0
    kv: int = 0
    compute: int = 0
    overhead: int = 0
    reclaimable: int = 0  # part of `weights`: mapped pages nothing reads after loading
    load_peak: int = 0  # transient high-water mark while loading (0: none above total)
    load_cache: int = 0  # part of `load_peak`: file pages read once, which the kernel may drop

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead

    @property
    def peak(self) -> int:
        return max(self.total, self.load_peak)

    @property
    def need(self) -> int:
        """What must fit in the device's budget: clean file pages nothing reads again are
        left out (under pressure the kernel drops them instead of failing)."""
        return max(self.total - self.reclaimable, self.load_peak - self.load_cache)

    def to_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "kv": self.kv,
            "compute": self.compute,
            "overhead": self.overhead,
            "total": self.total,
            "peak": self.peak,
            "reclaimable": self.reclaimable,
        }


# ---- tensors ------------------------------------------------------------------------------
def _layer_tensors(spec: ModelSpec) -> dict[str, TensorInfo]:
    """Tensors by GGUF name (safetensors names are translated)."""
    if spec.format == "gguf":
        return {t.name: t for t in spec.tensors}
    # (tensor_names imports numpy: only checkpoints pay for it)
    from llmlocal.models.tensor_names import hf_to_gguf_name

    out = {}
    for t in spec.tensors:
        name = hf_to_gguf_name(t.name, spec.architecture)
        if name is not None:
            out[name] = t
    return out


def _rows_cols(t: TensorInfo) -> tuple[int, int]:
    """(N out rows, K inputs) of a 2-D weight stored GGUF-order (K fastest)."""
    k = t.shape[0]
    return t.n_elements // k, k


def _block(name: str) -> int | None:
    """The layer index of a repeating-layer tensor ("blk.7.attn_q.weight" -> 7)."""
    return int(name.split(".")[1]) if name.startswith("blk.") else None


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


_CACHE: dict[tuple[int, object], tuple[object, object]] = {}


def _cached(spec: ModelSpec, key: object, build):  # type: ignore[no-untyped-def]
    """Memoize per spec object (holding a reference, so its id cannot be reused)."""
    slot = (id(spec), key)
    hit = _CACHE.get(slot)
    if hit is None or hit[0] is not spec:
        if len(_CACHE) > 256:
            _CACHE.clear()
        hit = (spec, build())
        _CACHE[slot] = hit
    return hit[1]


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


# ---- paged engine -------------------------------------------------------------------------
def _int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + (k // 32) * n * 4  # codes + (scale, zero) in bf16 per group of 32


def _paged_group(parts: list[TensorInfo], mode: str, act_bytes: int, int8_acts: bool = False) -> int:
    """Bytes of one fused projection (loader._fuse): INT4 only if every part can be, and
    (``int8_acts``: the native kernels' int8 activations, `gguf_parts.activations`) not where
    the CPU kernels read every type in the file's own bytes."""
    shapes = [_rows_cols(t) for t in parts]
    n = sum(s[0] for s in shapes)
    k = shapes[0][1]
    native = mode == "auto" and act_bytes == 4 and _native(parts)
    exact_int4 = all(t.ggml_type in INT4_TYPES and t.shape[0] % 32 == 0 for t in parts)
    if mode in ("auto", "int4") and exact_int4 and not (native and int8_acts):
        return _int4_bytes(n, k)
    if native:
        return sum(t.n_bytes for t in parts)  # the CPU kernels keep the file's bytes
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


def _paged_weights(spec: ModelSpec, mode: str, act_bytes: int) -> _PagedWeights:
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
                    body += _paged_group(parts, mode, act_bytes, int8_acts)
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
            body += _paged_group([t["output.weight"]], mode, act_bytes, int8_acts)
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

    acts = activations(spec) if mode == "auto" and act_bytes == 4 else ""
    return _cached(spec, ("paged", mode, act_bytes, acts), build)


def paged_weight_bytes(spec: ModelSpec, plan: Plan, act_bytes: int) -> int:
    """Bytes of the paged engine's model once loaded: weights, norms, RoPE table."""
    n_ctx = plan.n_ctx or spec.context_length
    rope = n_ctx * (spec.head_dim // 2) * 8  # complex64 rotation factors per position
    w = _paged_weights(spec, plan.weights, act_bytes)
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
    tables = [_paged_weights(m, p.weights, act) for m, p in models]
    weights = [paged_weight_bytes(m, p, act) for m, p in models]
    kv = [paged_kv_bytes_per_token(m, paged_kv_dtype(plan, dtype, on_gpu)) * tokens for m, _ in models]

    chunk = min(plan.max_batch_tokens, n_ctx)
    compute = 0
    for (m, _), w in zip(models, tables):
        per_token = PAGED_ACT_PER_TOKEN_INT4 if w.loading_anon and not on_gpu else PAGED_ACT_PER_TOKEN
        layer_act = per_token * chunk * (m.d_model + m.d_ffn)
        # a prefill chunk at depth n_ctx gathers the context's K and V (and a copy in the run
        # dtype) and hands SDPA a (chunk, n_ctx) mask it turns into floats: no score matrix.
        # On the CPU SDPA reads the kv heads for their query heads (torch 2.5+,
        # attention._SDPA_GQA, measured); on a GPU, unmeasured, K and V expanded to every head
        heads = 2 * m.n_kv_heads if not on_gpu else m.n_kv_heads + m.n_heads
        gathered = 2 * n_ctx * heads * m.head_dim * act
        mask = chunk * n_ctx * 5
        logits = plan.max_batch * m.vocab_size * 4
        compute = max(compute, int(layer_act + gathered + mask + logits))
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
            file_pages = w.loading_file
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
