"""Timing of one request, turned into the shared `Stats` when it ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..types import Stats


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass
class StatsRecorder:
    """Call `token()` as each token is produced; `finish()` computes the figures.

    TTFT runs from the recorder's creation (request start) to the first token. Decode speed
    counts the tokens after the first over the time after the first, so it does not mix in
    the prefill.
    """

    backend: str
    device: str
    start: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)

    def token(self, count: int = 1) -> None:
        now = time.perf_counter()
        self.token_times.extend([now] * count)

    def finish(self, prompt_tokens: int, **extra: object) -> Stats:
        end = time.perf_counter()
        times = self.token_times
        stats = Stats(
            backend=self.backend,
            device=self.device,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(times),
            total_s=end - self.start,
        )
        if times:
            stats.ttft_s = times[0] - self.start
            if stats.ttft_s > 0:
                stats.prefill_tok_s = prompt_tokens / stats.ttft_s
        if len(times) >= 2:
            gaps = sorted((b - a) * 1000.0 for a, b in zip(times, times[1:]))
            stats.itl_ms_p50 = percentile(gaps, 50)
            stats.itl_ms_p95 = percentile(gaps, 95)
            decode_s = times[-1] - times[0]
            if decode_s > 0:
                stats.decode_tok_s = (len(times) - 1) / decode_s
        for key, value in extra.items():
            if not hasattr(stats, key):
                raise AttributeError(f"Stats has no field {key!r}")
            setattr(stats, key, value)
        return stats
