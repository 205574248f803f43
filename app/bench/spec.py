"""`llmlocal bench spec`: speculative decoding against the same target decoding alone.

Target: the model at full precision (fp32 weights dequantized from the GGUF), drafted by the
same file as INT4 weight-only, on a story prompt; or, with ``--draft M``, the model as it runs
for a user (its GGUF types in the native kernels on a CPU) drafted by M, on a coding prompt and
(batch 1) on the summarising one. And n-gram prompt lookup on a "summarise this pasted text"
prompt. Greedy by default, so every run produces the same tokens as the target alone and the
speedups compare equal work; with a temperature, sampled as a chat samples (llmlocal's default
top-k, top-p and min-p, seeded), where runs differ in their tokens and the speedups compare
decode speeds. Batch 1 (one request) and batch 8 (eight concurrent requests, aggregate tokens
per second). The three engines take turns (``--rounds``). With a draft model, also a cold
long prompt and a short reply (about 650 tokens of new text each time, 48 tokens, whole
requests timed): there a draft's first proposal would compute the prompt's K/V first, which
the reply may not repay, and drafting must cost nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

from llmlocal.engine.engine import Engine
from llmlocal.engine.plan import Plan
from llmlocal.engine.types import DoneEvent, Request, SamplingParams

from .scenarios import _prompt, all_at_once

STORY = "Write a long story about a lighthouse keeper and the sea."
PASTED = (
    "The river town of Alder Ford grew up around a single stone bridge. Farmers from both "
    "banks crossed it every market day, and the toll paid for the school, the well and the "
    "lamps on the quay. In the wet spring of the flood year the river rose above the arches "
    "for nine days. The bridge held, but the mill below it was lost, and with it the town's "
    "only source of flour. The council voted to rebuild the mill in stone, further from the "
    "water, and to raise the quay by the height of a man. The work took three summers and "
    "most of the town's savings. When it was finished the miller's daughter, who had kept the "
    "accounts through all of it, was elected to the council, the first woman to sit there."
)
SUMMARISE = f"Summarise this text in a few sentences, keeping its key facts:\n\n{PASTED}"
CODE = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
LONG_WORDS, LONG_REPLY = 560, 48  # the cold long prompt (about 650 tokens) and its reply


def _long(seed: int) -> str:
    return f"Here is a list of words:\n{_prompt(LONG_WORDS, seed)}\n\nWrite a Python function that counts each word."


def _generate(engine: Engine, prompt: str, params: SamplingParams) -> DoneEvent:
    done = None
    request = Request.chat([{"role": "user", "content": prompt}], params)
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def _serve(engine: Engine, prompts: list[str], params: SamplingParams) -> dict[str, float]:
    """Run ``prompts`` concurrently; aggregate decode figures."""
    results: list[DoneEvent | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = _generate(engine, prompts[i], params)

    wall = all_at_once(one, len(prompts))
    done = [r for r in results if r is not None]
    tokens = sum(d.stats.completion_tokens for d in done)
    drafted = sum(d.stats.drafted_tokens or 0 for d in done)
    accepted = sum(d.stats.accepted_tokens or 0 for d in done)
    steps = sum(d.stats.target_steps or 0 for d in done)
    if len(done) == 1:  # batch 1: decode speed proper, without the prompt's prefill
        tok_s = done[0].stats.decode_tok_s or 0.0
    else:
        tok_s = tokens / wall
    return {
        "tok_s": tok_s,
        "wall_s": wall,
        "tokens": tokens,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_step": tokens / steps if steps else 1.0,
        "drafted": drafted,
    }


def bench_spec(
    model: str | None, draft: str | None = None, max_tokens: int = 128, batch: int = 8, rounds: int = 1,
    temperature: float = 0.0, draft_weights: tuple[str, ...] = ("auto",),
) -> dict[str, Any]:
    """The three engines (target alone, with the draft model, with n-gram lookup) are loaded
    together and take turns for ``rounds`` rounds, each round in a rotated order, so that a
    shared machine's drift hits them alike; each figure is the median over the rounds and the
    speedups are medians of per-round ratios. ``draft_weights``: the draft engine's
    `Plan.draft_weights`, and for each further value an engine of its own that takes its turn
    too, at batch 1 (its speedups as ``speedup_<value>``)."""
    # Without --draft: the target at full precision, drafted by a 4-bit copy of itself. With a
    # draft model: the target as it runs for a user (its own weights, native kernels on a CPU).
    if draft:
        target = Plan(model=model, backend="paged", n_ctx=2048, max_batch=batch)
    else:
        target = Plan(model=model, backend="paged", weights="dense", dtype="fp32", n_ctx=2048, max_batch=batch)
    plain = CODE if draft else STORY  # a draft model of its own: what small drafts are for
    separate = draft is not None
    draft = draft or model or "smollm2-135m"
    single = {"plain": [plain], "ngram": [SUMMARISE]}
    many = {"plain": [f"{plain} ({i})" for i in range(batch)], "ngram": [f"{SUMMARISE}\n({i})" for i in range(batch)]}
    first, *others = draft_weights
    plans = {"base": target, "draft": target.replace(draft=draft, draft_weights=first), "ngram": target.replace(draft="ngram")}
    plans.update({f"draft@{w}": target.replace(draft=draft, draft_weights=w) for w in others})
    labels = list(plans)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature else None)
    per_round: list[dict[str, dict[str, dict[str, float]]]] = []
    engines: dict[str, Engine] = {}
    try:
        for label, plan in plans.items():
            engines[label] = Engine.load(plan)
            _generate(engines[label], "Hello", SamplingParams(temperature=0, max_tokens=4))  # warm up
        for r in range(rounds):
            figures: dict[str, dict[str, dict[str, float]]] = {}
            for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                engine = engines[label]
                kind = "ngram" if label == "ngram" else "plain"
                runs = {"batch1": _serve(engine, single[kind], params)}
                if label.startswith("draft@"):  # another draft's weights: batch 1, both prompts
                    figures[label] = {**runs, "summarise_batch1": _serve(engine, single["ngram"], params)}
                    continue
                runs[f"batch{batch}"] = _serve(engine, many[kind], params)
                if label == "base":  # the plain target on the n-gram prompts too
                    runs["ngram_batch1"] = _serve(engine, single["ngram"], params)
                    runs[f"ngram_batch{batch}"] = _serve(engine, many["ngram"], params)
                if label == "draft" and separate:  # and a draft model on the summarising prompt
                    runs["summarise_batch1"] = _serve(engine, single["ngram"], params)
                if label in ("base", "draft") and separate:  # a cold long prompt, new text each round
                    # (the same text for both engines: each has a cache of its own, and texts of
                    # their own made the figure a comparison of two prompts' replies)
                    short = SamplingParams(temperature=temperature, max_tokens=LONG_REPLY, seed=params.seed)
                    runs["long_batch1"] = _serve(engine, [_long(r)], short)
                figures[label] = runs
            per_round.append(figures)
    finally:
        for engine in engines.values():
            engine.close()

    def row(figures: dict[str, dict[str, dict[str, float]]], size: str) -> dict[str, float]:
        base, spec, ngram = figures["base"][size], figures["draft"][size], figures["ngram"][size]
        base_ngram = figures["base"][f"ngram_{size}"]
        out = {
            "speedup": spec["tok_s"] / base["tok_s"],
            "acceptance_rate": spec["acceptance_rate"],
            "tokens_per_step": spec["tokens_per_step"],
            "ngram_speedup": ngram["tok_s"] / base_ngram["tok_s"],
            "ngram_acceptance_rate": ngram["acceptance_rate"],
            "ngram_tokens_per_step": ngram["tokens_per_step"],
            "target_tok_s": base["tok_s"],
            "spec_tok_s": spec["tok_s"],
            "drafted_per_step": spec["drafted"] / max(1.0, spec["tokens"] / spec["tokens_per_step"]),
        }
        long = figures["draft"].get(f"long_{size}")
        if long is not None:  # whole requests: the prompt's prefill and any catch-up of the draft
            out["long_prompt_speedup"] = figures["base"][f"long_{size}"]["wall_s"] / long["wall_s"]
            out["long_prompt_drafted"] = long["drafted"]
        summarise = figures["draft"].get(f"summarise_{size}")
        if summarise is not None:
            out["summarise_speedup"] = summarise["tok_s"] / base_ngram["tok_s"]
            out["summarise_acceptance_rate"] = summarise["acceptance_rate"]
        for w in others if size == "batch1" else ():
            other = figures[f"draft@{w}"]
            out[f"speedup_{w}"] = other[size]["tok_s"] / base["tok_s"]
            out[f"acceptance_rate_{w}"] = other[size]["acceptance_rate"]
            out[f"summarise_speedup_{w}"] = other[f"summarise_{size}"]["tok_s"] / base_ngram["tok_s"]
        return out

    def median_row(size: str) -> dict[str, Any]:
        rows = [row(figures, size) for figures in per_round]
        out: dict[str, Any] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        if len(rows) > 1:
            for key in [k for k in rows[0] if k.startswith(("speedup", "summarise_speedup"))]:
                out[f"{key}_per_round"] = [round(r[key], 3) for r in rows]
        return out

    return {
        "scenario": "spec",
        "model": model or "smollm2-135m",
        "draft": draft,
        "rounds": rounds,
        "temperature": temperature,
        **median_row("batch1"),
        f"batch{batch}": median_row(f"batch{batch}"),
    }
