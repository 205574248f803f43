"""Backend `sparse`: the CPU path for GGUF INT4 models with calibrated activation sparsity.

The paged engine (scheduler, block KV cache, prefix caching, speculative decoding) with the
INT4 projections repacked at load into the native kernels' column-major layout
(`llmlocal.native.cpu`). Every projection input is thresholded with the model's
calibrated per-layer thresholds (`ModelSpec.sparsity`, written by `llmlocal quantize
--sparsity`), and the kernels do not read the weight columns of the zeroed inputs: at 50%
sparsity a decode step reads about half the projection weights.

`--sparsity S` overrides the calibrated level (thresholds interpolated from the calibration
grid); 0 runs every column through the same kernels. Every GGUF quantized type runs in the
QMatrix kernels in its own bytes, one run of bytes per column (so that zeroed inputs skip
theirs); projections the kernels cannot read (float tensors) keep their torch layer and get
the same thresholds, so the output does not depend on which layers skip; they count as fully
read in `Stats.achieved_sparsity`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
from llmlocal.models import ModelSpec, ResolvedModel
from llmlocal.models.errors import LLMLocalError
from llmlocal.models.spec import SPARSITY_PROJECTIONS
from llmlocal.native import cpu
from llmlocal.native.cpu.pack_ahead import PackAhead
from llmlocal.native.cpu.qlayout import QuantRows

from ..core.block_manager import block_key
from ..model.fast_decode import FastDecode, native_quant
from ..model.gguf_parts import activations
from ..model.llama import LlamaModel
from ..model.loader import load_gguf
from ..model.sparse_linear import SparseInt4Projection, SparseProjection, ThresholdedLinear
from ..model.sparsity import projection_modules, projection_of
from ..plan import Plan
from ..prompt.tokenizer import Tokenizer
from ..spec.drafter import Drafter
from ..types import Request
from .paged import PagedBackend
from .paged_stream import Stream


def column_min_level() -> float:
    """The sparsity from which an MLP projection's kernels skip the zeroed inputs' columns
    (the column layout) rather than run the interleaved layout's dense kernels on zeroed
    inputs: where skipping measured faster with this CPU's kernels."""
    return COLUMN_MIN_LEVEL_ZMM if cpu.runtime.qmat_kernel().startswith("avx512vnni") else COLUMN_MIN_LEVEL


# The 1.5B's matrices (all 28 layers', from memory, two threads, batch 1), column layout against
# the interleaved one dense: with the 512-bit column kernels ffn_down 0.78x at 0.2, 1.0x at 0.4,
# 1.2x at 0.6, 1.4x at 0.7 (ffn_up 1.0x at 0.3); the attention's 1536 x 1536 matrices stayed
# slower at every level up to 0.7 (0.55-0.85x), so they keep the interleaved layout. The AVX2
# column kernels reached the interleaved speed only near 0.7.
COLUMN_MIN_LEVEL_ZMM = 0.4
COLUMN_MIN_LEVEL = 0.75
COLUMN_PROJECTIONS = ("ffn_gate_up", "ffn_down")


def column_layout(spec: ModelSpec, override: float | None) -> Callable[[QuantRows], bool]:
    """Which projections a sparse model keeps in the column layout: the MLP's whose level (the
    ``override`` for every projection, else the file's calibrated one) reaches
    `column_min_level`; the others, and the output head, in the interleaved layout (zeroed
    inputs are computed, not skipped: the same output)."""
    cut = column_min_level()

    def columns(rows: QuantRows) -> bool:
        proj = projection_of(rows.name)
        if proj not in COLUMN_PROJECTIONS:
            return False
        level = override if override is not None else spec.sparsity.level_of(proj) if spec.sparsity else 0.0
        return level >= cut

    return columns


class SparseBackend(PagedBackend):
    name = "sparse"
    _stack: FastDecode | None = None
    _root_key: int = 0  # the block manager's root at load; each level's prefix chains start from a key of it

    @classmethod
    def load(cls, model: ResolvedModel, plan: Plan, drafter: Drafter | None = None,
             tokenizer: Future[Tokenizer] | None = None, ahead: PackAhead | None = None) -> SparseBackend:
        spec = model.spec
        if spec.format != "gguf":
            raise LLMLocalError(
                f"The sparse backend runs GGUF INT4 files; {model.name} is a Hugging Face checkpoint: "
                "convert it with `llmlocal quantize MODEL --type q4_0 --sparsity -o OUT.gguf`."
            )
        if plan.device == "cuda":
            raise LLMLocalError("The sparse backend runs on the CPU: drop --device cuda, or use --backend paged.")
        if spec.sparsity is None and plan.sparsity != 0:
            raise LLMLocalError(
                f"{model.name} has no calibrated sparsity thresholds: calibrate it with "
                "`llmlocal quantize MODEL --sparsity -o OUT.gguf`, or pass --sparsity 0 to run it densely "
                "through the sparse kernels."
            )
        cpu.kernels()  # a clear error now if the extension was not built
        threads = plan.threads or cpu.runtime.default_threads()
        cpu.set_num_threads(threads)
        backend = super().load(model, plan.replace(device="cpu", dtype="fp32"), drafter, tokenizer, ahead)
        assert isinstance(backend, SparseBackend)
        backend.model_spec = spec
        backend._stack = FastDecode.attach(backend.runner)
        # decode rows native from here on: a prompt's last rows then run as a prefix-cache hit
        # runs them (the scheduler was built before, with one-row decoding)
        backend.scheduler.tail_alone = backend.runner.prompt_rows_vary
        backend._root_key = backend.blocks.root_key
        level = plan.sparsity
        if level is None:
            assert spec.sparsity is not None  # a file without thresholds was refused above
            level = spec.sparsity.level
        backend.set_sparsity(level)
        return backend

    @classmethod
    def _load_net(cls, model: ResolvedModel, plan: Plan, device: torch.device, dtype: torch.dtype, n_ctx: int,
                  ahead: PackAhead | None = None) -> LlamaModel:
        # (``ahead`` unused: the sparse layout keeps columns apart, which the loader packs itself)
        net = load_gguf(model.spec, device, dtype, "auto", max_position=n_ctx, int4=SparseInt4Projection,
                        quant=native_quant(device, dtype, model.spec, sparse=column_layout(model.spec, plan.sparsity),
                                           mode=activations(model.spec, sparse=True)))
        for layer in net.layers:
            for attr in ("qkv", "o_proj", "gate_up", "down"):
                inner = getattr(layer, attr)
                if not isinstance(inner, SparseInt4Projection):
                    setattr(layer, attr, ThresholdedLinear(inner))
        return net

    # ---- sparsity ------------------------------------------------------------------------
    def projections(self) -> dict[str, list[SparseProjection]]:
        """Projection name -> its module in each layer: every one a sparse projection (_load_net)."""
        out: dict[str, list[SparseProjection]] = {}
        for name, modules in projection_modules(self.runner.model).items():
            out[name] = [m for m in modules if isinstance(m, (SparseInt4Projection, ThresholdedLinear))]
            assert len(out[name]) == len(modules), f"{name}: a projection the sparse backend did not wrap"
        return out

    def set_sparsity(self, level: float) -> None:
        """Use the thresholds of ``level`` (0: dense). Takes effect at the next step."""
        if not 0.0 <= level < 1.0:
            raise LLMLocalError(f"--sparsity must be in [0, 1), got {level}.")
        calibrated = self.model_spec.sparsity
        if calibrated is None:  # only reachable with level 0 (load checks)
            table = {p: (0.0,) * len(self.runner.model.layers) for p in SPARSITY_PROJECTIONS}
        else:
            table = calibrated.at(level)
        with self._lock:
            for proj, modules in self.projections().items():
                for layer, module in enumerate(modules):
                    module.threshold = float(table[proj][layer])
            if self._stack is not None:
                self._stack.set_thresholds(table)
            # the prefix cache's blocks were computed at the old thresholds: new prompts' block
            # chains start from a root of this level, so they never match them (they age out)
            if level != getattr(self, "sparsity", None):
                self.blocks.root_key = block_key(self._root_key, [round(level * 1_000_000)])
            self.sparsity = level

    def counts(self) -> tuple[int, int]:
        """(weight entries skipped, weight entries asked for) by every projection so far."""
        skipped = total = 0
        for modules in self.projections().values():
            for m in modules:
                skipped += m.skipped
                total += m.total
        if self._stack is not None:
            s, t = self._stack.counts()
            skipped, total = skipped + s, total + t
        return skipped, total

    @property
    def sparse_weight_share(self) -> float:
        """Share of the projection weights the kernels hold (the rest cannot skip)."""
        held = total = 0
        for modules in self.projections().values():
            for m in modules:
                n = m.in_features * m.out_features
                total += n
                held += n if isinstance(m, SparseInt4Projection) else 0
        return held / total if total else 0.0

    # ---- stats ---------------------------------------------------------------------------
    def _new_stream(self, request: Request, cancel: threading.Event, events: queue.SimpleQueue, index: int) -> Stream:
        stream = super()._new_stream(request, cancel, events, index)
        stream.start_mark = self.counts()
        return stream

    def _extra_stats(self, stream: Stream) -> dict[str, object]:
        # Counted over every step while the request ran: exact for one request at a time,
        # the batch's mix when several run together.
        if stream.start_mark is None:
            return {}
        s0, t0 = stream.start_mark
        s1, t1 = self.counts()
        return {"achieved_sparsity": (s1 - s0) / (t1 - t0)} if t1 > t0 else {}
