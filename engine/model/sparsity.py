"""Activation sparsity on the torch model: the reference of the sparse forward.

TEAL-style magnitude thresholding. Each decoder layer has four distinct projection inputs,
and each gets its own threshold t (per layer, per projection):

    attn_qkv     rms_norm(h)               -> the fused q/k/v projection   (N, d)
    attn_output  attention output          -> o_proj                       (N, H * D)
    ffn_gate_up  rms_norm(h) after attention -> the fused gate/up projection (N, d)
    ffn_down     silu(gate) * up           -> down                         (N, d_ffn)

    x'_j = x_j  if |x_j| > t,  else 0

A zeroed x_j means column j of the projection's weight is never needed, which is what the
native kernels skip. Here the thresholds are applied by forward pre-hooks on the projection
modules, so `LlamaModel` and the paged engine run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from llmlocal.models.spec import SPARSITY_PROJECTIONS

from ..core.model_runner import ModelRunner, StepItem
from ..core.sequence import Sequence as TokenSequence
from .llama import LlamaModel

if TYPE_CHECKING:
    from typing_extensions import Self

# fn(projection, layer, x) -> the input to use instead, or None to leave x as it is
InputHook = Callable[[str, int, torch.Tensor], "torch.Tensor | None"]


def projection_modules(model: LlamaModel) -> dict[str, list[nn.Module]]:
    """Projection name -> its module in each layer (layer order)."""
    return {
        "attn_qkv": [layer.qkv for layer in model.layers],
        "attn_output": [layer.o_proj for layer in model.layers],
        "ffn_gate_up": [layer.gate_up for layer in model.layers],
        "ffn_down": [layer.down for layer in model.layers],
    }


_TENSOR_PROJECTIONS = {
    "attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "attn_output": "attn_output",
    "ffn_gate": "ffn_gate_up", "ffn_up": "ffn_gate_up", "ffn_down": "ffn_down",
}


def projection_of(tensor: str) -> str | None:
    """The projection input a GGUF tensor reads ('blk.3.ffn_up.weight' -> 'ffn_gate_up'), or
    None (embeddings, the output head, norms)."""
    parts = tensor.split(".")
    return _TENSOR_PROJECTIONS.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None


def threshold_activations(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """x with every entry of magnitude <= ``threshold`` set to zero (the kernels' contract)."""
    return torch.where(x.abs() > threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))


class ProjectionHooks:
    """Calls ``fn`` on the input of every projection of ``model`` until `remove` (or the end
    of a ``with`` block)."""

    def __init__(self, model: LlamaModel, fn: InputHook) -> None:
        self._handles = []
        for proj, modules in projection_modules(model).items():
            for layer, module in enumerate(modules):
                self._handles.append(module.register_forward_pre_hook(self._hook(fn, proj, layer)))

    @staticmethod
    def _hook(fn: InputHook, proj: str, layer: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], tuple | None]:
        def pre_hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple | None:
            out = fn(proj, layer, args[0])
            return None if out is None else (out, *args[1:])

        return pre_hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@dataclass
class SparsityCounter:
    """Zeroed and total inputs per projection, and the weight columns that they spare.

    ``weights`` fraction: sum over calls of zeroed inputs x output features, over inputs x
    output features — the share of weight reads a column-skipping kernel avoids.
    """

    zeroed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPARSITY_PROJECTIONS, 0))
    total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPARSITY_PROJECTIONS, 0))
    zeroed_weights: int = 0
    total_weights: int = 0

    def add(self, proj: str, zeroed: int, total: int, out_features: int) -> None:
        self.zeroed[proj] += zeroed
        self.total[proj] += total
        self.zeroed_weights += zeroed * out_features
        self.total_weights += total * out_features

    def by_projection(self) -> dict[str, float]:
        return {p: self.zeroed[p] / self.total[p] if self.total[p] else 0.0 for p in SPARSITY_PROJECTIONS}

    @property
    def inputs(self) -> float:
        """Fraction of all projection inputs that were zeroed."""
        total = sum(self.total.values())
        return sum(self.zeroed.values()) / total if total else 0.0

    @property
    def weights(self) -> float:
        """Fraction of projection weight columns skipped (what decode speed follows)."""
        return self.zeroed_weights / self.total_weights if self.total_weights else 0.0


def apply_thresholds(
    model: LlamaModel, thresholds: Mapping[str, Sequence[float]], counter: SparsityCounter | None = None
) -> ProjectionHooks:
    """Zero the small inputs of every projection; ``thresholds[proj][layer]`` is t for that
    input. Returns the hooks: remove them (or use ``with``) to get the dense model back."""
    n_layers = len(model.layers)
    for proj in SPARSITY_PROJECTIONS:
        if len(thresholds[proj]) != n_layers:
            raise ValueError(f"{proj}: {len(thresholds[proj])} thresholds for {n_layers} layers")
    table = {p: [float(t) for t in thresholds[p]] for p in SPARSITY_PROJECTIONS}
    out_features = {p: [int(m.out_features) for m in ms] for p, ms in projection_modules(model).items()}

    def fn(proj: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        y = threshold_activations(x, table[proj][layer])
        if counter is not None:
            kept = int(torch.count_nonzero(y))
            counter.add(proj, x.numel() - kept, x.numel(), out_features[proj][layer])
        return y

    return ProjectionHooks(model, fn)


def teacher_forced_logits(runner: ModelRunner, token_ids: list[int], *, logits: bool = True) -> torch.Tensor:
    """(len, vocab) float32 logits at every position of ``token_ids``, in one prefill over a
    private KV cache (the runner's shared pool is not touched). With ``logits=False`` the
    layers run (and their hooks fire) but the output projection is skipped: (0, vocab)."""
    seq = TokenSequence(-1, list(token_ids))
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    cache = runner.scratch_cache(len(token_ids))
    item = StepItem(seq, 0, len(token_ids), sample=logits)
    out, _ = runner.execute([item], all_rows=logits, kv_caches=cache)
    return out


def reference_runner(model: LlamaModel) -> ModelRunner:
    """A runner for `teacher_forced_logits` (its own pool is one block: scoring uses scratch caches)."""
    return ModelRunner(model, num_blocks=1, block_size=16, kv_dtype=model.dtype)
