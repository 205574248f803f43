"""A real GGUF file's prompt, cold and warm: on a CPU with AMX-BF16 its rows take the bfloat16
tiles while generated tokens take the int8 kernels, and a prompt's rows must come out the same
however much of it the cache held (every prompt row takes the tiles, in a chunk of any size).
Elsewhere a resumed prompt's last few tokens are decode rows (native attention), where the cold
prompt computed them as prompt rows (torch's attention, whose rows depend on the rows beside
them): there a warm reply may differ from the cold one at a near tie (a Zen 3 host: the first of
the three prompts, its first token), which is expected to fail, not hidden. Qwen2.5-Coder 0.5B
Q4_K_M (Q5_0 / Q8_0 / Q4_K / Q6_K); set LLMLOCAL_REAL_MODELS=1 after
`../shared/models/fetch-real-models.sh --small`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams, TokenEvent
from llmlocal.native.cpu import runtime

DIR = Path(os.environ.get("LLMLOCAL_DEV_MODELS", Path.home() / ".cache" / "llmlocal-dev"))
Q05 = DIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("LLMLOCAL_REAL_MODELS") != "1", reason="set LLMLOCAL_REAL_MODELS=1 to run"),
    pytest.mark.skipif(not Q05.is_file(), reason="run ../shared/models/fetch-real-models.sh --small"),
]

FACTS = ("You are a careful assistant. Here is a list of facts to keep in mind: the sky is blue, "
         "grass is green, water boils at 100 degrees Celsius at sea level, and the moon orbits the "
         "earth about every 27 days. ") * 3
PROMPTS = [FACTS + q for q in ("What did I say about the moon? Answer in detail.", "Which facts are about colours?",
                               "Summarise the list in one sentence, then say which fact is the odd one out.")]


def greedy(engine: Engine, content: str) -> DoneEvent:
    done = None
    request = Request.chat([{"role": "user", "content": content}], SamplingParams(temperature=0, max_tokens=40))
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def test_a_prompts_reply_is_the_same_cold_warm_and_from_disk(tmp_path: Path) -> None:
    def plan(directory: Path | None) -> Plan:
        return Plan(model=str(Q05), backend="paged", device="cpu", n_ctx=1024, max_batch=4,
                    kv_cache_dir=str(directory) if directory else None)

    with Engine.load(plan(None)) as e:
        without = [greedy(e, p).text for p in PROMPTS]
    with Engine.load(plan(tmp_path)) as e:
        cold = [greedy(e, p).text for p in PROMPTS]
        warm = [greedy(e, p) for p in PROMPTS]
    with Engine.load(plan(tmp_path)) as e:  # a new engine: the blocks come from the disk
        disk = [greedy(e, p) for p in PROMPTS]
    # every whole block of each prompt cached: tails of 5 to 15 tokens computed (197, 191, 204 tokens)
    assert all(r.stats.prompt_tokens - 16 < r.stats.cached_prompt_tokens < r.stats.prompt_tokens for r in warm + disk)
    assert without == cold  # two cold runs
    assert [w.text for w in warm] == [d.text for d in disk]  # the same blocks cached, from memory or disk
    if cold != [w.text for w in warm] and not runtime.qmat_tiles():
        pytest.xfail("without the bfloat16 tiles a resumed prompt's tail is decode rows (see the module's docstring)")
    assert cold == [w.text for w in warm], f"prompt rows in bfloat16 tiles: {runtime.qmat_tiles()}"


def first_logprob(engine: Engine, content: str) -> tuple[float, int, int]:
    """The first token's log-probability, the token, and how many prompt tokens were cached."""
    request = Request.chat([{"role": "user", "content": content}], SamplingParams(temperature=0, max_tokens=1, logprobs=1))
    first = None
    for event in engine.generate(request):
        if isinstance(event, TokenEvent) and event.logprobs and first is None:
            first = event.logprobs[0]
        if isinstance(event, DoneEvent):
            cached = event.stats.cached_prompt_tokens
    assert first is not None
    return first.logprob, first.token, cached


def test_a_short_resumed_tail_takes_the_tiles_as_the_cold_prompt_did() -> None:
    """A prompt resumed with at most a few new tokens (here 1 to 15 after its cached blocks): on
    the tiles those tokens are a prompt's rows however few they are, not decode rows (the path a
    few tokens after a context otherwise take, for speculative verification), so its first
    token's log-probability is the cold run's to the bit."""
    if not runtime.qmat_tiles():
        pytest.skip("this CPU has no AMX-BF16 tiles: prompt rows take the int8 kernels and float32 attention")
    endings = ["Why?", "Which fact is about the moon?", "Say it again, in other words, please.", "Answer in one word."]
    with Engine.load(Plan(model=str(Q05), backend="paged", device="cpu", n_ctx=1024)) as e:
        tails = set()
        for ending in endings:
            cold = first_logprob(e, FACTS + ending)
            warm = first_logprob(e, FACTS + ending)
            tails.add(len(e.prompt_ids(Request.chat([{"role": "user", "content": FACTS + ending}]))) - warm[2])
            assert warm[:2] == cold[:2], (ending, warm, cold)
    assert min(tails) <= 8, tails  # tails short enough to have been decode rows
