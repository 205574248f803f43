"""What activation sparsity costs in quality: the sparse model against the dense same GGUF.

Both run in llmlocal's torch model (the same weights, the same numerics); the sparse one has
each projection input thresholded (`llmlocal.engine.model.sparsity`), which is the function
the native sparse kernels compute. On held-out text, teacher-forced, per level:

    perplexity      exp(mean -log Q(next token)),            Q = sparse model
    KL divergence   mean over positions of KL(P || Q),       P = dense model, nats per token
    top-1 agreement fraction of positions where argmax P == argmax Q
    achieved        fraction of projection inputs zeroed on this text (the thresholds were
                    calibrated on other text), and of weight columns a kernel would skip

    from llmlocal.quant.sparsity_quality import evaluate_sparsity
    print(evaluate_sparsity("model-Q4_0.gguf", levels=(0.3, 0.4, 0.5)).table())
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from llmlocal.models.spec import SparsitySpec

from .evaluate import BUILTIN_TEXT, compare_log_probs, write_json
from .progress import Progress
from .sparsity import (
    BUILTIN_CALIBRATION_TEXT,
    check_level,
    split_builtin_text,
    torch_model,
)

HELD_OUT_TEXT = "built-in, held-out half"
DEFAULT_MAX_PPL_INCREASE = 0.05  # the goal the default level is chosen against


@dataclass(frozen=True)
class LevelQuality:
    level: float  # requested fraction
    achieved: float  # fraction of projection inputs zeroed on the evaluation text
    achieved_weights: float  # fraction of projection weight columns skipped
    by_projection: dict[str, float]  # fraction zeroed per projection input
    ppl: float
    kld: float  # mean KL(dense || sparse), nats per token
    kld_p99: float
    top1_agreement: float


@dataclass(frozen=True)
class SparsityQuality:
    model: str
    dense_ppl: float
    levels: tuple[LevelQuality, ...]
    eval_tokens: int  # positions scored
    windows: int
    ctx: int
    eval_text: str
    calibration_tokens: int
    calibration_text: str
    seconds: float
    profile: str = ""  # a profile file's levels at its calibrated level ("ffn_down 60%"), else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON (to a temporary name first, like every file we write)."""
        write_json(path, self.to_dict())

    def ppl_increase(self, row: LevelQuality) -> float:
        return row.ppl / self.dense_ppl - 1.0

    def default_level(self, max_ppl_increase: float = DEFAULT_MAX_PPL_INCREASE) -> float | None:
        """The highest level whose perplexity increase is within ``max_ppl_increase``."""
        ok = [r.level for r in self.levels if self.ppl_increase(r) <= max_ppl_increase]
        return max(ok) if ok else None

    def table(self) -> str:
        text = self.eval_text if self.eval_text != BUILTIN_TEXT else "the built-in text"
        lines = [
            (
                f"Activation sparsity against the dense model ({self.eval_tokens:,} held-out tokens of {text}, "
                f"windows of {self.ctx}; thresholds from {self.calibration_tokens:,} tokens of {self.calibration_text}):"
            ),
            (
                f"  {'level':>5}  {'zeroed':>6}  {'weights':>7}  {'perplexity':>10}  {'increase':>8}  "
                f"{'mean KL':>8}  {'KL p99':>7}  {'top-1':>6}"
            ),
            f"  {'dense':>5}  {'':>6}  {'':>7}  {self.dense_ppl:10.4f}",
        ]
        if self.profile:
            lines.insert(1, f"  (a profile: at its level {max(r.level for r in self.levels):.2f}, {self.profile}; other levels every projection)")
        for r in self.levels:
            lines.append(
                f"  {r.level:5.2f}  {r.achieved * 100:5.1f}%  {r.achieved_weights * 100:6.1f}%  {r.ppl:10.4f}  "
                f"{self.ppl_increase(r) * 100:+7.2f}%  {r.kld:8.5f}  {r.kld_p99:7.4f}  {r.top1_agreement * 100:5.1f}%"
            )
        return "\n".join(lines)


def evaluate_sparsity(
    model_path: str | os.PathLike[str],
    levels: Sequence[float] = (0.3, 0.4, 0.5),
    *,
    sparsity: SparsitySpec | None = None,
    text: str | None = None,
    text_name: str | None = None,
    ctx: int = 512,
    max_tokens: int | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
) -> SparsityQuality:
    """The quality table of ``model_path`` (a llama-family GGUF) at each of ``levels``.

    Thresholds: ``sparsity`` if given, else the file's own calibration, else a calibration
    on the built-in text's calibration half made here. Text: ``text``, else the built-in
    text's held-out half (which no built-in calibration has seen)."""
    import torch
    from llmlocal.engine.model.sparsity import SparsityCounter, apply_thresholds

    from .sparsity import calibrate

    for level in levels:
        check_level(level)
    started = time.monotonic()
    calib_text, held_out = split_builtin_text()
    if text is None:
        text, text_name = held_out, HELD_OUT_TEXT
    with torch_model(model_path, ctx, threads) as m:
        sparsity = sparsity or m.spec.sparsity
        if sparsity is None:
            sparsity = calibrate(m, calib_text, max(levels), ctx=ctx, text_name=BUILTIN_CALIBRATION_TEXT)
        windows = m.windows(text, ctx, max_tokens)
        if progress is not None:
            progress.total, progress.unit = sum(len(w) - 1 for w in windows), "tokens"
            progress.items, progress.item_noun = len(windows), "windows"
        counters = {level: SparsityCounter() for level in levels}
        nll_dense: list[np.ndarray] = []
        per_level: dict[float, list[tuple[np.ndarray, ...]]] = {level: [] for level in levels}
        with torch.inference_mode():
            for window in windows:
                targets = np.asarray(window[1:])
                dense = torch.log_softmax(m.logits(window)[:-1], dim=-1).numpy()  # (len - 1, vocab)
                for level in levels:
                    with apply_thresholds(m.model, sparsity.at(level), counters[level]):
                        sparse = torch.log_softmax(m.logits(window)[:-1], dim=-1).numpy()
                    _, b, kl, same = compare_log_probs(dense, sparse, targets)
                    per_level[level].append((b, kl, same))
                    del sparse
                nll_dense.append(-dense[np.arange(len(targets)), targets].astype(np.float64))
                if progress is not None:
                    progress.advance(len(targets), items=1)
    rows = []
    for level in levels:
        nll, kl, same = (np.concatenate(parts) for parts in zip(*per_level[level]))
        c = counters[level]
        rows.append(LevelQuality(
            level=round(level, 4),
            achieved=round(c.inputs, 4),
            achieved_weights=round(c.weights, 4),
            by_projection={p: round(v, 4) for p, v in c.by_projection().items()},
            ppl=math.exp(float(nll.mean())),
            kld=float(kl.mean()),
            kld_p99=float(np.percentile(kl, 99)),
            top1_agreement=float(same.mean()),
        ))
    dense_nll = np.concatenate(nll_dense)
    return SparsityQuality(
        model=os.fspath(model_path),
        dense_ppl=math.exp(float(dense_nll.mean())),
        levels=tuple(rows),
        eval_tokens=int(dense_nll.size),
        windows=len(windows),
        ctx=ctx,
        eval_text=text_name or BUILTIN_TEXT,
        calibration_tokens=sparsity.calibration_tokens,
        calibration_text=sparsity.calibration_text or "an unnamed text",
        seconds=round(time.monotonic() - started, 2),
        profile=sparsity.describe() if sparsity.levels else "",
    )



def main(argv: Sequence[str] | None = None) -> int:
    """`python -m llmlocal.quant.sparsity_quality [MODEL] [--levels 0.3,0.4,0.5] [--json]`."""
    import argparse

    from llmlocal.models import resolve

    p = argparse.ArgumentParser(prog="python -m llmlocal.quant.sparsity_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="model name or GGUF path (default: the starter model)")
    p.add_argument("--levels", default="0.3,0.4,0.5", help="comma-separated sparsity levels")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default: 512)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    quality = evaluate_sparsity(resolve(args.model).path, [float(x) for x in args.levels.split(",")], ctx=args.ctx)
    print(json.dumps(quality.to_dict()) if args.json else quality.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
