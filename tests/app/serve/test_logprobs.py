"""Logprobs through the engine and `llmlocal serve`: each generated token's log-probability
and its likeliest alternatives, checked against the engine's teacher-forced `log_probs` of
the same tokens, on both backends and through the real `openai` client."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest
from test_serve import QUESTION, served  # noqa: F401 - `served` is a fixture
from llmlocal.app.serve.server import OpenAIServer
from llmlocal.engine import DoneEvent, Engine, Grammar, Plan, Request, SamplingParams, TokenEvent

# Decoding one token at a time and scoring the whole sequence at once round differently (the
# paged engine rounds activations to int8 per 32 inputs, and computes a prompt's attention in
# bfloat16 where the CPU has AVX512-BF16 or AMX tiles, a decode step's in float32: on a Zen 5 the
# starter's logprobs parted by up to 0.123; llama.cpp batches a scored sequence): a token's
# logprob agrees to this much.
TOLERANCE = {"paged": 0.15, "llamacpp": 0.1}


@pytest.fixture(scope="module", params=["paged", "llamacpp"])
def local(request: pytest.FixtureRequest) -> Iterator[Engine]:
    with Engine.load(Plan(backend=request.param, n_ctx=1024)) as e:
        yield e


def test_logprobs_match_the_engines_teacher_forced_scores(local: Engine) -> None:
    request = Request.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12, logprobs=4))
    events = list(local.generate(request))
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    streamed = [lp for e in events if isinstance(e, TokenEvent) for lp in e.logprobs]
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.logprobs == tuple(streamed)
    assert [lp.token for lp in streamed] == tokens and len(tokens) == 12
    prompt = local.prompt_ids(request)
    reference = local.log_probs(prompt + tokens)
    for i, lp in enumerate(streamed):
        row = reference[len(prompt) - 1 + i]
        assert lp.logprob <= 0 and abs(lp.logprob - float(row[lp.token])) < TOLERANCE[local.backend_name]
        assert len(lp.top) == 4 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0][0] == lp.token  # greedy: the token taken is the likeliest
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)


def test_logprobs_are_the_models_not_the_grammars(local: Engine) -> None:
    # a choice the model finds unlikely: its logprob stays the model's, below the grammar's 0
    sampling = SamplingParams(temperature=0, max_tokens=4, logprobs=0, grammar=Grammar.choice(["zebra"]))
    done = list(local.generate(Request.chat(QUESTION, sampling)))[-1]
    assert isinstance(done, DoneEvent) and done.text == "zebra"
    assert done.logprobs and all(lp.top == () for lp in done.logprobs) and sum(lp.logprob for lp in done.logprobs) < -1


def test_openai_client_chat_and_completion_logprobs(served: OpenAIServer) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=8,  # type: ignore[arg-type]
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 3 and bytes(c.bytes or []).decode() == c.token for c in content)
    chunks = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=8,  # type: ignore[arg-type]
                                            logprobs=True, stream=True)
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content or []]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    text = client.completions.create(model="smollm2-135m", prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=2)
    lp = text.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == text.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(len(lp.tokens or []))]
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs or [], lp.token_logprobs or []))
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, top_logprobs=2)  # type: ignore[arg-type]
