"""How many tokens to draft, per sequence and step: a small cost model, measured as it runs.

With a per-token acceptance rate a (the chance the target keeps a draft token, given it kept
the previous ones), drafting k tokens yields E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens per target step. A step costs the target's forward pass over B + sum(k_i) tokens plus
the draft's k_max passes. Both costs are modelled as t(M) = c + s * M for a pass over M
tokens (fixed cost: weights read once and per-pass overhead; s: per-token compute) and
fitted by least squares over the last steps; a width measured lately is priced by its own
measurements (`LinearCost`). The target has two fits: steps where every
sequence decodes one token ("plain": on a CPU the native one-call decode path, several times
cheaper than the torch layers that verify drafts), and steps that check drafts (a step with
a prompt in it is not observed: per token it costs what neither does); not drafting is priced
with the first, drafting with the second. Both start from a prior shape (`PER_TOKEN_PRIOR` of
the device) scaled to the first step measured. Until four plain steps are measured, not
drafting is priced with the second fit too. Each step the controller picks, among "the m
sequences with the best acceptance draft k tokens, the others none", the choice with the most
tokens per second, so a sequence whose drafts are mostly wrong stops drafting, and a large
batch (where the target's pass is no longer cheap per extra token) drafts less or not at all.

Acceptance is tracked per sequence as decayed counts of kept and rejected tokens; a new
sequence starts from the acceptance pooled over the sequences before it (one each of kept
and rejected before any), but once there are verdicts, never below FIRST_TRY: requests differ
(a sampled summary kept 0.58 of a draft's tokens, sampled code 0.95), and a pooled rate too
low to draft would keep every later request from measuring its own, for good, since only
drafting updates it. The counts also decay on steps without drafting, so a sequence that
stopped drafting drifts back to the pooled rate and is tried again later if that pays.

Priors alone cannot tell whether a draft model pays on a CPU: a checked token costs half a
step where the step is bound by arithmetic (Zen 3: the 0.5B drafting for the 1.5B does not
pay) and a tenth where it is bound by memory (Sapphire Rapids: it does, 1.3x at k = 3). So
a draft model is probed once, when the controller would not draft on its priors: in a few
steps one sequence drafts 1 to 4 tokens, which measures the checking steps' cost (their slope
per token too) and the acceptance; from then on the measurements decide.

A draft model's first proposal for a sequence first computes the draft's K/V of everything
before it that its prefix cache lacks: a cold 650-token prompt cost the 0.5B about 4 s on a
Zen 3, so a 48-token reply drafted came 0.8x as fast as not drafting. A sequence whose draft
lags so starts drafting only where the reply left to it is expected to save more than the
catch-up costs: its tokens left (its room, at most the larger of REPLY_PRIOR and what it has
decoded so far: a reply that has run long tends to run on) times the seconds a token saves.
The catch-up is priced per token as the draft's long passes measured, or before any, as the
target's prompt steps per token scaled by the draft's share of the bytes.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

DECAY = 0.9  # weight of the past in the acceptance counts, per step
FIRST_TRY = 0.8  # a new sequence's prior acceptance at least: enough to draft where drafts are cheap
PROBE_KS = (1, 2, 3, 4, 2, 3)  # draft lengths of the probing steps: several, for the slope
REPLY_PRIOR = 256  # tokens a reply is expected to run, at least, when pricing a draft's catch-up
PROBE_SAVING = 0.25  # of a plain step per token: what a probe hopes drafting saves
LONG_PASS = 32  # tokens a draft pass computes at least to be counted a catch-up


@dataclass
class _Acceptance:
    kept: float = 1.0
    rejected: float = 1.0

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)


@dataclass
class LinearCost:
    """t(M) = fixed + per_token * M, fitted to recent (M, seconds) observations; at a width M
    measured at least twice lately, the median of those measurements instead. A step's cost
    is not a line in M: the CPU kernels take a step's rows four at a time (a step of 5 tokens
    costs about what one of 8 costs), and a line fitted across such widths misprices both."""

    fixed: float
    per_token: float
    history: deque = field(default_factory=lambda: deque(maxlen=64))
    by_width: dict[int, deque] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        self.history.append((float(tokens), seconds))
        self.by_width.setdefault(tokens, deque(maxlen=8)).append(seconds)
        if len(self.history) < 4:
            if len(self.history) == 1:  # first measurement: scale the prior to it
                prior = self(tokens)
                if prior > 0:
                    self.fixed *= seconds / prior
                    self.per_token *= seconds / prior
                else:
                    self.fixed, self.per_token = seconds, 0.0
            return
        xs = [m for m, _ in self.history]
        ys = [t for _, t in self.history]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
            self.per_token = max(slope, 0.0)
        self.fixed = max(my - self.per_token * mx, 1e-6)

    def __call__(self, tokens: float) -> float:
        measured = self.by_width.get(tokens)  # type: ignore[call-overload]  # 5.0 finds the key 5
        if measured is not None and len(measured) >= 2:
            return statistics.median(measured)
        return self.fixed + self.per_token * tokens


def expected_tokens(k: int, rate: float) -> float:
    """Tokens a step yields with k drafts at acceptance rate ``rate`` (the bonus included)."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


# The prior cost of one more token in a step, relative to the step's fixed cost: on a GPU a
# step reads the weights once for every token it checks (a few tokens cost next to nothing);
# on a CPU a step is bound by arithmetic and each checked token costs about half a one-token
# step (0.8 / 1.8; measured on two cores: 4 tokens of the 1.5B Q4_K_M checked in 2-2.6 steps).
PER_TOKEN_PRIOR = {"cuda": 0.02, "cpu": 0.8}


class DraftLength:
    """Chooses k per sequence. ``fixed`` pins k (no adaptation); ``draft_ratio`` is the prior
    draft/target cost ratio of a forward pass (the weight bytes ratio is a fair guess);
    ``per_token`` the prior cost of one more token in a step (`PER_TOKEN_PRIOR` of the device).
    Where the priors say a draft model does not pay (a CPU's), it is probed once after four
    plain steps (`PROBE_KS`), and the measured costs and acceptance decide from then on."""

    def __init__(self, k_max: int = 8, fixed: int | None = None, draft_ratio: float = 0.25,
                 per_token: float = PER_TOKEN_PRIOR["cuda"]) -> None:
        self.k_max = fixed if fixed is not None else k_max
        self.fixed = fixed
        self.target = LinearCost(fixed=1.0, per_token=per_token)  # steps with drafts or prefill
        self.plain = LinearCost(fixed=1.0, per_token=per_token)  # steps of one-token decodes only
        self.draft = LinearCost(fixed=draft_ratio, per_token=0.02 * draft_ratio)
        self._anchored = False  # the priors scaled to the first measured step
        self._acc: dict[int, _Acceptance] = {}
        self._pooled = _Acceptance()  # every sequence's verdicts, decayed: a new sequence's prior
        self._verdicts = False  # whether any drafts were checked yet
        self._probe: list[int] = []  # draft lengths still to try in the probe
        self._free = draft_ratio <= 0.0  # a drafter without passes (n-gram lookup): never probed
        self._probed = self._free
        self.draft_ratio = draft_ratio
        self._prompt_s: float | None = None  # seconds per token of the target's prompt steps
        self._catch_up_s: float | None = None  # ... of the draft's long passes (its catch-ups)

    def _counts(self, seq_id: int) -> _Acceptance:
        acc = self._acc.get(seq_id)
        if acc is None:
            p = max(self._pooled.rate, FIRST_TRY) if self._verdicts else self._pooled.rate
            acc = self._acc[seq_id] = _Acceptance(kept=2.0 * p, rejected=2.0 * (1.0 - p))
        return acc

    def rate(self, seq_id: int) -> float:
        return self._counts(seq_id).rate

    def observe_target(self, tokens: int, seconds: float, plain: bool = False) -> None:
        """A target step over ``tokens`` tokens took ``seconds``; ``plain``: every sequence of
        the step decoded one token (no drafts, no prefill); otherwise a step that checked drafts."""
        if not self.target.history and not self.draft.history and not self._anchored:
            # the priors are relative to the first step measured: keep them so in seconds
            scale = seconds / self.target(tokens)
            for cost in (self.target, self.draft):
                cost.fixed *= scale
                cost.per_token *= scale
            self._anchored = True
        if plain:
            self.plain.observe(tokens, seconds)
            return
        self.target.observe(tokens, seconds)

    def _plain_cost(self, batch: int) -> float:
        """Seconds of a step without drafts: measured on plain steps once there are some, and
        never more than a checking step of as many tokens was measured to cost (the plain fit
        knows only the widths plain steps had: at batch 1 alone its slope is the prior's)."""
        cost = self.plain(batch) if len(self.plain.history) >= 4 else self.target(batch)
        checked = self.target.by_width.get(batch)
        return min(cost, statistics.median(checked)) if checked else cost

    def observe_draft(self, tokens: int, passes: int, seconds: float) -> None:
        """The draft ran ``passes`` forward passes over ``tokens`` tokens in all."""
        if passes:
            self.draft.observe(round(tokens / passes), seconds / passes)
            if tokens >= LONG_PASS * passes:
                self._catch_up_s = _ema(self._catch_up_s, seconds / tokens)

    def observe_prompt(self, tokens: int, seconds: float) -> None:
        """A target step with a prompt in it computed ``tokens`` tokens in ``seconds``."""
        if tokens >= LONG_PASS:
            self._prompt_s = _ema(self._prompt_s, seconds / tokens)

    def catch_up_cost(self, tokens: int) -> float:
        """Seconds the draft would take to compute ``tokens`` tokens it lacks (0: not known)."""
        per_token = self._catch_up_s
        if per_token is None:
            per_token = self.draft_ratio * self._prompt_s if self._prompt_s is not None else 0.0
        return tokens * per_token

    def forget(self, seq_id: int) -> None:
        self._acc.pop(seq_id, None)

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        self._verdicts = True
        for acc in (self._counts(seq_id), self._pooled):
            acc.kept = acc.kept * DECAY + accepted
            acc.rejected = acc.rejected * DECAY + (1 if accepted < drafted else 0)

    def decay_idle(self, seq_ids: list[int]) -> None:
        p = self._pooled.rate
        for sid in seq_ids:  # towards the pooled prior (2 p kept, 2 (1 - p) rejected)
            acc = self._counts(sid)
            acc.kept = 2.0 * p + (acc.kept - 2.0 * p) * DECAY
            acc.rejected = 2.0 * (1.0 - p) + (acc.rejected - 2.0 * (1.0 - p)) * DECAY

    def choose(self, seq_ids: list[int], batch: int, room: dict[int, int], lag: dict[int, int] | None = None,
               decoded: dict[int, int] | None = None) -> dict[int, int]:
        """k for each of ``seq_ids`` (the decoding sequences; ``batch`` counts every sequence
        in the step, prefills included). ``room`` caps k per sequence (max_tokens, context);
        ``lag``: tokens a sequence's draft would compute before proposing, ``decoded``: tokens
        it has decoded (see the module's docstring; a fixed k ignores them)."""
        if not seq_ids:
            return {}
        if self.fixed is not None:
            return {sid: max(0, min(self.fixed, room[sid])) for sid in seq_ids}
        waits: set[int] = set()  # sequences whose draft's catch-up would cost more than it saves
        if lag and any(lag.values()):
            saving = self._saving(batch, seq_ids)
            for sid in seq_ids:
                left = min(room[sid], max(REPLY_PRIOR, (decoded or {}).get(sid, 0)))
                if self.catch_up_cost(lag.get(sid, 0)) > left * saving:
                    waits.add(sid)
        chosen = dict.fromkeys(seq_ids, 0)
        ready = [sid for sid in seq_ids if sid not in waits]
        if ready:  # (the probe waits for a sequence that may draft)
            chosen.update(self._choose(ready, batch, room))
        return chosen

    def _saving(self, batch: int, seq_ids: list[int]) -> float:
        """Seconds a decoded token saves with the best drafting the model sees now; before the
        probe has measured it, what the probe hopes for (PROBE_SAVING of a plain step)."""
        plain = self._plain_cost(batch) / batch
        if not self._probed or self._probe:
            return PROBE_SAVING * plain
        speed, k, _ = self._best(batch, sorted((self.rate(s) for s in seq_ids), reverse=True))
        return max(0.0, plain - 1.0 / speed) if k else 0.0

    def _choose(self, seq_ids: list[int], batch: int, room: dict[int, int]) -> dict[int, int]:
        if self._probe:  # one sequence drafts (a draft model catches up with one prompt only)
            k, first = self._probe.pop(0), max(seq_ids, key=self.rate)
            return {sid: max(0, min(k, room[sid])) if sid == first else 0 for sid in seq_ids}
        if 0 < len(self.draft.history) < 4:
            # Too few measured draft passes to fit its cost (the first is often the draft
            # catching up with a whole prompt, far dearer than a proposal): draft one token
            # per sequence until there are, rather than judge on that pass and never draft.
            # (A drafter without passes, n-gram lookup, costs next to nothing: no probing.)
            return {sid: max(0, min(1, room[sid])) for sid in seq_ids}
        order = sorted(seq_ids, key=self.rate, reverse=True)
        _, k, m = self._best(batch, [self.rate(s) for s in order])
        if k == 0 and not self._probed and len(self.plain.history) >= 4:
            # not on the priors: measure instead, once (see the module's docstring)
            self._probed = True
            self._probe = list(PROBE_KS)
            return self._choose(seq_ids, batch, room)
        chosen = {sid: 0 for sid in seq_ids}
        for sid in order[:m]:
            chosen[sid] = max(0, min(k, room[sid]))
        return chosen

    def _best(self, batch: int, rates: list[float]) -> tuple[float, int, int]:
        """(tokens per second, k, m) of the best choice "the m sequences of the best acceptance
        (``rates``, best first) draft k tokens": k = 0 where not drafting is best."""
        best = (batch / self._plain_cost(batch), 0, 0)
        # Once probed, the cost of checking is known only as far as it was measured: a step is
        # bound by memory up to some width and by arithmetic beyond (a CPU at batch 8), which
        # a line fitted to narrow steps does not foresee. So the controller drafts at most one
        # token wider than the widest checking step it has timed, and widens as it measures.
        widest = max(self.target.by_width, default=0)
        for k in range(1, self.k_max + 1):
            gained = 0.0
            for m in range(1, len(rates) + 1):
                gained += expected_tokens(k, rates[m - 1]) - 1.0
                if self._probed and not self._free and batch + k * m > widest + 1:
                    break  # beyond the checking steps measured, by more than a token: not trusted
                seconds = self.target(batch + k * m) + k * self.draft(m)
                speed = (batch + gained) / seconds
                if speed > best[0]:
                    best = (speed, k, m)
        return best


def _ema(old: float | None, new: float, weight: float = 0.5) -> float:
    return new if old is None else weight * old + (1.0 - weight) * new
