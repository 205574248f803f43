"""What the memory models of both engines share (`memory_model` for llama.cpp and the entry
point, `memory_paged` for llmlocal's paged engine): the bytes one device holds
(`DeviceMemory`), byte sizes of types, a model's tensors by GGUF name, a per-spec memo, and
llama.cpp's fixed overhead, which the paged engine's tokenizer (a vocabulary-only llama.cpp
model) also costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec, TensorInfo

MIB = 1 << 20
# ggml type ids (gguf-py's GGMLQuantizationType), kept here so planning imports nothing heavy
F32, F16, Q4_0, Q4_1, Q8_0, Q2_K, Q4_K, Q6_K, IQ4_NL, BF16 = 0, 1, 2, 3, 8, 10, 12, 14, 20, 30
INT4_TYPES = frozenset({Q4_0, Q4_1, Q4_K})  # the paged engine keeps these as exact INT4
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 values + an fp16 scale
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# llama.cpp's fixed overhead (fitted, memory_model's docstring): the paged engine's tokenizer is a
# vocabulary-only llama.cpp model and costs the same
LLAMACPP_OVERHEAD = int(7.5 * MIB)  # graph metadata, sampler, library pages the kernels touch: fixed part
LLAMACPP_OVERHEAD_PER_VOCAB = 346  # bytes per vocabulary entry


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
