"""The grammar masks of a paged engine step: which tokens each constrained row may take,
computed on a worker thread while the model runs, then applied to the step's logits.

A step's sampled rows are known before the model runs (its `StepItem`s), and so is every
constrained sequence's place in its grammar (the last step's tokens were taken), so the masks
need not wait for the logits. A row that verifies drafts gets one mask per position
(`Constraint.allowed_through`). Nothing else touches the constraints between `start` and
`result()`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..prompt.grammar import Constraint, TokenMasks, mask_logits
from ..types import Grammar
from .model_runner import StepItem
from .sequence import Sequence

Masks = dict[int, list[np.ndarray | None]]  # sequence id -> a mask per logits row (None: unmasked)


class StepMasks:
    def __init__(self, token_masks: TokenMasks) -> None:
        self._token_masks = token_masks
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmlocal-masks")

    def constraint(self, grammar: Grammar) -> Constraint:
        return self._token_masks.constraint(grammar)

    def start(self, items: list[StepItem], constraint_of: Callable[[Sequence], Constraint | None]) -> Future[Masks] | None:
        """The masks of the constrained sampled rows of ``items`` (sequences the backend's
        ``constraint_of`` gives a constraint), on the worker; None when there are none."""
        constrained = [(it, c) for it in items if it.sample and (c := constraint_of(it.seq)) is not None]
        if not constrained:
            return None

        def compute() -> Masks:
            out: Masks = {}
            for it, constraint in constrained:
                k = it.num_logits - 1  # drafts being verified
                out[it.seq.seq_id] = constraint.allowed_through(it.seq.token_ids[it.seq.num_tokens - k :] if k else [])
            return out

        return self._worker.submit(compute)

    @staticmethod
    def apply(logits: torch.Tensor, items: list[StepItem], masks: Masks) -> None:
        """Forbidden tokens get logit -inf in the rows of ``items`` (the order of ``logits``)."""
        row = 0
        for it in items:
            for i, allowed in enumerate(masks.get(it.seq.seq_id, ())):
                if allowed is not None:
                    mask_logits(logits[row + i], allowed)
            row += it.num_logits

    def close(self) -> None:
        self._worker.shutdown(wait=False)
