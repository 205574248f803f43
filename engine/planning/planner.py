"""The memory planner: the best configuration that fits this machine, chosen before loading.

    choice = choose(variants, hardware, Pins(n_ctx=4096))
    choice.plan      # a Plan for Engine.load: backend, device, gpu layers, context, KV dtype...
    choice.reasons   # why, in sentences; choice.alternatives: the runners-up

Candidates (plan_search.py) span backend (llamacpp, paged), placement (every layer on the GPU,
as many as fit, CPU only), quant variant (the model files the caller found for the name),
context length, KV dtype, batch slots and draft on/off. Explicit flags pin their dimension. A candidate fits when, on every device, its predicted
need (`memory_model`) stays under the budget less a safety margin. Among those that fit the
order is, most important first:

    1. every layer on the fastest device (the GPU when there is one)
    2. context at least the requested (or default) length
    3. higher-quality quant (more bits per weight)
    4. more layers on the GPU (partial offload)
    5. longer context
    6. full-precision KV cache
    7. draft model on
    8. the backend preferred on the device: paged on CUDA; on a CPU sparse for a file with
       calibrated sparsity where skipping pays (native_support.sparse_pays), paged where its
       native kernels decode the file faster than llama.cpp on this CPU, or as fast with the
       prefix cache's disk tier on (native_support.paged_pays), else llamacpp
    9. more batch slots
   10. less memory
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmlocal.models.errors import LLMLocalError
from llmlocal.models.sizes import format_size
from llmlocal.native.cpu import runtime as sparse_int4_runtime

from ..plan import Plan
from .hardware import Hardware
from .native_support import (
    FASTER_ON_NAME,
    PARITY_ON,
    PARITY_ON_NAME,
    decodes_faster_natively,
    paged_pays,
    runs_natively,
    sparse_pays,
)
from .plan_search import (
    BACKENDS,
    PAGED_ARCHS,
    Candidate,
    Pins,
    bits_per_weight,
    candidates,
    default_ctx,
    quant_name,
    usable_budget,
)

if TYPE_CHECKING:
    from llmlocal.models import ModelSpec


class NothingFitsError(LLMLocalError):
    """No configuration of the model fits the memory budget."""


@dataclass(frozen=True)
class Choice:
    chosen: Candidate
    alternatives: tuple[Candidate, ...]  # the best few others that fit, best first
    reasons: tuple[str, ...]
    hardware: Hardware

    @property
    def plan(self) -> Plan:
        """The chosen Plan, its memory budget set to the main device's."""
        c = self.chosen
        return c.plan.replace(memory_budget=c.budgets["cuda:0" if c.plan.device == "cuda" else "cpu"])

    def to_dict(self) -> dict[str, Any]:
        out = self.chosen.to_dict()
        out["reasons"] = list(self.reasons)
        out["alternatives"] = [a.to_dict() for a in self.alternatives]
        return out


# ---- ranking ------------------------------------------------------------------------------
def _key(c: Candidate, has_gpu: bool, wanted: int, cpu_default: str = "llamacpp") -> tuple:
    """The candidate's rank (`_KEY_WORDS`); ``cpu_default``: the backend preferred on a CPU for
    its file (`_cpu_backend`, worked out once per file: it reads every tensor's type)."""
    p = c.plan
    all_fastest = (p.device == "cuda" and (p.backend == "paged" or p.gpu_layers > c.spec.n_layers)) if has_gpu else True
    gpu_fraction = (min(p.gpu_layers, c.spec.n_layers) / c.spec.n_layers) if p.backend == "llamacpp" else (1.0 if p.device == "cuda" else 0.0)
    slots = (p.kv_blocks or 0) // -(-(p.n_ctx or 1) // p.block_size) if p.backend == "paged" else 1
    preferred_backend = p.backend == ("paged" if p.device == "cuda" else cpu_default)
    return (
        all_fastest,
        (p.n_ctx or 0) >= wanted,
        round(bits_per_weight(c.spec), 2),
        gpu_fraction,
        p.n_ctx or 0,
        p.kv_dtype in ("auto", "f16", "bf16", "f32"),
        p.draft is not None,
        preferred_backend,
        slots,
        -c.total,
    )


def _cpu_backend(spec: ModelSpec, simd: frozenset[str], disk_cache: bool) -> str:
    """The backend preferred on a CPU: sparse for a file with calibrated sparsity where skipping
    pays (native_support.sparse_pays), paged where its native kernels decode the file faster
    than llama.cpp on this CPU or as fast with the disk KV cache on (``disk_cache``), else
    llama.cpp (which runs a calibrated file densely)."""
    if getattr(spec, "sparsity", None) is not None and sparse_pays(spec, simd):
        return "sparse"
    return "paged" if paged_pays(spec, simd, disk_cache) else "llamacpp"


_KEY_WORDS = (
    "not every layer on the fastest device",
    "a context shorter than the default",
    "a lower-quality quant",
    "fewer layers on the GPU",
    "a shorter context",
    "a quantized KV cache",
    "no draft model",
    "the backend not preferred for this device",
    "fewer batch slots",
    "more memory",
)


def choose(
    variants: Sequence[ModelSpec],
    hardware: Hardware,
    pins: Pins | None = None,
    base: Plan | None = None,
    draft: ModelSpec | None = None,
    backends: Sequence[str] = BACKENDS,
) -> Choice:
    """The best plan for the model (its quant ``variants``: ModelSpecs) on ``hardware``.

    ``base`` supplies the fields the planner does not choose (threads, sampling-free engine
    settings); ``draft`` is the draft model's ModelSpec when speculative decoding is
    possible. Raises `NothingFitsError` (one sentence with the numbers and the nearest fix).
    """
    if not variants:
        raise LLMLocalError("No model file to plan for: pass a model name or path.")
    pins = pins or Pins()
    base = base or Plan()
    has_gpu = bool(hardware.gpus) and pins.device != "cpu"
    cands = candidates(variants, hardware, pins, base, draft, backends)
    if not cands:
        raise LLMLocalError(_no_candidate(variants, hardware, pins))
    wanted = {id(s): pins.n_ctx or default_ctx(s) for s in variants}
    cpu_default = {id(s): _cpu_backend(s, hardware.simd, base.kv_cache_dir is not None) for s in variants}
    ranked = sorted(
        (Candidate(c.plan, c.spec, c.devices, c.budgets, _key(c, has_gpu, wanted[id(c.spec)], cpu_default[id(c.spec)]))
         for c in cands),
        key=lambda c: c.key,
        reverse=True,
    )
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        raise NothingFitsError(_nothing_fits(variants, hardware, pins, base, draft, ranked, backends))
    best = fitting[0]
    others = _distinct(fitting[1:], best)
    return Choice(best, tuple(others[:3]), tuple(_reasons(best, others, ranked, hardware, pins)), hardware)


def _distinct(cands: list[Candidate], best: Candidate) -> list[Candidate]:
    """Alternatives that differ from the choice in something a user would notice."""
    seen = {_visible(best)}
    out = []
    for c in cands:
        v = _visible(c)
        if v not in seen:
            seen.add(v)
            out.append(c)
    return out


def _visible(c: Candidate) -> tuple:
    p = c.plan
    return (p.backend, p.device, p.gpu_layers, c.spec.path, p.n_ctx, p.kv_dtype, p.draft is not None)


# ---- explanations -------------------------------------------------------------------------
def _reasons(best: Candidate, others: list[Candidate], ranked: list[Candidate], hw: Hardware, pins: Pins) -> list[str]:
    p = best.plan
    out = []
    for d in best.devices:
        budget = best.budgets[d.device]
        out.append(
            f"{d.device}: needs {format_size(d.need)} of {format_size(budget)} available "
            f"({format_size(budget - usable_budget(budget))} kept free as a margin)"
        )
    spec = best.spec
    if p.backend == "llamacpp" and p.gpu_layers and p.gpu_layers <= spec.n_layers:
        if pins.gpu_layers is not None:
            out.append(f"{p.gpu_layers} of {spec.n_layers} layers on the GPU: as asked with --gpu-layers")
        else:
            out.append(f"only {p.gpu_layers} of {spec.n_layers} layers fit on the GPU; the rest run on the CPU")
    elif best.key and best.key[0] and hw.gpus and p.device == "cuda":
        out.append("every layer fits on the GPU")
    elif not hw.gpus:
        out.append("no GPU found: the CPU runs every layer")
    backend_reason = _cpu_backend_reason(best, hw, pins)
    if backend_reason:
        out.append(backend_reason)
    default = default_ctx(spec)
    if pins.n_ctx:
        out.append(f"context {p.n_ctx}: as asked with --ctx")
    elif p.n_ctx == spec.context_length:
        out.append(f"context {p.n_ctx}: the model's maximum")
    elif p.n_ctx > default:
        out.append(f"context {p.n_ctx}: the longest that fits (the model takes up to {spec.context_length})")
    elif p.n_ctx == default:
        cpu_cap = p.device == "cpu" or (p.backend == "llamacpp" and p.gpu_layers <= spec.n_layers)
        more = f" (the model takes up to {spec.context_length}: pass --ctx for more)" if cpu_cap else ""
        out.append(f"context {p.n_ctx}: the default{more}")
    else:
        out.append(f"context {p.n_ctx}: the longest that fits (the default {default} does not)")
    if p.kv_dtype == "q8_0" and pins.kv_dtype:
        out.append("KV cache in q8_0: as asked with --kv-dtype")
    elif p.backend == "llamacpp" and p.kv_dtype == "q8_0":
        out.append("KV cache in q8_0 (half of f16): f16 would not fit this context")
    elif p.kv_dtype == "q8_0":
        out.append(_q8_reason(best, ranked))
    if len({c.spec.path for c in ranked}) > 1:
        out.append(f"quant {best.quant} ({bits_per_weight(spec):.1f} bits/weight): the highest quality that fits")
    if others:
        ru = others[0]
        why = _KEY_WORDS[_first_difference(best.key, ru.key)]
        out.append(f"runner-up: {ru.describe()}; it lost on {why}")
    return out


def _q8_reason(best: Candidate, ranked: list[Candidate]) -> str:
    """Why the paged engine keeps a q8_0 KV cache: how much context f16 would have fitted."""
    p = best.plan
    same = [c.plan.n_ctx or 0 for c in ranked
            if c.fits and c.plan.kv_dtype != "q8_0" and (c.plan.backend, c.plan.device, c.spec.path) == (p.backend, p.device, best.spec.path)]
    f16 = f"f16 fits a context of {max(same)} at most" if same else "f16 fits no context here"
    return f"KV cache in q8_0 (int8 with a scale per 32 values: 1.88x the tokens of f16 in the same memory): {f16}"


def _cpu_backend_reason(best: Candidate, hw: Hardware, pins: Pins) -> str | None:
    """Why this backend runs a GGUF on the CPU, when the planner chose it (not --backend)."""
    p, spec = best.plan, best.spec
    if pins.backend or p.device != "cpu" or spec.format != "gguf" or p.backend not in ("paged", "llamacpp"):
        return None
    if p.backend == "paged" and decodes_faster_natively(spec, hw.simd):
        return f"paged: llmlocal's own kernels decode this file's types faster than llama.cpp on a CPU with {FASTER_ON_NAME}"
    if p.backend == "paged" and paged_pays(spec, hw.simd, p.kv_cache_dir is not None):  # at parity, for the cache
        return (f"paged: on {PARITY_ON_NAME} llmlocal's own kernels decode this file at least as fast as llama.cpp, and "
                "its prefix cache keeps prompts on disk, so a chat's history or a repeated system prompt is never "
                "prefilled twice, across restarts too (--no-kv-cache: llama.cpp, which loads sooner)")
    if p.backend == "llamacpp" and runs_natively(spec):
        if PARITY_ON <= hw.simd:
            return (f"llamacpp: on a CPU without {FASTER_ON_NAME} llmlocal's own kernels lead llama.cpp by less "
                    "and load this file slower, and the disk KV cache that makes them worth it is off")
        return (f"llamacpp: on a CPU without {FASTER_ON_NAME} or {PARITY_ON_NAME} llmlocal's own kernels decode this "
                "file slower (--backend paged batches requests, caches prefixes and drafts)")
    return None


def _first_difference(a: tuple, b: tuple) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return len(a) - 1


def _no_candidate(variants: Sequence[ModelSpec], hw: Hardware, pins: Pins) -> str:
    spec = variants[0]
    if pins.backend == "paged" and spec.architecture not in PAGED_ARCHS:
        return f"The paged backend does not run '{spec.architecture}' models: use --backend llamacpp."
    if pins.backend == "llamacpp" and spec.format != "gguf":
        return f"llama.cpp runs GGUF files and {spec.path} is not one: use --backend paged or convert it with `llmlocal quantize`."
    if pins.device == "cuda" and not hw.gpus:
        return "--device cuda was asked for but no CUDA GPU was found: use --device cpu."
    if pins.backend == "sparse":
        if pins.device == "cuda":
            return "The sparse backend runs on the CPU: drop --device cuda, or use --backend paged."
        if getattr(spec, "sparsity", None) is None:
            return (f"{spec.path} has no calibrated sparsity thresholds: calibrate it with "
                    "`llmlocal quantize MODEL --sparsity -o OUT.gguf`.")
        return "The sparse INT4 kernels of llmlocal are not compiled: reinstall llmlocal on a machine with a C compiler."
    return "No backend can run this model here: check --backend and --device."


def _nothing_fits(
    variants: Sequence[ModelSpec], hw: Hardware, pins: Pins, base: Plan, draft: ModelSpec | None, ranked: list[Candidate],
    backends: Sequence[str],
) -> str:
    """One sentence: what the closest configuration needs, what is free, and the nearest fix."""
    closest = min(ranked, key=lambda c: c.shortfall)
    worst = max(closest.devices, key=lambda d: d.need - usable_budget(closest.budgets[d.device]))
    budget = closest.budgets[worst.device]
    needs = (
        f"needs {format_size(worst.need)} on {worst.device} at context {closest.plan.n_ctx}, and {format_size(budget)} is free "
        f"({format_size(budget - usable_budget(budget))} of it kept as a margin)"
    )
    # the nearest fix: drop one pin at a time and see what fits
    for name, label in (("n_ctx", "--ctx"), ("gpu_layers", "--gpu-layers"), ("backend", "--backend"), ("draft", "--draft"), ("kv_blocks", "--kv-blocks"), ("device", "--device")):
        if getattr(pins, name) is None:
            continue
        loose = Pins(**{**pins.__dict__, name: None})
        fit = [c for c in candidates(variants, hw, loose, base, draft, backends) if c.fits]
        if fit:
            cpu_default = {id(s): _cpu_backend(s, hw.simd, base.kv_cache_dir is not None) for s in variants}
            best = max(fit, key=lambda c: _key(c, bool(hw.gpus), pins.n_ctx or default_ctx(c.spec), cpu_default[id(c.spec)]))
            value = {"n_ctx": best.plan.n_ctx, "gpu_layers": best.plan.gpu_layers, "backend": best.plan.backend,
                     "draft": "off", "kv_blocks": best.plan.kv_blocks, "device": best.plan.device}[name]
            return f"The model {needs}: use {label} {value}."
    smallest = min(variants, key=lambda s: s.weight_bytes)
    fix = (
        "use a smaller quant such as q4_k_m"
        if bits_per_weight(smallest) > 5.5
        else f"use a smaller model, or a smaller quant than {quant_name(smallest)} (q3_k_m, q2_k)"
    )
    return f"The model {needs}: {fix}, or pass --memory-budget if more memory is really free."

def plan_model(
    model: str | None,
    pins: Pins | None = None,
    base: Plan | None = None,
    hardware: Hardware | None = None,
    memory_budget: str | None = None,
) -> Choice:
    """Resolve ``model`` (a name or path: one file, one variant), probe this machine (or use
    ``hardware``) and choose. The draft named by ``base.draft`` (a model, not "ngram") is
    read too, so its weights and KV cache are counted. The chosen plan carries the resolved
    model (`Plan.resolved`): loading it reads nothing again."""
    from llmlocal.models import resolve

    from .hardware import probe

    base = base or Plan(model=model)
    resolved = resolve(model)
    if base.model == model:
        base = base.replace(resolved=resolved)
    spec = resolved.spec
    draft = resolve(base.draft).spec if base.draft and base.draft != "ngram" else None
    hw = hardware or probe(memory_budget)
    backends = BACKENDS
    if getattr(spec, "sparsity", None) is not None and sparse_int4_runtime.built():
        backends = (*BACKENDS, "sparse")
    return choose([spec], hw, pins, base, draft, backends)
