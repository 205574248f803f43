"""Figures of a reply while it streams, from the arrival times of its token events.

The engine's `Stats` arrive only with the last event; until then the engine panel shows what
these timings give: time to first token, decode speed so far, and one rate per event for the
sparkline (tokens in the event / time since the previous one). When the reply ends, the
engine's own figures replace the estimates, and the rates are kept with the stored reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_RATES = 240  # rates kept with a stored reply; longer replies are averaged down to this


@dataclass
class LiveStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_s: float | None = None  # seconds from the request to the first token
    last_s: float | None = None  # ... to the latest token
    rates: list[float] = field(default_factory=list)  # tokens/s of each event after the first

    def add(self, elapsed_s: float, tokens: int) -> None:
        """An event of ``tokens`` tokens arrived ``elapsed_s`` after the request started."""
        if tokens <= 0:
            return  # text held back (an incomplete character or stop string): no new token
        if self.first_s is None:
            self.first_s = elapsed_s
        elif self.last_s is not None and elapsed_s > self.last_s:
            self.rates.append(tokens / (elapsed_s - self.last_s))
        self.last_s = elapsed_s
        self.completion_tokens += tokens

    @property
    def ttft_s(self) -> float | None:
        return self.first_s

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first (as the engine counts it)."""
        if self.first_s is None or self.last_s is None or self.last_s <= self.first_s:
            return None
        return (self.completion_tokens - 1) / (self.last_s - self.first_s)


def downsample(values: list[float], limit: int = MAX_RATES) -> list[float]:
    """At most ``limit`` values: consecutive runs averaged, so the shape of the curve stays."""
    if len(values) <= limit:
        return [round(v, 2) for v in values]
    out = []
    for i in range(limit):
        lo = i * len(values) // limit
        hi = (i + 1) * len(values) // limit
        chunk = values[lo:hi]
        out.append(round(sum(chunk) / len(chunk), 2))
    return out
