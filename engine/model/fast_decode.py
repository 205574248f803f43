"""Decode steps in one native call per token and eight sequences (CPU, INT4 kernels).

A decode step of a small model is hundreds of small torch calls (norms, RoPE, the KV write,
attention, activations, residuals) around the projections; on the starter model (30 layers)
they cost more than the projections' weight reads. `FastDecode` hands the whole stack of
layers to `DecodeStack` (native/sparse_int4/csrc/module.c), which runs the same arithmetic
in C with the projections through the same kernels, and leaves embedding, final norm, head
and sampling to the model. It takes over the steps it can run exactly: every sequence of the
step decoding one token (eight sequences a call), in the runner's own KV cache (float32 or
fp16), with every projection an INT4 kernel without bias; everything else (prefill, chunks mixed with decodes,
speculative verification) goes through the torch model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from llmlocal.models.spec import SPARSITY_PROJECTIONS
from llmlocal.native.sparse_int4 import kernels
from llmlocal.native.sparse_int4 import runtime as sparse_int4_runtime

from ..model_runner import ModelRunner
from .attention import AttentionMetadata
from .linear import Int8Linear
from .llama import LlamaModel
from .sparse_linear import NativeInt8Linear, SparseInt4Projection

# the order of a layer's projections in DecodeStack, by calibration name
_ORDER = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")
assert set(_ORDER) == set(SPARSITY_PROJECTIONS)
_ATTRS = ("qkv", "o_proj", "gate_up", "down")
MAX_ROWS = 8  # sequences per native call (the kernels' batch)


def native_int4(device: torch.device, dtype: torch.dtype) -> type[SparseInt4Projection] | None:
    """The layer for INT4 projections on this device: the native kernels on the CPU in fp32
    (dense until thresholds are set), or None for torch's INT4 matmul."""
    if device.type != "cpu" or dtype != torch.float32 or not sparse_int4_runtime.built():
        return None
    return SparseInt4Projection


def native_head(model: LlamaModel) -> None:
    """Move an INT8 output head (a tied quantized embedding, or an INT8 `lm_head`) onto the
    native INT8 GEMV; the embedding lookup keeps reading the same rows."""
    if type(model.embed_int8) is Int8Linear:
        model.embed_int8 = NativeInt8Linear.of(model.embed_int8)
    if type(model.lm_head) is Int8Linear:
        model.lm_head = NativeInt8Linear.of(model.lm_head)


class FastDecode:
    enabled = True  # class-wide switch (tests and the benchmark compare both paths)

    def __init__(self, runner: ModelRunner) -> None:
        model = runner.model
        cfg = model.cfg
        self.runner, self.model = runner, model
        layers = []
        for layer, (k_cache, v_cache) in zip(model.layers, runner.kv_caches):
            mats = [getattr(layer, a).kernel._matrix for a in _ATTRS]
            layers.append((layer.attn_norm.weight.data_ptr(), *mats, layer.mlp_norm.weight.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr()))
        first = model.layers[0]
        kv_f16 = runner.kv_caches[0][0].dtype == torch.float16
        config = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ffn, float(first.attn_norm.eps),
                  float(first.scale), kv_f16)
        self.stack = kernels().DecodeStack(config, layers)
        n = len(model.layers)
        self.thresholds = np.zeros(n * 4, dtype=np.float32)
        self.kept = np.zeros(n * 4, dtype=np.int64)
        shapes = [(getattr(layer, a).in_features, getattr(layer, a).out_features) for layer in model.layers for a in _ATTRS]
        self.out_features = np.array([n for _, n in shapes], dtype=np.int64)
        self.weights_per_row = sum(k * n for k, n in shapes)  # entries a token asks for
        self.tokens = 0
        self.cis = torch.view_as_real(model.rotary.cis).contiguous()  # (P, D/2, 2) float32: [cos, sin]
        self._generic = model.forward
        model.forward = self.forward  # type: ignore[method-assign]

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
        if model.dtype != torch.float32 or runner.kv_caches[0][0].dtype not in (torch.float32, torch.float16):
            return None
        for layer in model.layers:
            for a in _ATTRS:
                m = getattr(layer, a)
                if not isinstance(m, SparseInt4Projection) or m.bias is not None:
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
            or meta.num_decode != n
            or meta.prefills
            or meta.decode_slots is None
            or kv_caches is not self.runner.kv_caches
        ):
            return self._generic(input_ids, positions, kv_caches, meta)
        model = self.model
        if model.embed_int8 is not None:
            q = model.embed_int8
            h = q.qweight[input_ids].float() * q.scale[input_ids, None].float()
        else:
            h = model.embed[input_ids].clone()  # type: ignore[index]
        slots = meta.decode_slots  # (B, L), row b's first lens[b] valid
        assert meta.context_lens is not None
        lens = meta.context_lens.to(torch.int64)
        cis = self.cis[positions]  # (B, D/2, 2)
        new = meta.slot_mapping
        for b0 in range(0, n, MAX_ROWS):  # the sequences are independent: 8 rows a call
            b1 = min(n, b0 + MAX_ROWS)
            self.stack.step(
                h[b0].data_ptr(),
                cis[b0].data_ptr(),
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
