"""A decoded token's numbers do not depend on a prompt computed in the same step: the paged
engine runs a step's decode rows natively, as in a step of their own, and the prompt's chunk
through the prompt path beside them (`FastDecode._mixed`). Through the torch layers together,
the decode row's floats would depend on the rows beside it. The starter model: a request
decoding alone against the same request while another's prompt arrives mid-reply."""

from __future__ import annotations

import threading

from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams, TokenEvent

ASK = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
OTHER = [{"role": "user", "content": "Summarise the following notes. " + "The tide was high, the lamp was lit. " * 40}]


def logprobs(engine: Engine, messages: list[dict[str, str]], max_tokens: int, started: threading.Event | None = None) -> list[float]:
    request = Request.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1))
    out: list[float] = []
    for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            out.extend(lp.logprob for lp in event.logprobs)
            if started is not None and len(out) >= 8:
                started.set()
        elif isinstance(event, DoneEvent):
            break
    return out


def test_a_prompt_arriving_mid_reply_leaves_the_decoded_tokens_unchanged() -> None:
    with Engine.load(Plan(backend="paged", n_ctx=1024, max_batch=4)) as e:
        logprobs(e, ASK, 48)  # the prompt cached: every run below resumes it alike
        alone = logprobs(e, ASK, 48)
        started = threading.Event()
        together: list[float] = []
        reader = threading.Thread(target=lambda: together.extend(logprobs(e, ASK, 48, started)))
        reader.start()
        assert started.wait(60)
        other = logprobs(e, OTHER, 1)  # its prompt is computed in steps beside the reply's decode rows
        reader.join(60)
        assert other and len(together) == len(alone) == 48
        assert together == alone  # to the bit
