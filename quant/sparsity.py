"""Activation-sparsity calibration: per-layer, per-projection magnitude thresholds (TEAL).

For a requested level S, the threshold of a projection input is the S-quantile of |x| over
the calibration text, so that zeroing the inputs with |x| <= t removes a fraction S of them
(and with them, the weight columns a sparse kernel would read):

    t[proj][layer] = quantile_S( |x_j| over tokens and features j of that input )

The model is the quantized GGUF itself, run densely in llmlocal's torch model, so the
thresholds see the activations the sparse engine will see. Quantiles come from a histogram of
log2|x| per input (64 bins per octave, so a threshold is within 1.1% of the exact quantile),
which keeps memory at a few MB whatever the amount of text. Besides the requested level, a
grid of levels (0.05 ... 0.95) is stored, from which a run-time `--sparsity` override
interpolates (`SparsitySpec.at`).

The file is then rewritten with `llmlocal.sparsity.*` keys added and every tensor copied
byte for byte: llama.cpp ignores the keys and runs it densely.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np
from gguf import GGUFValueType
from llmlocal.models import read_gguf_header, spec_from_gguf
from llmlocal.models.errors import LLMLocalError
from llmlocal.models.spec import (
    DEFAULT_SPARSITY,
    DEFAULT_SPARSITY_PROFILE,
    DEFAULT_SPARSITY_REQUEST,
    SPARSITY_PREFIX,
    SPARSITY_PROJECTIONS,
    ModelSpec,
    SparsitySpec,
)

from .convert import write_gguf_file
from .evaluate import BUILTIN_TEXT, _windows, builtin_eval_text
from .gguf_writer import KV
from .progress import Progress
from .source import ModelSource

if TYPE_CHECKING:
    import torch
    from llmlocal.engine.core.model_runner import ModelRunner
    from llmlocal.engine.model.llama import LlamaModel
    from llmlocal.engine.prompt.tokenizer import LlamaCppTokenizer

SPARSE_FORMATS = ("q4_0", "q4_1", "q4_k_m", "q4_k_s")  # --type values the sparse engine can read
# source weight types calibrated as they are: every type the native kernels read in its own bytes
INT4_STORAGE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BUILTIN_CALIBRATION_TEXT = "built-in, calibration half"
GRID_LEVELS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 ... 0.95
_GRID_MAX_VALUES = 4096  # longer arrays are not kept by the header reader: drop the grid then
_LOG2_LO, _BINS_PER_OCTAVE, _N_BINS = -40.0, 64, 64 * 64  # bins cover |x| in [2^-40, 2^24)
_SEGMENTS = 8  # the built-in text is dealt into this many runs of paragraphs, alternately


def check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise LLMLocalError(f"--sparsity must be a fraction between 0 and 1 (such as 0.5), got {level}.")


# What `--sparsity` asks for: one level for every projection input, or a profile (a level per
# projection input, the ones not named dense), such as {"ffn_down": 0.6}.
SparsityRequest = Union[float, Mapping[str, float]]


def parse_sparsity(text: str) -> SparsityRequest:
    """'0.3' (every projection input), or 'ffn_down=0.6[,attn_output=0.3]' (a profile)."""
    if "=" not in text:
        try:
            return float(text)
        except ValueError:
            raise LLMLocalError(
                f"--sparsity takes a fraction (such as 0.3) or projection levels (such as ffn_down=0.6), not {text!r}."
            ) from None
    levels: dict[str, float] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in SPARSITY_PROJECTIONS:
            raise LLMLocalError(f"--sparsity: unknown projection {name!r}; choose from {', '.join(SPARSITY_PROJECTIONS)}.")
        try:
            levels[name] = float(value)
        except ValueError:
            raise LLMLocalError(f"--sparsity: {name} needs a fraction (such as {name}=0.5), not {value!r}.") from None
    return levels


def check_sparsity(request: SparsityRequest) -> None:
    """A clear error for a level outside (0, 1), or a profile whose levels are all 0."""
    if not isinstance(request, Mapping):
        check_level(request)
        return
    for name, level in request.items():
        if name not in SPARSITY_PROJECTIONS:
            raise LLMLocalError(f"--sparsity: unknown projection {name!r}; choose from {', '.join(SPARSITY_PROJECTIONS)}.")
        if not 0.0 <= level < 1.0:
            raise LLMLocalError(f"--sparsity: {name} must be a fraction between 0 and 1, got {level}.")
    if not any(v > 0 for v in request.values()):
        raise LLMLocalError("--sparsity: give at least one projection a level above 0 (such as ffn_down=0.6).")


DEFAULT_REQUEST = DEFAULT_SPARSITY_REQUEST  # `--sparsity` with no value: `default_sparsity` of the file


def default_sparsity(spec: ModelSpec) -> SparsityRequest:
    """What `--sparsity` with no value calibrates for the GGUF ``spec`` (see DEFAULT_SPARSITY)."""
    from llmlocal.engine.planning.native_support import four_bit_only

    return DEFAULT_SPARSITY if four_bit_only(spec) else dict(DEFAULT_SPARSITY_PROFILE)




# ---- text -----------------------------------------------------------------------------------
def read_calibration_text(path: str | os.PathLike[str] | None) -> str | None:
    """The --calib file's text (None when there is no file: the built-in half is used)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LLMLocalError(f"The calibration text {path} does not exist: check the --calib path.") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise LLMLocalError(f"The calibration text {path} is not UTF-8 text: pass a plain-text file to --calib.") from None
    if len(text.split()) < 100:
        raise LLMLocalError(f"The calibration text {path} has fewer than 100 words: give it a few pages of text.")
    return text


def split_builtin_text() -> tuple[str, str]:
    """(calibration, held-out) halves of the built-in text that share no paragraph.

    The paragraphs are cut into `_SEGMENTS` runs of about equal length, dealt alternately, so
    both halves hold prose, dialogue and code (the text's parts come in that order)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", builtin_eval_text()) if p.strip()]
    total = sum(len(p) for p in paragraphs)
    halves: tuple[list[str], list[str]] = ([], [])
    done = 0
    for p in paragraphs:
        segment = min(done * _SEGMENTS // total, _SEGMENTS - 1)
        halves[segment % 2].append(p)
        done += len(p)
    return "\n\n".join(halves[0]) + "\n", "\n\n".join(halves[1]) + "\n"


# ---- the model ------------------------------------------------------------------------------
@dataclass
class TorchModel:
    """A GGUF in llmlocal's torch model (dense forward), with its llama.cpp tokenizer."""

    spec: ModelSpec
    model: LlamaModel
    runner: ModelRunner
    tokenizer: LlamaCppTokenizer

    def windows(self, text: str, ctx: int, max_tokens: int | None = None) -> list[list[int]]:
        """The text as non-overlapping teacher-forcing windows of at most ``ctx`` tokens."""
        ids = self.tokenizer.encode(text, add_special=False)[:max_tokens]
        bos = self.spec.special.bos_id if self.spec.special.add_bos else None
        windows = _windows(ids, bos, ctx)
        if not windows:
            raise LLMLocalError("The calibration or evaluation text is shorter than two tokens: give a few paragraphs.")
        return windows

    def logits(self, window: list[int]) -> torch.Tensor:
        """(len, vocab) float32 logits along ``window``."""
        from llmlocal.engine.model.sparsity import teacher_forced_logits

        return teacher_forced_logits(self.runner, window)

    def run(self, window: list[int]) -> None:
        """The layers along ``window`` (for their hooks), without the output projection."""
        from llmlocal.engine.model.sparsity import teacher_forced_logits

        teacher_forced_logits(self.runner, window, logits=False)


@contextlib.contextmanager
def torch_model(path: str | os.PathLike[str], ctx: int, threads: int | None = None) -> Iterator[TorchModel]:
    """Load ``path`` (a llama-family GGUF; INT4 weights stay exact INT4) on the CPU in fp32."""
    import torch
    from llmlocal.engine.model.loader import load_gguf
    from llmlocal.engine.model.sparsity import reference_runner
    from llmlocal.engine.prompt.tokenizer import LlamaCppTokenizer

    spec = spec_from_gguf(path)
    if threads:
        torch.set_num_threads(threads)
    model = load_gguf(spec, torch.device("cpu"), torch.float32, "auto", max_position=max(ctx, 16))
    tokenizer = LlamaCppTokenizer(os.fspath(path))
    try:
        yield TorchModel(spec, model, reference_runner(model), tokenizer)
    finally:
        tokenizer.close()


# ---- calibration ----------------------------------------------------------------------------
class MagnitudeHistogram:
    """Counts of log2|x| per (projection, layer) input, in `_N_BINS` bins of 1/64 octave.

    Bin b holds |x| in [2^(LO + b/64), 2^(LO + (b+1)/64)); bin 0 also holds everything smaller
    (zeros included), the last bin everything larger."""

    def __init__(self, n_layers: int) -> None:
        import torch

        self.counts = torch.zeros((len(SPARSITY_PROJECTIONS), n_layers, _N_BINS), dtype=torch.int64)

    def add(self, proj: str, layer: int, x: torch.Tensor) -> None:
        import torch

        e = torch.log2(x.detach().float().abs().flatten())  # -inf for zeros
        idx = ((e - _LOG2_LO) * _BINS_PER_OCTAVE).floor().clamp(0, _N_BINS - 1).long()
        self.counts[SPARSITY_PROJECTIONS.index(proj), layer] += torch.bincount(idx, minlength=_N_BINS)

    def quantile(self, proj: str, layer: int, q: float) -> float:
        """The |x| below which a fraction ``q`` of the counted values lie (interpolated
        geometrically within the bin that holds it)."""
        counts = self.counts[SPARSITY_PROJECTIONS.index(proj), layer].numpy()
        cum = np.cumsum(counts)
        target = q * cum[-1]
        b = int(np.searchsorted(cum, target))  # first bin whose cumulative count reaches target
        before = cum[b - 1] if b else 0
        frac = (target - before) / counts[b] if counts[b] else 0.0
        return float(2.0 ** (_LOG2_LO + (b + frac) / _BINS_PER_OCTAVE))


def calibrate(
    model: TorchModel,
    text: str,
    level: SparsityRequest,
    *,
    ctx: int = 512,
    max_tokens: int | None = None,
    text_name: str = BUILTIN_TEXT,
    progress: Progress | None = None,
) -> SparsitySpec:
    """Thresholds that zero a fraction ``level`` of each projection input on ``text`` (or,
    for a profile, each named input's own fraction, the others none), and the grid of other
    levels. Values are float32-rounded, as the GGUF stores them."""
    import torch
    from llmlocal.engine.model.sparsity import ProjectionHooks

    check_sparsity(level)
    n_layers = model.spec.n_layers
    hist = MagnitudeHistogram(n_layers)
    windows = model.windows(text, ctx, max_tokens)
    if progress is not None:
        progress.total, progress.items, progress.item_noun = sum(len(w) for w in windows), len(windows), "windows"

    def record(proj: str, layer: int, x: torch.Tensor) -> None:
        hist.add(proj, layer, x)

    with ProjectionHooks(model.model, record), torch.inference_mode():
        for window in windows:
            model.run(window)
            if progress is not None:
                progress.advance(len(window), items=1)

    def f32(v: float) -> float:
        return float(np.float32(v))

    def row(q: float) -> dict[str, tuple[float, ...]]:
        return {p: tuple(f32(hist.quantile(p, i, q)) for i in range(n_layers)) for p in SPARSITY_PROJECTIONS}

    grid_levels = tuple(f32(x) for x in GRID_LEVELS) if len(GRID_LEVELS) * n_layers <= _GRID_MAX_VALUES else ()
    rows = [row(q) for q in grid_levels]
    levels: dict[str, float] = {}
    if isinstance(level, Mapping):
        levels = {p: f32(level.get(p, 0.0)) for p in SPARSITY_PROJECTIONS}
        thresholds = {p: row(q)[p] if q > 0 else (0.0,) * n_layers for p, q in levels.items()}
    else:
        thresholds = row(level)
    return SparsitySpec(
        level=max(levels.values()) if levels else f32(level),
        thresholds=thresholds,
        levels=levels,
        calibration_tokens=sum(len(w) for w in windows),
        calibration_text=text_name,
        grid_levels=grid_levels,
        grid={p: tuple(r[p] for r in rows) for p in SPARSITY_PROJECTIONS} if rows else {},
    )


# ---- writing --------------------------------------------------------------------------------
def sparsity_metadata(sparsity: SparsitySpec) -> list[KV]:
    """The `llmlocal.sparsity.*` keys for ``sparsity`` (layout in `llmlocal.models.spec`)."""
    f32 = GGUFValueType.FLOAT32
    keys = [
        KV.f32(SPARSITY_PREFIX + "level", sparsity.level),
        KV.u32(SPARSITY_PREFIX + "calibration_tokens", sparsity.calibration_tokens),
        KV.string(SPARSITY_PREFIX + "calibration_text", sparsity.calibration_text),
    ]
    keys += [KV.array(f"{SPARSITY_PREFIX}thresholds.{p}", list(sparsity.thresholds[p]), f32) for p in SPARSITY_PROJECTIONS]
    if sparsity.levels:
        keys.append(KV.array(SPARSITY_PREFIX + "projection_levels", [sparsity.levels[p] for p in SPARSITY_PROJECTIONS], f32))
    if sparsity.grid_levels:
        keys.append(KV.array(SPARSITY_PREFIX + "grid.levels", list(sparsity.grid_levels), f32))
        keys += [
            KV.array(f"{SPARSITY_PREFIX}grid.{p}", [t for level in sparsity.grid[p] for t in level], f32)
            for p in SPARSITY_PROJECTIONS
        ]
    return keys


_KEPT_HEADER_KEYS = ("general.file_type", "general.quantization_version")  # open_gguf drops them


def write_with_sparsity(
    source: ModelSource, dst: str | os.PathLike[str], sparsity: SparsitySpec,
    *, workers: int = 2, progress: Progress | None = None,
) -> None:
    """Copy the GGUF ``source`` (from `open_gguf`) to ``dst`` — tensors byte for byte,
    metadata key for key — with the sparsity keys added, replacing any it had. ``dst`` is
    written in place: the caller gives a temporary name and renames it."""
    assert source.gguf_path is not None, "only a GGUF is copied with its tensors unchanged"
    header = read_gguf_header(source.gguf_path)
    metadata = [kv for kv in source.metadata if not kv.key.startswith(SPARSITY_PREFIX)]
    metadata += [KV.u32(k, header.metadata[k]) for k in _KEPT_HEADER_KEYS if k in header.metadata]
    metadata += sparsity_metadata(sparsity)
    write_gguf_file(dst, metadata, [(t, t.ggml_type) for t in source.tensors], workers=workers, progress=progress)
