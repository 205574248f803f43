"""`ModelSpec`: what llmlocal knows about a model before loading a single weight."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelFormatError
from .gguf_header import ArrayInfo, TensorInfo, read_gguf_header
from .shape import ModelShape

# Activation-sparsity calibration written by `llmlocal quantize --sparsity` (llama.cpp ignores
# these keys). Each projection input of a layer has a threshold t; inputs with |x| <= t are
# zeroed (see llmlocal.engine.model.sparsity):
#   llmlocal.sparsity.level                 f32   fraction of inputs the thresholds zero (with
#                                                 projection_levels: the largest of them)
#   llmlocal.sparsity.projection_levels     f32[4] a profile: each projection input's own level,
#                                                 in SPARSITY_PROJECTIONS order (absent: `level`)
#   llmlocal.sparsity.thresholds.<proj>     f32[n_layers]
#   llmlocal.sparsity.calibration_tokens    u32   tokens of calibration text
#   llmlocal.sparsity.calibration_text      str   "built-in" or the file's name
#   llmlocal.sparsity.grid.levels           f32[G]   other levels, for run-time overrides
#   llmlocal.sparsity.grid.<proj>           f32[G * n_layers], level-major
SPARSITY_PREFIX = "llmlocal.sparsity."
# `quantize --sparsity` with no value, by the kernels the file's projections run in (measured
# with `llmlocal.quant.sparsity_quality`, docs/quantize.md): a file of 4-bit types only (the starter,
# fp32 activations, every projection able to skip) every input at the highest level within 5%
# perplexity on the starter; a K-quant mix (int8 activations) the MLP's down projection alone,
# within 5% on Qwen2.5-Coder 1.5B (+2.5%) and 0.5B (+0.3%) and the level where skipping its
# columns decodes faster than the dense kernels.
DEFAULT_SPARSITY = 0.3
DEFAULT_SPARSITY_PROFILE = {"ffn_down": 0.6}
DEFAULT_SPARSITY_REQUEST = "default"  # what `--sparsity` with no value asks for: one of the two
SPARSITY_PROJECTIONS = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    bos: str | None = None
    eos: str | None = None
    add_bos: bool = False
    add_eos: bool = False


def describe_levels(levels: float | Mapping[str, float]) -> str:
    """A sparsity level ('30%') or a profile's nonzero levels ('ffn_down 60%, attn_output 30%')."""
    if not isinstance(levels, Mapping):
        return f"{levels:.0%}"
    return ", ".join(f"{p} {v:.0%}" for p, v in levels.items() if v > 0) or "0%"


@dataclass(frozen=True)
class SparsitySpec:
    """A model's calibrated activation-sparsity thresholds (`ModelSpec.sparsity`).

    Uniform (every projection input at `level`), or a profile (`levels`: each projection's
    own level, e.g. only the MLP's down projection, which loses the least quality per weight
    skipped; `level` is then the largest)."""

    level: float
    thresholds: dict[str, tuple[float, ...]]  # projection -> threshold per layer
    calibration_tokens: int
    calibration_text: str = ""
    grid_levels: tuple[float, ...] = ()  # ascending
    grid: dict[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict)  # proj -> [level][layer]
    levels: dict[str, float] = field(default_factory=dict)  # a profile's levels (every projection), or empty

    def level_of(self, proj: str) -> float:
        """The calibrated level of projection input ``proj``."""
        return self.levels[proj] if self.levels else self.level

    def describe(self) -> str:
        """'30%', or a profile's nonzero levels ('ffn_down 60%, attn_output 30%')."""
        return describe_levels(self.levels or self.level)

    def at(self, level: float) -> dict[str, tuple[float, ...]]:
        """Thresholds for ``level``: the calibrated ones at the calibrated level (a profile's
        own), zeros (dense) at 0, else every projection at ``level``, interpolated linearly
        between the two nearest known levels (the grid plus a uniform file's calibrated level;
        clamped at the grid's top)."""
        n_layers = len(self.thresholds[SPARSITY_PROJECTIONS[0]])
        if self.levels and abs(level - self.level) < 1e-6:
            return dict(self.thresholds)
        known: dict[float, dict[str, tuple[float, ...]]] = {0.0: {p: (0.0,) * n_layers for p in SPARSITY_PROJECTIONS}}
        for i, x in enumerate(self.grid_levels):
            known[x] = {p: self.grid[p][i] for p in SPARSITY_PROJECTIONS}
        if not self.levels:
            known[self.level] = dict(self.thresholds)  # exact where it was asked for
        levels = sorted(known)
        level = min(max(level, 0.0), levels[-1])
        hi = next(x for x in levels if x >= level - 1e-6)
        if hi - level < 1e-6:
            return dict(known[hi])
        lo = max(x for x in levels if x < level)
        w = (level - lo) / (hi - lo)
        return {
            p: tuple((1 - w) * a + w * b for a, b in zip(known[lo][p], known[hi][p])) for p in SPARSITY_PROJECTIONS
        }


@dataclass(frozen=True)
class ModelSpec(ModelShape):
    """Architecture, shapes (`ModelShape`), tensor directory and tokenizer facts of one model file."""

    path: str
    format: str  # "gguf"
    name: str
    architecture: str
    context_length: int
    rope_freq_base: float | None
    norm_eps: float | None
    file_type: str | None
    tensors: tuple[TensorInfo, ...]
    chat_template: str | None
    special: SpecialTokens
    tokenizer_model: str | None
    tokens: tuple[str, ...] = field(repr=False, default=())
    metadata: dict[str, Any] = field(repr=False, default_factory=dict)
    sparsity: SparsitySpec | None = None  # activation thresholds, when calibrated

    @property
    def weight_bytes(self) -> int:
        """Bytes of all tensors as stored in the file."""
        return sum(t.n_bytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def tensor_types(self) -> dict[str, int]:
        """Tensor type name -> bytes stored in that type."""
        counts: Counter[str] = Counter()
        for t in self.tensors:
            counts[t.type_name] += t.n_bytes
        return dict(counts)

    @property
    def vocab_fingerprint(self) -> str:
        """A hash of the token strings: two models with equal fingerprints share a tokenizer."""
        h = hashlib.sha256()
        for tok in self.tokens:
            h.update(tok.encode("utf-8", errors="replace"))
            h.update(b"\0")
        return h.hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly description (what `models info` prints)."""
        return {
            "path": self.path,
            "name": self.name,
            "architecture": self.architecture,
            "layers": self.n_layers,
            "d_model": self.d_model,
            "heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "d_ffn": self.d_ffn,
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "file_type": self.file_type,
            "params": self.n_params,
            "weight_bytes": self.weight_bytes,
            "tensor_types": self.tensor_types,
            "has_chat_template": self.chat_template is not None,
            "bos": self.special.bos,
            "eos": self.special.eos,
            "sparsity": self.sparsity.level if self.sparsity is not None else None,
        }


def _first_int(value: Any) -> int | None:
    """Per-layer arrays (some architectures vary head counts by layer) -> their maximum."""
    if value is None:
        return None
    if isinstance(value, list):
        return max(int(v) for v in value) if value else None
    return int(value)


def _file_type_name(value: Any) -> str | None:
    if value is None:
        return None
    try:
        from gguf.constants import LlamaFileType

        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (ValueError, ImportError):
        return str(value)


def spec_from_gguf(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a `ModelSpec` from a GGUF header (no tensor data is read)."""
    path = os.fspath(path)
    header = read_gguf_header(path)
    md = header.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path} has no 'general.architecture' in its header: it is not a model GGUF.")

    def key(suffix: str) -> Any:
        return md.get(f"{arch}.{suffix}")

    n_layers = _first_int(key("block_count"))
    d_model = _first_int(key("embedding_length"))
    n_heads = _first_int(key("attention.head_count"))
    if not n_layers or not d_model or not n_heads:
        raise ModelFormatError(
            f"{path} lacks the '{arch}' shape keys (block_count, embedding_length, "
            "attention.head_count): it is not a language-model GGUF llmlocal can run."
        )
    n_kv_heads = _first_int(key("attention.head_count_kv")) or n_heads
    head_dim = _first_int(key("attention.key_length")) or d_model // n_heads

    tokens_value = md.get("tokenizer.ggml.tokens")
    tokens: tuple[str, ...] = tuple(tokens_value) if isinstance(tokens_value, list) else ()
    if tokens:
        vocab_size = len(tokens)
    elif isinstance(tokens_value, ArrayInfo):
        vocab_size = tokens_value.length
    else:
        vocab_size = _first_int(key("vocab_size")) or 0

    def token_id(name: str) -> int | None:
        v = md.get(f"tokenizer.ggml.{name}_token_id")
        return int(v) if v is not None else None

    def token_text(tid: int | None) -> str | None:
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    bos_id, eos_id = token_id("bos"), token_id("eos")
    special = SpecialTokens(
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=token_id("padding"),
        unk_id=token_id("unknown"),
        bos=token_text(bos_id),
        eos=token_text(eos_id),
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
    )
    rope = key("rope.freq_base")
    eps = key("attention.layer_norm_rms_epsilon") or key("attention.layer_norm_epsilon")
    scalars = {k: v for k, v in md.items() if not isinstance(v, (ArrayInfo, list)) or k.startswith("llmlocal.")}
    return ModelSpec(
        path=path,
        format="gguf",
        name=str(md.get("general.name") or os.path.splitext(os.path.basename(path))[0]),
        architecture=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ffn=_first_int(key("feed_forward_length")) or 0,
        vocab_size=vocab_size,
        context_length=_first_int(key("context_length")) or 2048,
        rope_freq_base=float(rope) if rope is not None else None,
        norm_eps=float(eps) if eps is not None else None,
        file_type=_file_type_name(md.get("general.file_type")),
        tensors=header.tensors,
        chat_template=md.get("tokenizer.chat_template") if isinstance(md.get("tokenizer.chat_template"), str) else None,
        special=special,
        tokenizer_model=md.get("tokenizer.ggml.model"),
        tokens=tokens,
        metadata=scalars,
        sparsity=_sparsity_from_metadata(md, n_layers, path),
    )


def _sparsity_from_metadata(md: dict[str, Any], n_layers: int, path: str) -> SparsitySpec | None:
    """The `llmlocal.sparsity.*` keys as a `SparsitySpec`; None when the file has none."""
    if SPARSITY_PREFIX + "level" not in md:
        return None
    bad = ModelFormatError(
        f"{path} has incomplete or malformed {SPARSITY_PREFIX}* keys: calibrate it again with "
        "`llmlocal quantize MODEL --sparsity S -o OUT`."
    )
    level = md[SPARSITY_PREFIX + "level"]
    thresholds = {p: md.get(f"{SPARSITY_PREFIX}thresholds.{p}") for p in SPARSITY_PROJECTIONS}
    if not isinstance(level, float) or not 0.0 < level < 1.0:
        raise bad
    if any(not isinstance(t, list) or len(t) != n_layers for t in thresholds.values()):
        raise bad
    levels = md.get(SPARSITY_PREFIX + "projection_levels")
    if levels is not None and (
        not isinstance(levels, list) or len(levels) != len(SPARSITY_PROJECTIONS)
        or not all(isinstance(v, float) and 0.0 <= v < 1.0 for v in levels)
    ):
        raise bad
    grid_levels = md.get(SPARSITY_PREFIX + "grid.levels")
    grid: dict[str, tuple[tuple[float, ...], ...]] = {}
    if isinstance(grid_levels, list) and grid_levels:
        g = len(grid_levels)
        for p in SPARSITY_PROJECTIONS:
            flat = md.get(f"{SPARSITY_PREFIX}grid.{p}")
            if not isinstance(flat, list) or len(flat) != g * n_layers:
                raise bad
            grid[p] = tuple(tuple(flat[i * n_layers : (i + 1) * n_layers]) for i in range(g))
    else:
        grid_levels = []
    return SparsitySpec(
        level=float(level),
        thresholds={p: tuple(float(v) for v in t) for p, t in thresholds.items()},  # type: ignore[union-attr]
        calibration_tokens=int(md.get(SPARSITY_PREFIX + "calibration_tokens", 0) or 0),
        calibration_text=str(md.get(SPARSITY_PREFIX + "calibration_text", "")),
        grid_levels=tuple(float(x) for x in grid_levels),
        grid=grid,
        levels=dict(zip(SPARSITY_PROJECTIONS, (float(v) for v in levels))) if levels else {},
    )
