"""A draft model's output head over part of its vocabulary.

The head is the largest single matrix a small draft model reads per token (a third of the
Qwen2.5-Coder 0.5B's bytes: 151,936 rows), yet the tokens a target chooses come mostly from a
small part of it. BPE vocabularies number their tokens in the order of their merges, roughly
most frequent first, so the head's first rows run in the native kernels; the rows of the rarer
tokens that appear in the texts being drafted for (an identifier from the prompt, a code fence)
are added as they appear and computed beside them. Every other token gets -inf: the draft never
proposes it, and where the target chooses it the draft is rejected there, so the output is
the target's either way (and sampling stays exact: the draft's distribution is simply zero
there).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .gguf_tensors import QuantEmbedding

MAX_EXTRA_ROWS = 1024  # rows of rarer tokens kept beside the prefix (3.7 MB at width 896)


class DraftHead(nn.Module):
    """Logits over the full vocabulary from ``prefix`` (the first ``prefix_ids`` rows, in the
    native kernels) and the float rows of the tokens `include` was told of."""

    def __init__(self, prefix: nn.Module, prefix_ids: int, rows: QuantEmbedding, vocab: int) -> None:
        super().__init__()
        self.prefix = prefix
        self.prefix_ids = prefix_ids
        self.rows = rows
        self.vocab = vocab
        self.extra_ids = torch.empty(0, dtype=torch.long)
        self.extra = torch.empty(0, rows.width)
        self._known: set[int] = set()

    def include(self, token_ids: Iterable[int]) -> None:
        """Let the head propose these tokens too (those beyond the prefix, while there is room)."""
        new = sorted({t for t in token_ids if self.prefix_ids <= t < self.vocab} - self._known)
        new = new[: MAX_EXTRA_ROWS - len(self._known)]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.long)
        self.extra_ids = torch.cat([self.extra_ids, ids])
        self.extra = torch.cat([self.extra, self.rows(ids)])
        self._known.update(new)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h.new_full((h.shape[0], self.vocab), -math.inf, dtype=torch.float32)
        out[:, : self.prefix_ids] = self.prefix(h)
        if len(self.extra_ids):
            out[:, self.extra_ids] = h.float() @ self.extra.T
        return out
