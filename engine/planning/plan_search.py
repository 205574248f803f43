"""The memory planner's search space (planner.py ranks it): the configurations a model file can
run in on this machine, each with the memory it needs on every device (`memory_model`).

A candidate is a backend and device (`_placements`: what the pins, the file and the machine
allow), a context length (a ladder of powers of two up to the model's maximum; on a CPU, up to
the default context unless --ctx asks for more: RAM is shared with the rest of the machine),
a KV dtype (f16, q8_0 in llama.cpp), batch slots (paged: KV windows in the pool), draft on or
off, and for llama.cpp on a GPU the most layers that fit there (`_offload`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmlocal.models.sizes import format_size
from llmlocal.models.tensor_names import PAGED_ARCHS

from ..plan import DEFAULT_MAX_CTX, Plan, paged_kv_dtype
from .hardware import Hardware
from .memory_model import DeviceMemory, estimate

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec

BACKENDS = ("llamacpp", "paged")  # what the planner sizes; "sparse" joins when its backend is installed
MARGIN_FRACTION = 0.05  # of each device's budget, kept free for prediction error and growth
MARGIN_MIN = 128 << 20
CTX_FLOOR = 512
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Pins:
    """Dimensions the user fixed with flags; None leaves the planner free."""

    backend: str | None = None  # "llamacpp" | "paged" | "sparse"
    device: str | None = None  # "cpu" | "cuda"
    n_ctx: int | None = None
    gpu_layers: int | None = None
    kv_dtype: str | None = None
    draft: bool | None = None  # True: use the draft given to `choose`; False: never
    kv_blocks: int | None = None


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    spec: ModelSpec  # the quant variant
    devices: tuple[DeviceMemory, ...]
    budgets: dict[str, int]  # device -> budget (before the margin)
    key: tuple = field(compare=False, default=())

    @property
    def fits(self) -> bool:
        return all(d.need <= usable_budget(self.budgets[d.device]) for d in self.devices)

    @property
    def shortfall(self) -> int:
        """Bytes over the usable budget on the tightest device (<= 0 when it fits)."""
        return max(d.need - usable_budget(self.budgets[d.device]) for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.need for d in self.devices)

    @property
    def quant(self) -> str:
        return quant_name(self.spec)

    @property
    def placement(self) -> str:
        p = self.plan
        if p.backend == "llamacpp" and p.gpu_layers > 0:
            return "all layers on the GPU" if p.gpu_layers > self.spec.n_layers else f"{p.gpu_layers} of {self.spec.n_layers} layers on the GPU"
        return "on the GPU" if p.device == "cuda" else "on the CPU"

    def describe(self) -> str:
        p = self.plan
        kv = p.kv_dtype if p.backend == "llamacpp" else paged_kv_dtype(p, p.dtype if p.dtype != "auto" else (
            "bf16" if p.device == "cuda" else "fp32"), on_gpu=p.device == "cuda")
        slots = p.kv_blocks // -(-p.n_ctx // p.block_size) if p.backend == "paged" and p.kv_blocks else 0
        extra = f", {slots} slot{'s' if slots > 1 else ''}" if slots else ""
        draft = ", draft" if p.draft else ""
        return f"{p.backend} {self.placement}, {self.quant}, context {p.n_ctx}, KV {kv}{extra}{draft} ({format_size(self.total)})"

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        devices = {d.device: d.to_dict() for d in self.devices}
        budgets = {d.device: self.budgets[d.device] for d in self.devices}
        one = len(self.devices) == 1
        return {
            "backend": p.backend,
            "device": p.device,
            "gpu_layers": p.gpu_layers,
            "n_ctx": p.n_ctx,
            "kv_dtype": p.kv_dtype,
            "quant": self.quant,
            "draft": p.draft,
            "kv_blocks": p.kv_blocks,
            "model_path": self.spec.path,
            "predicted_bytes": next(iter(devices.values())) if one else devices,
            "budget_bytes": next(iter(budgets.values())) if one else budgets,
        }


def usable_budget(budget: int) -> int:
    """The budget less the safety margin: what a plan may fill."""
    return budget - max(int(budget * MARGIN_FRACTION), min(MARGIN_MIN, budget // 4))


def quant_name(spec: ModelSpec) -> str:
    """The GGUF file type (Q4_K_M...), or a checkpoint's dominant float type."""
    if spec.file_type:
        return str(spec.file_type)
    by_type: dict[int, int] = {}
    for t in spec.tensors:
        by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.n_bytes
    main = max(by_type, key=by_type.__getitem__) if by_type else -1
    return {0: "F32", 1: "F16", 30: "BF16"}.get(main, "unknown")


def bits_per_weight(spec: ModelSpec) -> float:
    return 8.0 * spec.weight_bytes / max(spec.n_params, 1)


def default_ctx(spec: ModelSpec) -> int:
    return min(spec.context_length, DEFAULT_MAX_CTX)


def _ctx_ladder(spec: ModelSpec, cap: int) -> list[int]:
    top = min(spec.context_length, cap)
    ladder = [n for n in (CTX_FLOOR << k for k in range(12)) if n < top]
    return ladder + [top]


def _budgets(hw: Hardware) -> dict[str, int]:
    out = {"cpu": hw.available_ram}
    if hw.gpus:
        out["cuda:0"] = hw.gpus[0].free_bytes  # one GPU: llmlocal does not split across GPUs yet
    return out


# ---- enumeration --------------------------------------------------------------------------
def _placements(spec: ModelSpec, hw: Hardware, pins: Pins, backends: Sequence[str]) -> list[tuple[str, str]]:
    """(backend, device) pairs the pins and the machine allow for this model file."""
    out = []
    pairs = (("llamacpp", "cuda"), ("llamacpp", "cpu"), ("paged", "cuda"), ("paged", "cpu"), ("sparse", "cpu"))
    for backend, device in pairs:
        if backend not in backends or (pins.backend and pins.backend != backend):
            continue
        if backend == "sparse" and (spec.format != "gguf" or getattr(spec, "sparsity", None) is None):
            continue  # the sparse CPU path needs calibrated thresholds in the file
        if pins.device and pins.device != device:
            continue
        if device == "cuda" and not hw.gpus:
            continue
        if backend == "llamacpp" and (spec.format != "gguf" or pins.draft or (device == "cuda" and not hw.llamacpp_gpu)):
            continue  # llama.cpp: GGUF only, no draft model here, a GPU only in a GPU build
        if backend == "paged" and spec.architecture not in PAGED_ARCHS:
            continue
        if pins.gpu_layers is not None and (pins.gpu_layers > 0) != (device == "cuda"):
            continue  # --gpu-layers N > 0 means the GPU; 0 means the CPU
        if pins.gpu_layers and backend != "llamacpp":
            continue  # only llama.cpp splits layers between devices
        out.append((backend, device))
    return out


def candidates(
    variants: Sequence[ModelSpec], hw: Hardware, pins: Pins, base: Plan, draft: ModelSpec | None, backends: Sequence[str] = BACKENDS
) -> list[Candidate]:
    budgets = _budgets(hw)
    out: list[Candidate] = []
    for spec in variants:
        wanted = pins.n_ctx or default_ctx(spec)
        for backend, device in _placements(spec, hw, pins, backends):
            # RAM is shared with everything else: on a CPU, no context beyond the default unless asked
            cap = spec.context_length if device == "cuda" else max(DEFAULT_MAX_CTX, wanted)
            ctxs = [pins.n_ctx] if pins.n_ctx else _ctx_ladder(spec, cap)
            # paged: its default (f16 on a CPU), or q8_0 where that fits more context (ranked below full precision)
            kvs = [pins.kv_dtype] if pins.kv_dtype else (["f16", "q8_0"] if backend == "llamacpp" else ["auto", "q8_0"])
            can_draft = backend == "paged" and (draft is not None or base.draft is not None)
            drafts = [False] if not can_draft or pins.draft is False else ([True] if pins.draft else [True, False])
            slots = [1] if backend != "paged" else ([16, 4, 1] if device == "cuda" else [4, 1])
            for n_ctx, kv, use_draft, n_slots in itertools.product(ctxs, kvs, drafts, slots):
                plan = base.replace(
                    model=base.model if len(variants) == 1 else spec.path,
                    backend=backend,
                    device=device,
                    n_ctx=n_ctx,
                    kv_dtype=kv,
                    gpu_layers=0,
                    draft=(base.draft or getattr(draft, "path", None)) if use_draft else None,
                    kv_blocks=(pins.kv_blocks or n_slots * -(-n_ctx // BLOCK_SIZE)) if backend != "llamacpp" else None,
                    block_size=BLOCK_SIZE if backend != "llamacpp" else base.block_size,
                )
                if backend == "llamacpp" and device == "cuda":
                    cand = _offload(spec, plan, hw, budgets, pins)
                    if cand is not None:
                        out.append(cand)
                else:
                    out.append(_make(spec, plan, hw, budgets, draft if use_draft else None))
    return out


def _make(spec: ModelSpec, plan: Plan, hw: Hardware, budgets: dict[str, int], draft: ModelSpec | None = None) -> Candidate:
    devices = tuple(estimate(spec, plan, hw.simd, draft))
    return Candidate(plan, spec, devices, budgets)


def _offload(spec: ModelSpec, plan: Plan, hw: Hardware, budgets: dict[str, int], pins: Pins) -> Candidate | None:
    """llama.cpp on a GPU: every layer if it fits, else the most layers that do (the GPU need
    grows with the layer count, the CPU need shrinks)."""
    top = spec.n_layers + 1  # the repeating layers and the output layer
    # with layers on the CPU, part of the KV cache sits in RAM: no context beyond the default
    ram_ctx_ok = (plan.n_ctx or 0) <= max(DEFAULT_MAX_CTX, pins.n_ctx or 0)
    if pins.gpu_layers is not None:
        layers = min(pins.gpu_layers, top)
        return _make(spec, plan.replace(gpu_layers=layers), hw, budgets) if layers == top or ram_ctx_ok else None
    full = _make(spec, plan.replace(gpu_layers=top), hw, budgets)
    if full.fits or not ram_ctx_ok:
        return full if full.fits else None

    def gpu_fits(g: int) -> bool:
        c = _make(spec, plan.replace(gpu_layers=g), hw, budgets)
        return all(d.need <= usable_budget(budgets[d.device]) for d in c.devices if d.device != "cpu")

    lo, hi = 0, spec.n_layers  # largest g with the GPU side fitting: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if gpu_fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return _make(spec, plan.replace(gpu_layers=lo), hw, budgets) if lo > 0 else None
