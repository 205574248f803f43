"""Decode steps in one native call per token and eight sequences (CPU, INT4 kernels).

A decode step of a small model is hundreds of small torch calls (norms, RoPE, the KV write,
attention, activations, residuals) around the projections; on the starter model (30 layers)
they cost more than the projections' weight reads. `FastDecode` hands the whole stack of
layers to `DecodeStack` (native/cpu/csrc/module.c), which runs the same arithmetic
in C with the projections through the same kernels, and leaves embedding (with its scale),
final norm, head and sampling to the model. Each layer's family options go with it: QK-norm,
sandwich norms, the MLP's activation, its sliding window and which RoPE table it rotates with.
It takes over the steps it can run exactly: every sequence of the step decoding one token
(eight sequences a call), in the runner's own KV cache (float32, fp16 or q8_0), with every
projection a native kernel and a bias on qkv at most; prefill chunks go through the torch model
(in a step mixed with decodes, after the decode rows have run natively: `_mixed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch
from llmlocal.models import ModelSpec
from llmlocal.models.spec import SPARSITY_PROJECTIONS
from llmlocal.native.cpu import kernels
from llmlocal.native.cpu import runtime as sparse_int4_runtime
from llmlocal.native.cpu.linear import QuantLinear, prompt_rows, prompt_rows_from
from llmlocal.native.cpu.pack_ahead import PackAhead
from llmlocal.native.cpu.qlayout import QuantRows, requantize_q4_0, wider_than_q4_0

from ..core.model_runner import ModelRunner
from .attention import AttentionMetadata
from .gguf_parts import activations
from .gguf_tensors import INT4_TYPES
from .linear import Int8Linear
from .llama import PROJECTIONS, LlamaModel
from .loader import QuantFactory
from .sparse_linear import NativeInt8Linear, QuantProjection, SparseInt4Projection

# the order of a layer's projections in DecodeStack, by calibration name
_ORDER = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")
assert set(_ORDER) == set(SPARSITY_PROJECTIONS)
MAX_ROWS = 8  # sequences per native call (the kernels' batch)
_ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1}  # DecodeStack's gated-MLP nonlinearities
# DecodeStack's KV types by the pool's dtype (int8: q8_0 rows, see kv_quant)
_KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}


def native_int4(device: torch.device, dtype: torch.dtype) -> type[SparseInt4Projection] | None:
    """The layer for INT4 projections on this device: the native kernels on the CPU in fp32
    (dense until thresholds are set), or None for torch's INT4 matmul."""
    if device.type != "cpu" or dtype != torch.float32 or not sparse_int4_runtime.built():
        return None
    return SparseInt4Projection


def native_quant(
    device: torch.device, dtype: torch.dtype, spec: ModelSpec, sparse: bool | Callable[[QuantRows], bool] = False,
    ahead: PackAhead | None = None, mode: str | None = None, q4_0: bool = False,
) -> QuantFactory | None:
    """The layer for the GGUF quantized projections of ``spec``'s file on this device: the
    int8-activation kernels reading each tensor in its own bytes (every type of
    `qlayout.FORMATS`), on the CPU in fp32; None elsewhere. Dense models store columns in quads
    (faster); ``sparse`` keeps each column its own run, so that the kernels skip the columns of
    zeroed inputs (a predicate: for the tensors it returns True for, by their first part).
    Activations as `gguf_parts.activations` says: with fp32 the 4-bit types keep the INT4
    kernels (closer to an exact reference, slower: see docs/backends.md), and only the others
    take the int8 path. ``ahead``: the dense layout of projections packed beforehand
    (`gguf_parts.start_packing`). ``mode`` ("int8" or "fp32") overrides the activations.
    ``q4_0``: tensors of more bits a weight than Q4_0 requantized to it (`wider_than_q4_0`: a
    draft model's, `paged_setup.load_draft`)."""
    if native_int4(device, dtype) is None:
        return None
    mode = mode or activations(spec)

    def build(parts: list[QuantRows], bias: torch.Tensor | None) -> QuantProjection | None:
        if mode == "fp32" and all(p.qtype in INT4_TYPES for p in parts):
            return None  # the INT4 factory takes them
        columns = sparse(parts[0]) if callable(sparse) else sparse
        if q4_0:
            parts = [(requantize_q4_0(p) or p) if wider_than_q4_0(p.qtype) else p for p in parts]
        return QuantProjection(parts, bias, interleaved=not columns, ahead=None if columns else ahead)

    return build


def native_head(model: LlamaModel) -> None:
    """Move an INT8 output head (a tied quantized embedding, or an INT8 `lm_head`) onto the
    native INT8 GEMV; the embedding lookup keeps reading the same rows."""
    if type(model.embed_int8) is Int8Linear:
        model.embed_int8 = NativeInt8Linear.of(model.embed_int8)
    if type(model.lm_head) is Int8Linear:
        model.lm_head = NativeInt8Linear.of(model.lm_head)


def _matrices(kernel: object) -> object:
    """What DecodeStack takes for one projection: a Matrix, or a tuple of QMatrix by rows."""
    return kernel.matrices if isinstance(kernel, QuantLinear) else kernel._matrix  # type: ignore[attr-defined]


class FastDecode:
    enabled = True  # class-wide switch (tests and the benchmark compare both paths)

    def __init__(self, runner: ModelRunner) -> None:
        model = runner.model
        cfg = model.cfg
        self.runner, self.model = runner, model
        layers = []
        for layer, (k_cache, v_cache) in zip(model.layers, runner.kv_caches):
            mats = [_matrices(getattr(layer, a).kernel) for a in PROJECTIONS]
            ptr = lambda m: None if m is None else m.weight.data_ptr()  # noqa: E731 (an optional norm)
            bias = layer.qkv.bias
            layers.append((layer.attn_norm.weight.data_ptr(), *mats, layer.mlp_norm.weight.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), None if bias is None else bias.data_ptr(),
                           ptr(layer.q_norm), ptr(layer.k_norm), ptr(layer.post_attn_norm), ptr(layer.post_mlp_norm),
                           layer.window, layer.local))
        first = model.layers[0]
        kv_type = _KV_TYPES[runner.kv_caches[0][0].dtype]
        config = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ffn, float(first.attn_norm.eps),
                  float(first.scale), kv_type, _ACTIVATION_IDS[cfg.activation])
        self.stack = kernels().DecodeStack(config, layers)
        n = len(model.layers)
        self.thresholds = np.zeros(n * 4, dtype=np.float32)
        self.kept = np.zeros(n * 4, dtype=np.int64)
        shapes = [(getattr(layer, a).in_features, getattr(layer, a).out_features) for layer in model.layers for a in PROJECTIONS]
        self.out_features = np.array([n for _, n in shapes], dtype=np.int64)
        self.weights_per_row = sum(k * n for k, n in shapes)  # entries a token asks for
        self.tokens = 0
        self.cis = torch.view_as_real(model.rotary.cis).contiguous()  # (P, D/2, 2) float32: [cos, sin]
        local = model.rotary_local  # the windowed layers' own table (Gemma 3), or None
        self.cis_local = None if local is None else torch.view_as_real(local.cis).contiguous()
        self._generic = model.forward
        model.forward = self.forward  # type: ignore[method-assign]
        runner.native_rows = MAX_ROWS  # verification chunks come as decode rows (see ModelRunner.execute)

    @classmethod
    def attach(cls, runner: ModelRunner) -> FastDecode | None:
        """On the CPU in fp32 with the kernels built: the INT8 head through the native GEMV,
        and the fast path for this runner's model (when it can take it; see `build`)."""
        if native_int4(runner.device, runner.model.dtype) is None:
            return None
        native_head(runner.model)
        return cls.build(runner)

    @classmethod
    def build(cls, runner: ModelRunner) -> FastDecode | None:
        """The fast path for this runner's model, or None if some layer cannot take it."""
        model = runner.model
        if model.dtype != torch.float32 or runner.kv_caches[0][0].dtype not in _KV_TYPES:
            return None
        for layer in model.layers:
            for a in PROJECTIONS:
                m = getattr(layer, a)
                if not isinstance(m, SparseInt4Projection) or (m.bias is not None and a != "qkv"):
                    return None
            bias = layer.qkv.bias
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
                return None
        return cls(runner)

    def set_thresholds(self, table: Mapping[str, Sequence[float]]) -> None:
        t = np.array([[table[p][i] for p in _ORDER] for i in range(len(self.model.layers))], dtype=np.float32)
        self.thresholds[:] = t.reshape(-1)

    def counts(self) -> tuple[int, int]:
        """(weight entries skipped, weight entries asked for) by the fast path so far."""
        total = self.weights_per_row * self.tokens
        read = int((self.kept * self.out_features).sum())
        return total - read, total

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        if (
            not self.enabled
            or SparseInt4Projection.timed
            or meta.num_decode == 0
            or meta.decode_slots is None
            or kv_caches is not self.runner.kv_caches
        ):
            return self._generic(input_ids, positions, kv_caches, meta)
        if meta.prefills:
            return self._mixed(input_ids, positions, kv_caches, meta)
        model = self.model
        h = model.embed_tokens(input_ids).contiguous()  # (B, d) float32, overwritten in place
        slots = meta.decode_slots  # (B, L), row b's first lens[b] valid
        assert meta.context_lens is not None
        lens = meta.context_lens.to(torch.int64)
        cis = self.cis[positions]  # (B, D/2, 2)
        cis_local = None if self.cis_local is None else self.cis_local[positions]
        new = meta.slot_mapping
        for b0 in range(0, n, MAX_ROWS):  # the sequences are independent: 8 rows a call
            b1 = min(n, b0 + MAX_ROWS)
            self.stack.step(
                h[b0].data_ptr(),
                cis[b0].data_ptr(),
                0 if cis_local is None else cis_local[b0].data_ptr(),
                slots[b0].data_ptr(),
                slots.shape[1],
                lens[b0].data_ptr(),
                new[b0].data_ptr(),
                b1 - b0,
                self.thresholds.ctypes.data,
                self.kept.ctypes.data,
            )
        self.tokens += n
        return model.norm(h)

    def _mixed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A step of decode rows and prefill chunks (a prompt arriving while others decode): the
        decode rows natively, as in a step of their own, then the chunks through the torch
        model, each with its part of the metadata. The sequences are independent, so nothing
        changes but where the rows run: a decoded token's numbers do not depend on the prompts
        computed beside it (they would, by float rounding, through the torch layers), and a
        prompt's rows are computed as the prompt path computes them."""
        nd = meta.num_decode
        decode = replace(meta, slot_mapping=meta.slot_mapping[:nd], prefills=[], window_masks={})
        chunks = replace(
            meta, slot_mapping=meta.slot_mapping[nd:], num_decode=0, block_tables=None, context_lens=None,
            max_context_len=0, decode_slots=meta.decode_slots[:0], decode_mask=None, window_masks={},
            prefills=[replace(c, offset=c.offset - nd) for c in meta.prefills],
        )
        first = prompt_rows_from()
        out = torch.empty((input_ids.shape[0], self.model.cfg.d_model), dtype=torch.float32, device=input_ids.device)
        out[:nd] = self.forward(input_ids[:nd], positions[:nd], kv_caches, decode)
        with prompt_rows(first - nd) if first is not None else nullcontext():
            out[nd:] = self._generic(input_ids[nd:], positions[nd:], kv_caches, chunks)
        return out
