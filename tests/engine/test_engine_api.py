"""The Engine API on the real starter model, for every local backend (same tests, same bar)."""

from __future__ import annotations

import math
import threading
from typing import Iterator

import pytest
from llmlocal.engine import ContextOverflowError, DoneEvent, Engine, Plan, Request, SamplingParams, TokenEvent

GREEDY = SamplingParams(temperature=0, max_tokens=48)
BACKENDS = ["llamacpp", "paged"]


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The starter model in each backend (this module's own, overriding the shared fixture)."""
    with Engine.load(Plan(backend=request.param, n_ctx=2048)) as e:
        yield e
QUESTION = [{"role": "user", "content": "What color is the sky on a clear day?"}]
LONG = [{"role": "user", "content": "Write the numbers from 1 to 300, separated by commas."}]
# Tokens a backend may still produce once cancel() returned: the step under way and what a
# batching backend's scheduler thread has queued (it checks the flag before every step).
MAX_TOKENS_AFTER_CANCEL = 8


def collect(engine: Engine, request: Request) -> tuple[list[TokenEvent], DoneEvent]:
    tokens: list[TokenEvent] = []
    done = None
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
        else:
            assert done is None, "no token may follow the DoneEvent"
            tokens.append(event)
    assert done is not None
    return tokens, done


def test_greedy_is_deterministic_and_non_empty(engine: Engine) -> None:
    _, a = collect(engine, Request.chat(QUESTION, GREEDY))
    _, b = collect(engine, Request.chat(QUESTION, GREEDY))
    assert a.text.strip()
    assert a.text == b.text
    assert "blue" in a.text


def test_streamed_text_and_stats_are_consistent(engine: Engine) -> None:
    tokens, done = collect(engine, Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12)))
    assert "".join(t.text for t in tokens) == done.text
    ids = [i for t in tokens for i in t.token_ids]
    s = done.stats
    assert s.completion_tokens == len(ids) == 12
    assert done.finish_reason == "length"
    assert s.prompt_tokens == len(engine.prompt_ids(Request.chat(QUESTION)))
    assert s.ttft_s is not None and s.ttft_s > 0
    assert s.decode_tok_s is not None and s.decode_tok_s > 0
    assert s.itl_ms_p50 is not None and 0 < s.itl_ms_p50 <= s.itl_ms_p95
    assert s.total_s >= s.ttft_s
    assert (s.backend, s.device, s.n_ctx) == (engine.backend_name, "cpu", engine.n_ctx)


def test_model_stop_ends_with_reason_stop(engine: Engine) -> None:
    _, done = collect(engine, Request.chat([{"role": "user", "content": "Say OK."}], SamplingParams(temperature=0, max_tokens=200)))
    assert done.finish_reason == "stop"
    assert done.stats.completion_tokens < 200
    assert "<|im_end|>" not in done.text


def test_stop_string_ends_generation_and_is_excluded(engine: Engine) -> None:
    _, free = collect(engine, Request.chat(QUESTION, GREEDY))
    word = free.text.split()[2]  # a word from the middle of the unconstrained reply
    tokens, done = collect(engine, Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=48, stop=(word,))))
    assert done.finish_reason == "stop"
    assert word not in done.text
    assert free.text.startswith(done.text)
    assert "".join(t.text for t in tokens) == done.text


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, max_tokens=24)
    _, a = collect(engine, Request.chat(QUESTION, p))
    _, b = collect(engine, Request.chat(QUESTION, p))
    assert a.text == b.text
    texts = {collect(engine, Request.chat(QUESTION, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0, seed=s, max_tokens=24)))[1].text for s in range(4)}
    assert len(texts) > 1, "different seeds should give different samples at T=1"


def test_cancel_stops_within_one_token(engine: Engine) -> None:
    request = Request.chat(LONG, SamplingParams(temperature=0, max_tokens=500))
    seen = 0
    done = None
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
            break
        seen += len(event.token_ids)
        if seen == 5:
            engine.cancel(request.id)
    assert done is not None and done.finish_reason == "cancelled"
    assert done.stats.completion_tokens <= 6


def test_cancel_from_another_thread(engine: Engine) -> None:
    """Another thread cancels once the request streams (an event, not a timer); the consumer
    waits for the cancel to be made, so at most the tokens already under way follow it."""
    request = Request.chat(LONG, SamplingParams(temperature=0, max_tokens=1000))
    streaming, cancelled = threading.Event(), threading.Event()

    def canceller() -> None:
        if streaming.wait(120):
            engine.cancel(request.id)
            cancelled.set()

    thread = threading.Thread(target=canceller)
    thread.start()
    seen, at_cancel, done = 0, None, None
    try:
        for event in engine.generate(request):
            if isinstance(event, DoneEvent):
                done = event
                continue
            seen += len(event.token_ids)
            if at_cancel is None and seen >= 5:
                streaming.set()
                assert cancelled.wait(120), "the other thread never cancelled"
                at_cancel = seen
    finally:
        streaming.set()
        thread.join()
    assert done is not None and done.finish_reason == "cancelled"
    assert at_cancel is not None and done.stats.completion_tokens <= at_cancel + MAX_TOKENS_AFTER_CANCEL


def test_follow_up_turn_reuses_the_cached_prefix(engine: Engine) -> None:
    first = [{"role": "user", "content": "Name a colour."}]
    _, a = collect(engine, Request.chat(first, GREEDY))
    follow = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "And another?"}]
    _, b = collect(engine, Request.chat(follow, GREEDY))
    prior = len(engine.prompt_ids(Request.chat(first)))
    # llama.cpp reuses any prefix; the paged engine whole blocks of 16 tokens.
    granularity = 16 if engine.backend_name == "paged" else 1
    assert b.stats.cached_prompt_tokens is not None
    assert b.stats.cached_prompt_tokens >= prior - granularity + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_longer_than_the_context_is_refused_before_streaming(backend: str) -> None:
    with Engine.load(Plan(backend=backend, n_ctx=64)) as small:
        long = [{"role": "user", "content": "word " * 200}]
        with pytest.raises(ContextOverflowError, match=r"context window is 64: shorten it or pass --ctx"):
            small.generate(Request.chat(long))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reply_is_cut_when_the_context_fills(backend: str) -> None:
    with Engine.load(Plan(backend=backend, n_ctx=64)) as small:
        request = Request.chat([{"role": "user", "content": "Tell me a long story."}], SamplingParams(temperature=0))
        _, done = collect(small, request)
        assert done.finish_reason == "context"
        assert done.stats.prompt_tokens + done.stats.completion_tokens == 64


def test_concurrent_requests_are_served_one_after_another(engine: Engine) -> None:
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        _, done = collect(engine, Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16)))
        results[i] = done.text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 3 and len(set(results.values())) == 1


def test_score_agrees_with_greedy_generation(engine: Engine) -> None:
    request = Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))
    prompt = engine.prompt_ids(request)
    tokens, _ = collect(engine, request)
    reply = [i for t in tokens for i in t.token_ids]
    logprobs = engine.score(prompt + reply)
    assert len(logprobs) == len(prompt) + len(reply) - 1
    assert all(lp <= 0 and math.isfinite(lp) for lp in logprobs)
    # Greedy tokens are the most likely ones, so each is far more likely than chance.
    reply_lp = logprobs[len(prompt) - 1 :]
    assert min(reply_lp) > math.log(1 / 1000)
    # Scoring must not corrupt later generation.
    _, again = collect(engine, request)
    assert again.text == "".join(t.text for t in tokens)


def test_log_probs_are_distributions_consistent_with_score(engine: Engine) -> None:
    import numpy as np

    ids = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    lp = engine.log_probs(ids)
    assert lp.shape == (len(ids) - 1, engine.model.spec.vocab_size)
    assert np.allclose(np.exp(lp).sum(axis=1), 1.0, atol=1e-4)
    picked = lp[np.arange(len(ids) - 1), ids[1:]]
    assert np.allclose(picked, engine.score(ids), atol=1e-5)
    # The repeated sentence is predictable the second and third time round.
    n = len(ids) // 3
    assert picked[2 * n :].mean() > picked[: n - 1].mean() + 1.0


def test_parallel_samples(engine: Engine) -> None:
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=12, n=4)
    texts: dict[int, str] = {}
    streamed: dict[int, str] = {0: "", 1: "", 2: "", 3: ""}
    for event in engine.generate(Request.chat(QUESTION, p)):
        if isinstance(event, DoneEvent):
            assert event.index not in texts
            texts[event.index] = event.text
            assert event.stats.completion_tokens <= 12
        else:
            assert event.index not in texts, "no text after a sample's DoneEvent"
            streamed[event.index] += event.text
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts == streamed
    assert len(set(texts.values())) > 1, "independent samples at T=1 should differ"
    # seeded: the same request gives the same four samples
    again = {e.index: e.text for e in engine.generate(Request.chat(QUESTION, p)) if isinstance(e, DoneEvent)}
    assert again == texts


def test_ignore_eos_decodes_exactly_max_tokens(engine: Engine) -> None:
    short = [{"role": "user", "content": "Reply with the single word: yes."}]
    _, ended = collect(engine, Request.chat(short, SamplingParams(temperature=0, max_tokens=64)))
    assert ended.finish_reason == "stop" and ended.stats.completion_tokens < 64
    _, forced = collect(engine, Request.chat(short, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)))
    assert forced.finish_reason == "length" and forced.stats.completion_tokens == 64
    assert forced.text.startswith(ended.text)


def test_our_engines_freeze_what_their_load_made_and_give_it_back_on_close() -> None:
    """The objects a paged load made leave the collector's generations (no collection walks a
    loaded model) until the engine closes; a load that fails freezes nothing."""
    import gc

    from llmlocal.models.errors import LLMLocalError

    before = gc.get_freeze_count()
    with pytest.raises(LLMLocalError):  # fails after the target loaded: the draft is not a model
        Engine.load(Plan(backend="paged", n_ctx=256, draft="no-such-draft-model"))
    assert gc.get_freeze_count() == before
    e = Engine.load(Plan(backend="paged", n_ctx=256))
    assert gc.get_freeze_count() > before
    e.close()
    assert gc.get_freeze_count() == 0


def test_a_planned_model_is_resolved_once_and_loaded_as_resolved() -> None:
    """The planner resolves the model once and the plan carries it (`Plan.resolved`): Engine.load
    takes that object instead of reading the file's header again; a plan for another model drops
    it, and it is not an option a plan file can set."""
    from llmlocal.engine.planning.planner import plan_model
    from llmlocal.models import LLMLocalError

    plan = plan_model("smollm2-135m", base=Plan(model="smollm2-135m", backend="llamacpp", n_ctx=256)).plan
    assert plan.resolved is not None and plan.resolved.name == "smollm2-135m"
    with Engine.load(plan) as engine:
        assert engine.model is plan.resolved
    assert plan.replace(n_ctx=512).resolved is plan.resolved
    assert plan.replace(model="another.gguf").resolved is None
    assert plan.replace(resolved=None) == plan  # not part of what a plan compares
    with pytest.raises(LLMLocalError, match="resolved"):
        Plan.from_dict({"model": "smollm2-135m", "resolved": None})
