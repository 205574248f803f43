"""What `llmlocal serve` reports on ``GET /metrics``: request and token counters, and TTFT and
inter-token latency histograms, in Prometheus' text exposition format."""

from __future__ import annotations

import threading
from collections import Counter

from llmlocal.engine.types import DoneEvent

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, their sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.buckets, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            self.buckets[i] += value <= bound

    def lines(self, name: str) -> list[str]:
        rows = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.bounds, self.buckets)]
        return rows + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """What ``GET /metrics`` reports, in Prometheus' text exposition format."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (path, status) -> answered
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)  # request arrival -> first token, seconds
        self.itl = Histogram(ITL_BUCKETS)  # between two tokens of one sample, seconds

    def answered(self, path: str, status: int, done: list[DoneEvent]) -> None:
        with self.lock:
            self.requests[path, status] += 1
            if done:
                self.prompt_tokens += done[0].stats.prompt_tokens  # the n samples share one prompt
                self.completion_tokens += sum(d.stats.completion_tokens for d in done)

    def render(self, kv_blocks: tuple[int, int] | None) -> str:
        def family(name: str, kind: str, help_: str, rows: list[str]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *rows]

        with self.lock:
            out = family("llmlocal_requests_total", "counter", "HTTP requests answered, by path and status.",
                         [f'llmlocal_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())])
            out += family("llmlocal_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                          [f"llmlocal_prompt_tokens_total {self.prompt_tokens}"])
            out += family("llmlocal_completion_tokens_total", "counter", "Tokens generated.",
                          [f"llmlocal_completion_tokens_total {self.completion_tokens}"])
            out += family("llmlocal_time_to_first_token_seconds", "histogram", "Request arrival to first token.",
                          self.ttft.lines("llmlocal_time_to_first_token_seconds"))
            out += family("llmlocal_inter_token_latency_seconds", "histogram", "Time between two tokens of a reply.",
                          self.itl.lines("llmlocal_inter_token_latency_seconds"))
        if kv_blocks is not None:
            out += family("llmlocal_kv_blocks_used", "gauge", "KV cache blocks held by running requests.", [f"llmlocal_kv_blocks_used {kv_blocks[0]}"])
            out += family("llmlocal_kv_blocks_total", "gauge", "KV cache blocks in the pool.", [f"llmlocal_kv_blocks_total {kv_blocks[1]}"])
        return "\n".join(out) + "\n"
