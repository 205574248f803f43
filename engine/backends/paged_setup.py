"""How the paged backend sets itself up from a plan: device, run and KV dtypes, the drafter
(a draft model's network, and the check that it reads token ids as the target does), and the
prefix cache's disk tiers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from llmlocal.models import ModelSpec, ResolvedModel, resolve
from llmlocal.models.errors import LLMLocalError
from llmlocal.models.fingerprint import model_fingerprint

from ..core.kv_disk import DiskTier, namespace
from ..core.model_runner import ModelRunner
from ..model.fast_decode import FastDecode, native_int4, native_quant
from ..model.gguf_parts import activations
from ..model.llama import LlamaModel
from ..model.loader import load_gguf, load_hf
from ..plan import Plan, paged_kv_dtype
from ..spec.drafter import Drafter, DraftModel, NgramDrafter

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": torch.int8}  # int8: q8_0 rows


def pick_device(plan: Plan) -> torch.device:
    if plan.device == "cuda" or (plan.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LLMLocalError("--device cuda was asked for but PyTorch sees no CUDA GPU: use --device cpu.")
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(plan: Plan, device: torch.device) -> torch.dtype:
    if plan.dtype != "auto":
        return DTYPES[plan.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def pick_kv_dtype(plan: Plan, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    run = next(name for name, t in DTYPES.items() if t == dtype)
    return KV_DTYPES[paged_kv_dtype(plan, run, on_gpu=device.type == "cuda")]


# A draft model's output head: the vocabulary's first ids in the native kernels, and the rarer
# tokens as they appear in the texts drafted for (`DraftHead`). On Qwen2.5-Coder's code and
# prose answers, 98.4% of the tokens chosen have ids below 65,536 (99.0% with the tokens seen
# before in the same text; below 32,768: 94.8% and 96.9%), and the head is a third of what the
# 0.5B draft reads per token.
DRAFT_HEAD_IDS = 65536


def load_draft(draft: ResolvedModel, device: torch.device, dtype: torch.dtype, n_ctx: int,
               weights: str = "auto") -> LlamaModel:
    """The draft model's network; speculation pays by how much cheaper a draft token is than a
    target step, so its projections take the fastest native kernels, those of int8 activations
    (a draft's numbers only propose: the target checks every token; int8 whatever
    LLMLOCAL_NATIVE_ACTIVATIONS asks of the target: a Q4_0 0.5B drafts 41.7 tok/s through
    them against 26.1 through the INT4 kernels of fp32 activations on a Zen 3), and a large
    vocabulary's head is cut to its first DRAFT_HEAD_IDS ids. ``weights`` "auto" (`Plan.
    draft_weights`): its tensors of more bits a weight than Q4_0 requantized to Q4_0, since a
    draft token costs its bytes (the Q4_K_M 0.5B holds its layers in Q5_0 and its head in Q8_0)."""
    if draft.spec.format != "gguf":
        return load_hf(draft.path, device, dtype, "auto", max_position=n_ctx)
    head_rows = DRAFT_HEAD_IDS if draft.spec.vocab_size > 2 * DRAFT_HEAD_IDS else None
    return load_gguf(draft.spec, device, dtype, "auto", max_position=n_ctx, int4=native_int4(device, dtype),
                     quant=native_quant(device, dtype, draft.spec, mode="int8", q4_0=weights == "auto"),
                     head_rows=head_rows)


def make_drafter(plan: Plan, target: ModelSpec, runner: ModelRunner, n_ctx: int, kv_dtype: torch.dtype) -> Drafter:
    """``plan.draft``'s drafter: prompt lookup ("ngram"), or a draft model of the target's
    vocabulary with a KV pool of the target's size, and a disk tier of its own where the target
    has one: a reopened chat's draft then reads its history's K/V instead of computing it."""
    if plan.draft == "ngram":
        return NgramDrafter()
    draft = resolve(plan.draft)
    check_same_vocabulary(target, draft.spec, plan.draft)
    net = load_draft(draft, runner.device, runner.model.dtype, n_ctx, plan.draft_weights)
    draft_runner = ModelRunner(net, runner.num_blocks, runner.block_size, kv_dtype=kv_dtype)
    FastDecode.attach(draft_runner)
    return DraftModel(draft_runner, disk=open_disk_tier(draft, plan, draft_runner, role="draft"))


def check_same_vocabulary(target: ModelSpec, draft: ModelSpec, name: str) -> None:
    """A draft proposes token ids the target must read the same way: refuse another tokenizer."""
    same = target.vocab_size == draft.vocab_size and (
        not target.tokens or not draft.tokens or target.vocab_fingerprint == draft.vocab_fingerprint
    )
    if not same:
        raise LLMLocalError(
            f"The draft model {name} has a different tokenizer than the target ({draft.vocab_size} vs "
            f"{target.vocab_size} tokens, or different token strings): use a draft of the same model "
            "family, or --draft ngram."
        )


def open_disk_tier(model: ResolvedModel, plan: Plan, runner: ModelRunner, role: str = "paged") -> DiskTier | None:
    """The prefix cache's disk tier for this model as this engine computes it, if the plan keeps
    one (`Plan.kv_cache_dir`). Blocks are shared only between engines whose numbers agree: the
    namespace names the files, the role, device, dtypes, weight path, kernels and RoPE tables.
    ``role``: "paged", "sparse" (its kernels' activations; each sparsity level chains its keys
    from a root of its own, `SparseBackend.set_sparsity`) or "draft" (`load_draft`: int8
    activations; a namespace of its own even where the target is the same file)."""
    if not plan.kv_cache_dir:
        return None
    net = runner.model
    k, _ = runner.kv_caches[0]
    rope = hashlib.blake2b(digest_size=8)
    for rotary in (net.rotary, net.rotary_local):
        if rotary is not None:
            rope.update(rotary.cis[: min(2, rotary.cis.shape[0])].cpu().numpy().tobytes())  # position 1: the frequencies
    kernels = "none"
    if runner.device.type == "cpu":
        from llmlocal.native.cpu import runtime

        kernels = runtime.isa() if runtime.built() else "none"
        if kernels != "none" and model.spec.format == "gguf":  # int8 and fp32 activations give other KV
            kernels += f"|acts={'int8' if role == 'draft' else activations(model.spec, sparse=role == 'sparse')}"
    # the sparse backend loads "auto"; a draft too, its wider tensors as Q4_0 unless told otherwise
    weights = {"paged": plan.weights, "draft": f"auto|draft={plan.draft_weights}"}.get(role, "auto")
    numerics = (f"{role}|{runner.device.type}|{net.dtype}|kv={k.dtype}|weights={weights}|kernels={kernels}"
                f"|rope={rope.hexdigest()}")
    if role == "sparse":  # the calibration, whether or not the fingerprint's bytes cover the file's metadata
        numerics += "|thresholds=" + hashlib.blake2b(repr(model.spec.sparsity).encode(), digest_size=8).hexdigest()
    ns = namespace(model_fingerprint(model.path), numerics, runner.block_size, tuple(k.shape[1:]) + (len(runner.kv_caches),))
    about = {"model": model.name + (f" ({role})" if role != "paged" else ""), "path": str(model.path), "numerics": numerics}
    return DiskTier(Path(plan.kv_cache_dir), ns, runner.block_size, runner.block_nbytes,
                    max_bytes=plan.kv_cache_size, about=about)
