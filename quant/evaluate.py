"""Quality of a quantized model against its source, measured in the same engine on the same text.

Both GGUF files are loaded through the `Engine` API (llamacpp backend) and fed the same token
windows, teacher-forced. From each window's (len - 1, vocab) log-distributions:

    perplexity      exp(mean over positions of -log p(next token))      (each model)
    KL divergence   mean over positions of sum_v P(v) (log P(v) - log Q(v)),  P = source, Q = output
    top-1 agreement fraction of positions where argmax P == argmax Q

KL is in nats per token. The text is cut into non-overlapping windows of ``ctx`` tokens (a
BOS first when the model wants one), so memory is bounded by two windows of log-probs.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from llmlocal.models.errors import LLMLocalError

from .progress import Progress

BUILTIN_TEXT = "built-in"
_ROWS = 64  # positions per block of the KL computation: (64, vocab) float64 temporaries


def builtin_eval_text() -> str:
    """The evaluation text shipped with llmlocal: original prose, dialogue and code."""
    return resources.files("llmlocal.quant").joinpath("eval_text.txt").read_text(encoding="utf-8")


def read_eval_text(path: str | os.PathLike[str]) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LLMLocalError(f"The evaluation text {path} does not exist: check the --eval path.") from None
    except UnicodeDecodeError:
        raise LLMLocalError(f"The evaluation text {path} is not UTF-8 text: pass a plain-text file to --eval.") from None
    if len(text.split()) < 20:
        raise LLMLocalError(f"The evaluation text {path} has fewer than 20 words: give at least a few paragraphs.")
    return text


@dataclass(frozen=True)
class QualityReport:
    type: str  # the output's format, "Q4_K_M"
    source_type: str  # the reference's weight type, "BF16"
    source: str
    output: str
    source_ppl: float
    output_ppl: float
    kld: float  # mean KL(source || output), nats per token
    kld_p99: float
    top1_agreement: float  # fraction in [0, 1]
    eval_tokens: int  # positions scored
    windows: int
    ctx: int
    eval_text: str  # a path, or "built-in"
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the report as JSON (to a temporary name first, like every file we write)."""
        write_json(path, self.to_dict())

    def table(self) -> str:
        delta = (self.output_ppl / self.source_ppl - 1) * 100
        text = "the built-in text" if self.eval_text == BUILTIN_TEXT else os.path.basename(self.eval_text)
        src_label = f"perplexity, source ({self.source_type})"
        out_label = f"perplexity, output ({self.type})"
        w = max(len(src_label), len(out_label), len("mean KL divergence"))
        return "\n".join([
            f"Quality of {self.type} against the {self.source_type} source "
            f"({self.eval_tokens:,} tokens of {text}, windows of {self.ctx}):",
            f"  {src_label:<{w}}  {self.source_ppl:10.4f}",
            f"  {out_label:<{w}}  {self.output_ppl:10.4f}  ({delta:+.2f}%)",
            f"  {'mean KL divergence':<{w}}  {self.kld:10.5f}  nats/token (p99 {self.kld_p99:.4f})",
            f"  {'top-1 agreement':<{w}}  {self.top1_agreement * 100:9.2f}%",
        ])


def _windows(ids: list[int], bos: int | None, ctx: int) -> list[list[int]]:
    body = ctx - (1 if bos is not None else 0)
    windows = []
    for start in range(0, len(ids), body):
        chunk = ids[start : start + body]
        if len(chunk) >= 2 or (bos is not None and chunk):
            windows.append(([bos] if bos is not None else []) + chunk)
    return windows


def compare_log_probs(ref: np.ndarray, out: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per position: -log P(target), -log Q(target), KL(P || Q), argmax agreement.

    ``ref`` and ``out`` are (positions, vocab) log-distributions; ``targets`` (positions,).
    """
    rows = np.arange(len(targets))
    nll_ref = -ref[rows, targets].astype(np.float64)
    nll_out = -out[rows, targets].astype(np.float64)
    kl = np.empty(len(targets))
    for r in range(0, len(targets), _ROWS):
        a = ref[r : r + _ROWS].astype(np.float64)  # (rows, vocab)
        b = out[r : r + _ROWS].astype(np.float64)
        p = np.exp(a)
        kl[r : r + _ROWS] = np.where(p > 0, p * (a - b), 0.0).sum(axis=1)
    agree = ref.argmax(axis=1) == out.argmax(axis=1)
    return nll_ref, nll_out, np.maximum(kl, 0.0), agree


def evaluate_quality(
    reference: str | os.PathLike[str],
    output: str | os.PathLike[str],
    text: str,
    *,
    type_name: str,
    source_type: str,
    ctx: int = 512,
    max_tokens: int | None = None,
    threads: int | None = None,
    text_name: str = BUILTIN_TEXT,
    source_label: str | None = None,
    progress: Progress | None = None,
) -> QualityReport:
    """Evaluate ``output`` against ``reference`` on ``text`` (see the module docstring).
    ``source_label`` names the source in the report when ``reference`` is a temporary copy."""
    from llmlocal.engine import Engine, Plan

    started = time.monotonic()
    # Both in llama.cpp, whatever the machine: the comparison must not mix two engines' numerics.
    with Engine.load(Plan(model=os.fspath(reference), backend="llamacpp", n_ctx=ctx, threads=threads)) as ref_engine, \
            Engine.load(Plan(model=os.fspath(output), backend="llamacpp", n_ctx=ctx, threads=threads)) as out_engine:
        ref_spec, out_spec = ref_engine.model.spec, out_engine.model.spec
        if ref_spec.vocab_size != out_spec.vocab_size or ref_spec.vocab_fingerprint != out_spec.vocab_fingerprint:
            raise LLMLocalError(
                f"{output} and {reference} have different vocabularies: they are not the same model, so they cannot be compared."
            )
        ids = ref_engine.tokenize(text, add_special=False)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        bos = ref_spec.special.bos_id if ref_spec.special.add_bos else None
        windows = _windows(ids, bos, ctx)
        if not windows:
            raise LLMLocalError("The evaluation text is shorter than two tokens: give at least a few paragraphs.")
        total = sum(len(w) - 1 for w in windows)
        if progress is not None:
            progress.total, progress.unit, progress.items, progress.item_noun = total, "tokens", len(windows), "windows"
        nll_ref: list[np.ndarray] = []
        nll_out: list[np.ndarray] = []
        kls: list[np.ndarray] = []
        agree: list[np.ndarray] = []
        for window in windows:
            targets = np.asarray(window[1:])
            lp_ref = ref_engine.log_probs(window)  # (len - 1, vocab)
            lp_out = out_engine.log_probs(window)
            a, b, kl, same = compare_log_probs(lp_ref, lp_out, targets)
            del lp_ref, lp_out
            nll_ref.append(a)
            nll_out.append(b)
            kls.append(kl)
            agree.append(same)
            if progress is not None:
                progress.advance(len(targets), items=1)
    kl_all = np.concatenate(kls)
    return QualityReport(
        type=type_name,
        source_type=source_type,
        source=source_label or os.fspath(reference),
        output=os.fspath(output),
        source_ppl=math.exp(float(np.concatenate(nll_ref).mean())),
        output_ppl=math.exp(float(np.concatenate(nll_out).mean())),
        kld=float(kl_all.mean()),
        kld_p99=float(np.percentile(kl_all, 99)),
        top1_agreement=float(np.concatenate(agree).mean()),
        eval_tokens=int(kl_all.size),
        windows=len(windows),
        ctx=ctx,
        eval_text=text_name,
        seconds=round(time.monotonic() - started, 2),
    )


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """``data`` as indented JSON at ``path``, written under a temporary name and renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
