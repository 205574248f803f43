"""`Engine.prefill` on the real starter model: a prompt computed ahead is what a request
starting with it reuses; a prefill cancelled before it starts computes nothing; one that
would not leave room for a reply is skipped; llama.cpp's stops between its batches."""

from __future__ import annotations

import threading

from llmlocal.engine import DoneEvent, Engine, Request, SamplingParams

TEXT = " ".join(f"Step {i}: mix {i} grams of flour with {2 * i} of water." for i in range(30))


def reply(engine: Engine, messages: list[dict[str, str]]) -> DoneEvent:
    events = engine.generate(Request.chat(messages, SamplingParams(temperature=0, max_tokens=4)))
    return [e for e in events if isinstance(e, DoneEvent)][0]


def test_a_prefilled_prompt_is_reused_and_not_computed_twice(engine: Engine) -> None:
    draft = [{"role": "user", "content": "Prefill check. " + TEXT}]
    computed = engine.prefill(Request.chat(draft))
    assert computed > 300
    assert engine.prefill(Request.chat(draft)) == 0  # already there
    done = reply(engine, [{"role": "user", "content": "Prefill check. " + TEXT + " How much flour in step 2?"}])
    assert done.stats.cached_prompt_tokens >= computed - 8  # the draft's tokens, up to where the texts part


def test_a_cancelled_or_oversized_prefill_computes_nothing(engine: Engine) -> None:
    stop = threading.Event()
    stop.set()
    assert engine.prefill(Request.chat([{"role": "user", "content": "Cancelled. " + TEXT}]), stop) == 0
    done = reply(engine, [{"role": "user", "content": "Cancelled. " + TEXT}])
    assert done.stats.cached_prompt_tokens < 40  # the chat template's start at most
    too_long = [{"role": "user", "content": TEXT * 12}]  # over the 2,048-token window
    assert engine.prefill(Request.chat(too_long)) == 0


def test_llamacpp_stops_a_long_prefill_between_its_batches(engine: Engine) -> None:
    stop = threading.Event()
    long = [{"role": "user", "content": "Stopped midway. " + TEXT * 4}]  # about 1,700 tokens
    total = engine.count_tokens(long) - 1
    n_batch = engine.backend._llm.n_batch  # type: ignore[attr-defined]
    assert total > 2 * n_batch
    timer = threading.Timer(0.01, stop.set)
    timer.start()
    computed = engine.prefill(Request.chat(long), stop)
    timer.join()
    assert computed <= n_batch < total  # the batch under way when it was stopped, at most
