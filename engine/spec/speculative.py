"""Verifying a draft: which proposed tokens the target model keeps, and the token after them.

The target scores the sequence's last real token and the k drafts d_1..d_k in one forward
pass, giving k + 1 next-token distributions: row i is the target's distribution for the
position of d_{i+1} (row k is the position after the last draft).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.sampling import apply_repeat_penalty, draw, filtered_probs
from ..types import SamplingParams


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafts, a prefix, the target keeps
    token: int  # the target's token after them (a correction, or the bonus token if all kept)


def verify(
    target_logits: torch.Tensor,  # (k + 1, V) float32
    drafts: Sequence[int],  # k proposed tokens
    draft_probs: torch.Tensor | None,  # (k, V) the draft's filtered distributions; None: point masses
    params: SamplingParams,
    history: Sequence[int],  # the sequence's tokens before d_1 (for the repetition penalty)
    generator: torch.Generator | None,
) -> Verdict:
    """Accept a prefix of ``drafts`` so that the tokens produced follow the target exactly.

    Greedy (T = 0): keep d_i while it equals the target's argmax at its position; the first
    mismatch is replaced by that argmax. The output is token-for-token what plain greedy
    decoding of the target gives.

    Sampling (T > 0), the modified rejection sampling of Leviathan et al. (2023) and Chen et
    al. (2023). With p_i the target's and q_i the draft's distribution at position i (both
    after the same top-k / top-p / min-p / temperature filtering, so they are over the same
    kind of support), keep d_i with probability min(1, p_i(d_i) / q_i(d_i)). On the first
    rejection draw the replacement from the residual r(x) = max(0, p_i(x) - q_i(x)) / Z.
    Why this is exact: a token x comes out at position i either as an accepted draft, with
    probability q(x) min(1, p(x)/q(x)) = min(q(x), p(x)), or as a replacement after a
    rejection, with probability (1 - sum_y min(q(y), p(y))) r(x) = max(0, p(x) - q(x));
    the two sum to p(x). If all k drafts are kept, the bonus token is drawn from p_k. A
    deterministic drafter (n-gram lookup) is the case q_i = one-hot(d_i): keep d_i with
    probability p_i(d_i), otherwise draw from p_i with d_i removed.
    """
    k = len(drafts)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} target rows, got {target_logits.shape[0]}")
    penalize = params.repeat_penalty != 1.0
    if params.greedy and not penalize:
        best = target_logits.argmax(dim=-1).tolist()  # (k + 1,)
        for i, d in enumerate(drafts):
            if d != best[i]:
                return Verdict(i, best[i])
        return Verdict(k, best[k])

    seen = list(history)
    for i in range(k + 1):
        row = apply_repeat_penalty(target_logits[i], seen, params) if penalize else target_logits[i]
        if params.greedy:
            best_i = int(row.argmax())
            if i == k or drafts[i] != best_i:
                return Verdict(i, best_i)
        else:
            p = filtered_probs(row, params)  # (V,)
            if i == k:
                return Verdict(k, draw(p, generator))
            d = drafts[i]
            q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
            u = float(torch.rand((), generator=generator, device=p.device))
            if q_d > 0.0 and u * q_d < float(p[d]):  # u < p(d) / q(d) without dividing
                seen.append(d)
                continue
            if draft_probs is None:
                residual = p.clone()
                residual[d] = 0.0
            else:
                residual = (p - draft_probs[i].to(p.device)).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection was ~impossible
                residual = p
            return Verdict(i, draw(residual, generator))
        seen.append(drafts[i])
    raise AssertionError("unreachable: the last row always returns")
