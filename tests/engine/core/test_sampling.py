"""The sampling filters and the draw: `filtered_probs` on top-k's survivors gives what the same
filters give over the whole vocabulary, and `draw` follows the distribution it is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llmlocal.engine.core.sampling import draw, filtered_probs
from llmlocal.engine.types import SamplingParams


def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The filters over the whole vocabulary in float64: top-k (ties kept), then top-p and min-p
    on the softmax at T = 1, then temperature on the survivors."""
    x = logits.astype(np.float64)
    keep = np.ones_like(x, dtype=bool)
    if 0 < p.top_k < x.size:
        keep &= x >= np.sort(x)[-p.top_k]
    e = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs = e / e.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep[order[before >= p.top_p]] = False
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    e = np.where(keep, np.exp((x - x[keep].max()) / p.temperature), 0.0)
    return e / e.sum()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(top_k=0), SamplingParams(top_k=5, top_p=1.0, min_p=0.0, temperature=1.3),
     SamplingParams(top_k=100, top_p=0.5, min_p=0.0), SamplingParams(top_k=1)],
    ids=["defaults", "no-top-k", "top-k-only", "top-p", "top-1"],
)
def test_filters_on_the_survivors_equal_the_filters_over_the_vocabulary(params) -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        logits = (rng.standard_normal(50_000) * 3).astype(np.float32)
        if trial % 2 and params.top_p == 1.0:  # ties at the k-th value stay in (at top-p's edge a
            # tie is kept or dropped by the order a sort leaves the tied values in)
            logits[rng.choice(50_000, 8, replace=False)] = np.sort(logits)[-max(params.top_k, 1)]
        got = filtered_probs(torch.from_numpy(logits), params).numpy()
        want = reference(logits, params)
        assert ((got > 0) == (want > 0)).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_draw_follows_its_distribution_and_only_its_support() -> None:
    probs = torch.zeros(10_000)
    probs[[3, 500, 9_999]] = torch.tensor([0.2, 0.5, 0.3])
    g = torch.Generator().manual_seed(1)
    counts = np.bincount([draw(probs, g) for _ in range(6_000)], minlength=10_000)
    assert set(np.nonzero(counts)[0]) == {3, 500, 9_999}
    expected = 6_000 * np.array([0.2, 0.5, 0.3])
    chi2 = (((counts[[3, 500, 9_999]] - expected) ** 2) / expected).sum()
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs, a) for _ in range(50)] == [draw(probs, b) for _ in range(50)]  # a seed repeats
