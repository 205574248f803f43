"""The paged backend end to end: continuous batching, preemption, prefix caching, limits."""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np
import pytest

from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams
from llmlocal.engine.model.sparse_linear import SparseInt4Projection
from llmlocal.engine.model.config import UnsupportedArchitectureError
from llmlocal.models.errors import LLMLocalError

PROMPTS = [
    "What color is the sky on a clear day?",
    "Name three fruits.",
    "Write the numbers from 1 to 20, separated by commas.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Describe a cat in one sentence.",
]


def reply(engine: Engine, prompt: str, max_tokens: int) -> DoneEvent:
    done = None
    for event in engine.generate(Request.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens))):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def replies_together(engine: Engine, prompts: list[str], max_tokens: list[int]) -> list[DoneEvent]:
    results: list[DoneEvent | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        start.wait()
        results[i] = reply(engine, prompts[i], max_tokens[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def fp32_engine() -> Iterator[Engine]:
    with Engine.load(Plan(backend="paged", n_ctx=1024, weights="dense", dtype="fp32", max_batch=16)) as e:
        yield e


def test_sixteen_concurrent_requests_equal_each_alone(fp32_engine: Engine) -> None:
    prompts = (PROMPTS * 2)[:16]
    lengths = [8 + 3 * i for i in range(16)]  # ragged: sequences leave the batch at different steps
    alone = [reply(fp32_engine, p, n).text for p, n in zip(prompts, lengths)]
    together = replies_together(fp32_engine, prompts, lengths)
    assert [d.text for d in together] == alone
    # they were batched: the pool held several sequences at once
    assert max(d.stats.kv_blocks_used for d in together) > 4


def test_preemption_under_a_small_pool_gives_the_same_tokens() -> None:
    # 12 blocks of 16 tokens: each request needs ~4, so 6 cannot run at once.
    with Engine.load(Plan(backend="paged", n_ctx=256, weights="dense", dtype="fp32", kv_blocks=12, max_batch=8)) as e:
        prompts = PROMPTS[:6]
        alone = [reply(e, p, 24).text for p in prompts]
        together = replies_together(e, prompts, [24] * 6)
        assert [d.text for d in together] == alone
        assert e.backend.blocks.num_used_blocks == 0  # nothing leaked
        e.backend.blocks.check_invariants()


def test_follow_up_turn_hits_the_prefix_cache(fp32_engine: Engine) -> None:
    history = [{"role": "user", "content": "Tell me about the moon. " * 20}]
    first = reply(fp32_engine, history[0]["content"], 16)
    follow = history + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter, please."}]
    done = None
    for event in fp32_engine.generate(Request.chat(follow, SamplingParams(temperature=0, max_tokens=4))):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    prior = len(fp32_engine.prompt_ids(Request.chat(history)))
    assert done.stats.cached_prompt_tokens >= prior // 16 * 16 - 16


def test_requests_sent_together_compute_their_shared_system_prompt_once(fp32_engine: Engine) -> None:
    # a system prompt longer than a step's budget (512 tokens): the first request computes it
    # over two steps, and the others, arriving meanwhile, wait for its blocks rather than
    # compute them beside it
    system = "You answer questions about this field log. " + " ".join(f"Plot {i} had {i % 7} hares." for i in range(90))
    questions = ["How many hares had plot 3?", "Which plot had six hares?", "Say the first word of the log.", "Count the plots."]

    def chat(q: str) -> Request:
        return Request.chat([{"role": "system", "content": system}, {"role": "user", "content": q}],
                            SamplingParams(temperature=0, max_tokens=6))

    results: list[DoneEvent | None] = [None] * len(questions)
    start = threading.Barrier(len(questions))

    def worker(i: int) -> None:
        start.wait()
        results[i] = [e for e in fp32_engine.generate(chat(questions[i])) if isinstance(e, DoneEvent)][0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    together: list[DoneEvent] = results  # type: ignore[assignment]
    shared = len(fp32_engine.prompt_ids(Request.chat([{"role": "system", "content": system}])))
    assert shared > 600
    computed = [d.stats.prompt_tokens - (d.stats.cached_prompt_tokens or 0) for d in together]
    # each prompt's own rows: its question, and the blocks of 16 the shared ones end in
    own = max(d.stats.prompt_tokens for d in together) - shared // 16 * 16
    first, *rest = sorted(computed, reverse=True)
    assert first >= shared and all(c <= own for c in rest), computed
    alone = [[e for e in fp32_engine.generate(chat(q)) if isinstance(e, DoneEvent)][0].text for q in questions]
    assert [d.text for d in together] == alone


def test_a_request_that_can_never_fit_is_refused_with_the_numbers() -> None:
    with Engine.load(Plan(backend="paged", n_ctx=1024, kv_blocks=4)) as e:
        request = Request.chat([{"role": "user", "content": "word " * 100}], SamplingParams(max_tokens=10))
        with pytest.raises(LLMLocalError, match=r"needs \d+ KV blocks of 16 tokens .* has 4"):
            e.generate(request).__next__()


def test_an_architecture_the_paged_engine_lacks_suggests_llamacpp(make_gguf) -> None:
    path = make_gguf(arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="--backend llamacpp"):
        Engine.load(Plan(backend="paged", model=str(path)))


def test_hf_checkpoint_runs_in_the_paged_backend_by_default(tmp_path) -> None:
    import json

    from tiny_llama import write_checkpoint

    write_checkpoint(tmp_path)
    # a byte-level BPE tokenizer over the tiny vocabulary: enough to run text through it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(ord("!"), ord("!") + 94))}
    vocab["<eos>"] = 94
    vocab["Ġ"] = 95
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with Engine.load(Plan(model=str(tmp_path), n_ctx=128)) as e:
        assert e.backend_name == "paged"
        done = None
        for event in e.generate(Request(prompt="hello world", sampling=SamplingParams(temperature=0, max_tokens=5))):
            if isinstance(event, DoneEvent):
                done = event
        assert done is not None and done.stats.completion_tokens + (done.finish_reason == "stop") >= 1


def test_parallel_samples_share_the_prompt_blocks(fp32_engine: Engine) -> None:
    prompt = [{"role": "user", "content": "Tell me about rivers and mountains. " * 12}]
    n_prompt = len(fp32_engine.prompt_ids(Request.chat(prompt)))
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=4)
    done = [e for e in fp32_engine.generate(Request.chat(prompt, p)) if isinstance(e, DoneEvent)]
    assert sorted(d.index for d in done) == [0, 1, 2, 3]
    peak = max(d.stats.kv_blocks_used for d in done)
    prompt_blocks = -(-n_prompt // 16)
    # four private copies would need 4 x prompt_blocks; shared, only the tails differ
    assert peak <= prompt_blocks + 4 * 2 < 4 * prompt_blocks
    assert fp32_engine.backend.blocks.num_used_blocks == 0
    fp32_engine.backend.blocks.check_invariants()


def test_sixteen_concurrent_requests_equal_each_alone_with_int4_weights() -> None:
    """The default on the CPU: INT4 projections in the native kernels, one sequence's decode
    step in one native call, batches through the torch layers: the same greedy tokens, except
    where the model is split between two tokens. The starter's output head (its Q8_0 bytes)
    rounds its input to int8, so a float-rounding difference between the batched and single
    paths can move a logit by about 0.01: a reply may part from its lone twin only at a token
    whose two best candidates are that close (a batching bug parts them anywhere)."""
    with Engine.load(Plan(backend="paged", n_ctx=1024, max_batch=16)) as e:
        assert isinstance(e.backend.runner.model.layers[0].qkv, SparseInt4Projection)
        prompts = (PROMPTS * 2)[:16]
        lengths = [8 + 3 * i for i in range(16)]
        alone = [reply(e, p, n).text for p, n in zip(prompts, lengths)]
        together = [d.text for d in replies_together(e, prompts, lengths)]
        differ = [i for i in range(16) if together[i] != alone[i]]
        assert len(differ) <= 8, differ  # a batching bug parts most of them; near-ties are few
        for i in differ:
            request = Request.chat([{"role": "user", "content": prompts[i]}], SamplingParams(temperature=0))
            prompt = e.prompt_ids(request)
            ids_alone, ids_together = e.tokenize(alone[i], False), e.tokenize(together[i], False)
            k = next(j for j, (a, b) in enumerate(zip(ids_alone, ids_together)) if a != b)
            row = e.backend.log_probs(prompt + ids_alone[: k + 1])[len(prompt) + k - 1]
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] < 0.05, (i, k, top2)
        print("replies parted from their lone twins at near-ties:", differ)


def test_threads_reach_the_native_kernels() -> None:
    """--threads N sizes the native kernels' pool too, not only torch's."""
    from llmlocal.native.cpu import runtime

    before = runtime.num_threads()
    try:
        with Engine.load(Plan(backend="paged", n_ctx=256, threads=1)) as e:
            assert runtime.num_threads() == 1
            assert reply(e, "Say hello.", 4).stats.completion_tokens == 4
    finally:
        runtime.set_num_threads(before)
