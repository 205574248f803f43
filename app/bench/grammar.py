"""`llmlocal bench grammar`: what constrained decoding costs, against the same engine free.

A nested JSON schema (a list of records) on a prompt that asks for it, at batch 1 and 8
(eight concurrent requests, aggregate tokens per second, wall clock from the first request to
the last reply). Each constrained run is followed by a free run of the same prompts that
generates as many tokens (``ignore_eos``), so the two compare equal work; they take turns for
``rounds`` rounds and the ratio is the median of the per-round ratios. The figure to read is
`ratio`: constrained tok/s over free tok/s (1.0: the grammar costs nothing).
"""

from __future__ import annotations

import statistics
from typing import Any

from llmlocal.engine.engine import Engine
from llmlocal.engine.plan import Plan
from llmlocal.engine.types import DoneEvent, Grammar, Request, SamplingParams

from .scenarios import all_at_once

PROMPT = "List six programming languages as JSON: for each, its name, the year it appeared and who created it."
SCHEMA = {
    "type": "object",
    "properties": {
        "languages": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "year": {"type": "integer", "minimum": 1940, "maximum": 2030},
                    "creator": {"type": "string", "maxLength": 40},
                    "paradigm": {"enum": ["imperative", "functional", "object-oriented", "logic", "multi-paradigm"]},
                },
                "required": ["name", "year", "creator", "paradigm"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["languages"],
    "additionalProperties": False,
}


def _batch(engine: Engine, sampling: list[SamplingParams]) -> tuple[float, list[int]]:
    """Send one request per sampling at once; (aggregate tok/s, each reply's token count)."""
    results: list[DoneEvent | None] = [None] * len(sampling)

    def one(i: int) -> None:
        request = Request.chat([{"role": "user", "content": PROMPT}], sampling[i])
        results[i] = [e for e in engine.generate(request) if isinstance(e, DoneEvent)][-1]

    wall = all_at_once(one, len(sampling))
    counts = [r.stats.completion_tokens for r in results if r is not None]
    return sum(counts) / wall, counts


def bench_grammar(
    model: str | None, backends: list[str], *, batches: tuple[int, ...] = (1, 8), rounds: int = 3,
    max_tokens: int = 256, threads: int | None = None,
) -> dict[str, Any]:
    """Per backend and batch size: constrained and free tok/s and their ratio."""
    grammar = Grammar.json_schema(SCHEMA)
    out: dict[str, Any] = {}
    for backend in backends:
        plan = Plan(model=model, backend=backend, n_ctx=2048, threads=threads, max_batch=max(batches))
        with Engine.load(plan) as engine:
            _batch(engine, [SamplingParams(temperature=0, max_tokens=8, grammar=grammar)])  # builds the vocabulary's masks
            for batch in batches:
                ratios, constrained, free = [], [], []
                for r in range(rounds):
                    seeds = [1000 * r + i for i in range(batch)]
                    rate, counts = _batch(
                        engine, [SamplingParams(temperature=0.7, seed=s, max_tokens=max_tokens, grammar=grammar) for s in seeds]
                    )
                    free_rate, _ = _batch(
                        engine, [SamplingParams(temperature=0.7, seed=s, max_tokens=n, ignore_eos=True) for s, n in zip(seeds, counts)]
                    )
                    constrained.append(rate)
                    free.append(free_rate)
                    ratios.append(rate / free_rate)
                out[f"{engine.backend_name} batch {batch}"] = {
                    "constrained_tok_s": statistics.median(constrained),
                    "free_tok_s": statistics.median(free),
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
    out["rounds"] = rounds
    return out
