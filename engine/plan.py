"""`Plan`: the one configuration object that flows from the CLI to a backend.

Until the memory planner chooses them, the fields are filled from CLI flags and defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from llmlocal.models.errors import LLMLocalError

if TYPE_CHECKING:
    from llmlocal.models import ResolvedModel

BACKENDS = ("auto", "llamacpp", "paged", "sparse", "remote")
KV_DTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
DTYPES = ("auto", "fp32", "fp16", "bf16")
WEIGHTS = ("auto", "dense", "int4", "int8")
DRAFT_WEIGHTS = ("auto", "file")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_CTX = 8192  # default context cap when the user does not ask for one


@dataclass(frozen=True)
class Plan:
    model: str | None = None  # name or path; None is the starter model
    backend: str = "auto"
    device: str = "auto"
    n_ctx: int | None = None  # None: the model's trained context, capped at DEFAULT_MAX_CTX
    threads: int | None = None  # None: physical cores
    n_batch: int = 512  # prompt tokens per forward pass during prefill
    gpu_layers: int = 0
    # paged backend
    dtype: str = "auto"  # activations and KV cache: bf16 on CUDA, fp32 on CPU
    weights: str = "auto"  # INT4 where the GGUF is 4-bit, else the run dtype
    block_size: int = 16  # tokens per KV block
    kv_blocks: int | None = None  # KV pool size in blocks (None: sized from n_ctx and max_batch)
    max_batch: int = 16  # sequences decoded together
    max_batch_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    kv_dtype: str = "auto"  # KV cache element type (auto: f16 in llama.cpp; see paged_kv_dtype)
    kv_cache_dir: str | None = None  # the prefix cache's disk tier (None: none; the CLI's default is kv_disk.default_dir)
    kv_cache_size: int = 4 << 30  # bytes the disk tier may hold, over all models
    packed_cache_dir: str | None = None  # CPU weights in the kernels' layout kept on disk (None: packed at every load; the CLI's default is packed_cache.default_dir)
    packed_cache_size: int = 16 << 30  # bytes that directory may hold, over all models
    # speculative decoding (paged backend)
    draft: str | None = None  # draft model name/path, or "ngram" for prompt lookup
    draft_k: int | None = None  # tokens proposed per step (None: adaptive)
    draft_weights: str = "auto"  # auto: on the CPU, its tensors wider than 4.5 bits a weight as Q4_0; file: as stored
    # prompts
    chat_template: str | None = None  # a template name or Jinja file instead of the model's own
    # sparse backend
    sparsity: float | None = None  # None: the model's calibrated level; 0 is dense
    # remote backend: an OpenAI-compatible server
    endpoint: str | None = None
    api_key: str | None = None
    # memory planner
    memory_budget: int | None = None  # bytes the plan may use (None: probed)
    # what `model` resolved to (file, header, template, tokenizer), set where the model was first
    # resolved (the planner) so that loading reads nothing again; None: Engine.load resolves it.
    # Not an option: from_dict refuses it, and a plan for another model drops it (replace).
    resolved: ResolvedModel | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise LLMLocalError(f"Unknown backend '{self.backend}': choose one of {', '.join(BACKENDS)}.")
        if self.device not in DEVICES:
            raise LLMLocalError(f"Unknown device '{self.device}': choose one of {', '.join(DEVICES)}.")
        if self.n_ctx is not None and self.n_ctx < 16:
            raise LLMLocalError(f"The context length must be at least 16 tokens, got {self.n_ctx}.")
        if self.threads is not None and self.threads < 1:
            raise LLMLocalError(f"threads must be at least 1, got {self.threads}.")
        if self.n_batch < 1:
            raise LLMLocalError(f"n_batch must be at least 1, got {self.n_batch}.")
        if self.dtype not in DTYPES:
            raise LLMLocalError(f"Unknown dtype '{self.dtype}': choose one of {', '.join(DTYPES)}.")
        if self.weights not in WEIGHTS:
            raise LLMLocalError(f"Unknown weight mode '{self.weights}': choose one of {', '.join(WEIGHTS)}.")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise LLMLocalError(f"Unknown draft weight mode '{self.draft_weights}': choose one of {', '.join(DRAFT_WEIGHTS)}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise LLMLocalError(f"block_size must be a power of two, got {self.block_size}.")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise LLMLocalError(f"kv_blocks must be at least 1, got {self.kv_blocks}.")
        if self.max_batch < 1 or self.max_batch_tokens < 1:
            raise LLMLocalError("max_batch and max_batch_tokens must be at least 1.")
        if self.kv_dtype not in KV_DTYPES:
            raise LLMLocalError(f"Unknown KV cache type '{self.kv_dtype}': choose one of {', '.join(KV_DTYPES)}.")
        if self.draft_k is not None and not 1 <= self.draft_k <= 16:
            raise LLMLocalError(f"draft_k must be between 1 and 16, got {self.draft_k}.")
        if self.sparsity is not None and not 0.0 <= self.sparsity < 1.0:
            raise LLMLocalError(f"sparsity must be in [0, 1), got {self.sparsity}.")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise LLMLocalError(f"The memory budget must be positive, got {self.memory_budget} bytes.")
        if self.kv_cache_size <= 0:
            raise LLMLocalError(f"The KV cache size must be positive, got {self.kv_cache_size} bytes.")
        if self.packed_cache_size <= 0:
            raise LLMLocalError(f"The packed weights cache size must be positive, got {self.packed_cache_size} bytes.")
        if self.gpu_layers < 0:
            raise LLMLocalError(f"gpu_layers must be >= 0, got {self.gpu_layers}.")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Plan:
        """Build a Plan from a mapping, rejecting keys it does not know."""
        known = {f.name for f in dataclasses.fields(cls)} - {"resolved"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LLMLocalError(f"Unknown plan option(s) {', '.join(unknown)}: valid ones are {', '.join(sorted(known))}.")
        return cls(**values)

    def replace(self, **changes: Any) -> Plan:
        if "model" in changes and changes["model"] != self.model and "resolved" not in changes:
            changes["resolved"] = None  # what the old name resolved to is not the new model
        return dataclasses.replace(self, **changes)


def paged_kv_dtype(plan: Plan, run_dtype: str, on_gpu: bool) -> str:
    """The paged engine's KV cache element type ("f32", "f16", "bf16" or "q8_0": int8 with an
    fp16 scale per 32 values, kv_quant) for a run in ``run_dtype`` ("fp32", "fp16", "bf16"): the
    plan's, else f16 for an fp32 run on the CPU (what llama.cpp keeps too: half the bytes decode
    attention reads and the pool holds), else the run dtype. q8_0 is never chosen by default:
    the planner picks it where f16 does not fit the context."""
    if plan.kv_dtype != "auto":
        return plan.kv_dtype
    if run_dtype == "fp32" and not on_gpu:
        return "f16"
    return {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}[run_dtype]
