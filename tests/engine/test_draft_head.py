"""A draft model's head over part of the vocabulary (`DraftHead`), on the starter model: the
first ids computed as the full head computes them, the tokens it is told of beside them, -inf
elsewhere; and speculative decoding with such a draft still gives plain greedy's tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from llmlocal.engine import DoneEvent, Engine, Grammar, Plan, Request, SamplingParams, TokenEvent
from llmlocal.engine.backends import paged_setup
from llmlocal.engine.model import draft_head
from llmlocal.engine.model.draft_head import DraftHead
from llmlocal.engine.model.fast_decode import native_int4, native_quant
from llmlocal.engine.model.loader import load_gguf
from llmlocal.models import resolve

PREFIX = 4096  # of the starter's 49,152 ids
PROMPT = "Name three colours of the rainbow."


@pytest.fixture
def small_head(monkeypatch):
    monkeypatch.setattr(paged_setup, "DRAFT_HEAD_IDS", PREFIX)


def load(prefix: int | None) -> torch.nn.Module:
    model = resolve(None)
    if prefix is None:  # the draft's network as a target loads it: the whole head
        cpu = torch.device("cpu")
        return load_gguf(model.spec, cpu, torch.float32, "auto", max_position=512, int4=native_int4(cpu, torch.float32),
                         quant=native_quant(cpu, torch.float32, model.spec))
    # the file's own types: the cut head computes its rows as the whole head does
    return paged_setup.load_draft(model, torch.device("cpu"), torch.float32, 512, weights="file")


def test_head_computes_its_prefix_and_the_tokens_it_was_told_of(small_head) -> None:
    full, cut = load(None), load(PREFIX)
    head = cut.lm_head
    assert isinstance(head, DraftHead) and head.prefix_ids == PREFIX
    h = torch.randn(3, head.rows.width)
    want = full.logits(h)
    got = cut.logits(h)
    assert got.shape == want.shape
    torch.testing.assert_close(got[:, :PREFIX], want[:, :PREFIX], rtol=0, atol=0)  # the same kernels, the same rows
    assert torch.isneginf(got[:, PREFIX:]).all()

    rare = [PREFIX, 20_000, 49_151]
    head.include(rare + [7, 20_000])  # ids in the prefix and repeats change nothing
    assert sorted(head.extra_ids.tolist()) == rare
    got = cut.logits(h)
    # float rows and float activations, against the kernels' int8 activations: close, not equal
    torch.testing.assert_close(got[:, rare], want[:, rare], rtol=0.02, atol=0.05)
    others = torch.ones(got.shape[1], dtype=torch.bool)
    others[:PREFIX] = False
    others[rare] = False
    assert torch.isneginf(got[:, others]).all()


def test_head_keeps_at_most_its_room_of_extra_rows(small_head, monkeypatch) -> None:
    monkeypatch.setattr(draft_head, "MAX_EXTRA_ROWS", 5)
    head = load(PREFIX).lm_head
    head.include(range(PREFIX, PREFIX + 3))
    head.include(range(PREFIX + 10, PREFIX + 20))
    assert head.extra_ids.tolist() == [PREFIX, PREFIX + 1, PREFIX + 2, PREFIX + 10, PREFIX + 11]
    assert head.extra.shape == (5, head.rows.width)
    assert math.isfinite(float(head(torch.randn(1, head.rows.width))[0, PREFIX + 11]))


def test_greedy_with_a_cut_head_draft_equals_plain_greedy(small_head) -> None:
    plan = Plan(backend="paged", n_ctx=512, max_batch=2)
    request = Request.chat([{"role": "user", "content": PROMPT}], SamplingParams(temperature=0, max_tokens=40))

    def tokens(e: Engine) -> list[int]:
        return [t for ev in e.generate(request) if isinstance(ev, TokenEvent) for t in ev.token_ids]

    with Engine.load(plan) as e:
        prompt = e.prompt_ids(request)
        expected = tokens(e)
    with Engine.load(plan.replace(draft="smollm2-135m", draft_k=3)) as e:
        assert tokens(e) == expected
        head = e.backend.drafter.head  # type: ignore[attr-defined]
        assert isinstance(head, DraftHead)
        # the text's rarer tokens may be drafted: all but those of the last step (up to draft_k + 1
        # tokens, chosen after the last draft)
        rare = {t for t in prompt + expected[:-4] if t >= PREFIX}
        assert rare and rare <= set(head.extra_ids.tolist())


def test_a_grammar_that_allows_only_tokens_the_head_lacks_stops_the_draft(monkeypatch) -> None:
    """With a head of the first 16 ids, a choice of words not in the prompt leaves the draft no
    allowed token at most steps: it stops proposing there (it proposed a forbidden token, 6 of 7
    rejected, before; drawing a sampled token from no allowed token fails), and the reply is the
    target's. Draft and target are the same file here, so what the draft does propose is kept."""
    monkeypatch.setattr(paged_setup, "DRAFT_HEAD_IDS", 16)
    plan = Plan(backend="paged", n_ctx=512, max_batch=2)
    grammar = Grammar("choice", json.dumps(["Photosynthesis in green leaves", "Volcanic eruptions underwater"]))

    def reply(e: Engine, params: SamplingParams) -> DoneEvent:
        events = list(e.generate(Request.chat([{"role": "user", "content": "Pick one."}], params)))
        done = events[-1]
        assert isinstance(done, DoneEvent)
        return done

    greedy = SamplingParams(temperature=0, max_tokens=20, grammar=grammar)
    with Engine.load(plan) as e:
        expected = reply(e, greedy).text
    with Engine.load(plan.replace(draft="smollm2-135m", draft_k=3, draft_weights="file")) as e:
        done = reply(e, greedy)
        assert done.text == expected
        assert done.stats.drafted_tokens == done.stats.accepted_tokens
        sampled = reply(e, SamplingParams(temperature=0.9, seed=3, max_tokens=20, grammar=grammar))
        assert sampled.text in ("Photosynthesis in green leaves", "Volcanic eruptions underwater")


def test_a_drafts_wider_tensors_run_as_q4_0() -> None:
    # The starter's Q4_1 projections (5 bits a weight) and its Q8_0 head as Q4_0 by default; as
    # stored with draft_weights "file". A Q4_K tensor (4.5 bits) would stay as it is.
    from llmlocal.native.cpu.qlayout import Q4_0, Q4_1, Q8_0

    draft, cpu = resolve(None), torch.device("cpu")

    def qtypes(net: torch.nn.Module) -> set[int]:
        return {t for m in net.modules() for t in getattr(getattr(m, "kernel", None), "qtypes", [])}

    auto = paged_setup.load_draft(draft, cpu, torch.float32, 256)
    assert qtypes(auto) == {Q4_0}
    assert qtypes(auto.lm_head) == {Q4_0}  # the head too (the starter's is Q8_0)
    stored = paged_setup.load_draft(draft, cpu, torch.float32, 256, weights="file")
    assert qtypes(stored) == {Q4_1, Q8_0}
    assert sum(p.nbytes for m in auto.modules() for p in getattr(getattr(m, "kernel", None), "packed", [])) < \
        0.92 * sum(p.nbytes for m in stored.modules() for p in getattr(getattr(m, "kernel", None), "packed", []))


def test_a_4bit_draft_takes_the_int8_kernels(tmp_path) -> None:
    # A file of 4-bit tensors alone runs on the INT4 kernels of fp32 activations as a target on
    # AVX-512 (its numbers independent of batching); as a draft, whose numbers only propose,
    # always on the faster int8 kernels.
    from llmlocal.engine.model.sparse_linear import QuantProjection
    from llmlocal.quant.synthetic import random_gguf

    path = random_gguf(tmp_path / "draft-q4_0.gguf", shape="smollm2-135m", qtype="q4_0")
    draft = resolve(str(path))
    cpu = torch.device("cpu")
    as_target = load_gguf(draft.spec, cpu, torch.float32, "auto", max_position=256, int4=native_int4(cpu, torch.float32),
                          quant=native_quant(cpu, torch.float32, draft.spec, mode="fp32"))
    as_draft = paged_setup.load_draft(draft, cpu, torch.float32, 256)

    def kinds(net: torch.nn.Module) -> set[str]:
        return {type(m).__name__ for m in net.modules() if isinstance(m, torch.nn.Module) and "Projection" in type(m).__name__}

    assert kinds(as_draft) == {QuantProjection.__name__}
    assert QuantProjection.__name__ not in kinds(as_target)
