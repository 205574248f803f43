"""The paged engine with a q8_0 KV cache (`--kv-dtype q8_0`) on the starter model: the native
decode step reads it as the torch layers do, greedy text stays with f16's but for near ties,
and the pool's block copies (copy-on-write, the disk tier's payloads) carry the scales."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams
from llmlocal.engine.core.model_runner import StepItem
from llmlocal.engine.core.sequence import Sequence
from llmlocal.engine.model.fast_decode import FastDecode
from llmlocal.native import cpu as si4
from llmlocal.native.paged_attention.kv_quant import dequantize_q8

PROMPTS = [
    "Tell me about the moon.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
]
# A greedy token may differ from f16's only where f16's two best logits are this close. On
# Qwen2.5-Coder-0.5B q8_0 moves a token's log-probability by 0.09 on average against an fp32
# cache (f16: 0.03), by up to ~2 at its worst: 0.25 is a near tie at that scale.
MARGIN = 0.25


def plan(**kw) -> Plan:
    return Plan(backend="paged", device="cpu", n_ctx=1024, max_batch=4, **kw)


@pytest.fixture(scope="module")
def q8() -> Iterator[Engine]:
    # fp32 activations (the starter's on AVX-512): with int8 ones (its default without AVX-512) a
    # K/V value rounded the other way also moves the next layer's int8 inputs, and the rows the
    # two paths write drift further apart than the bound below
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMLOCAL_NATIVE_ACTIVATIONS", "fp32")
        with Engine.load(plan(kv_dtype="q8_0")) as e:
            yield e


def greedy(engine: Engine, content: str, max_tokens: int = 48, logprobs: int | None = None) -> DoneEvent:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    done = None
    for event in engine.generate(Request.chat([{"role": "user", "content": content}], params)):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def tokens(done: DoneEvent) -> list[int]:
    return [lp.token for lp in done.logprobs]


def test_the_pool_is_int8_rows_with_their_scales_and_the_native_step_takes_it(q8: Engine) -> None:
    runner = q8.backend.runner
    cfg = runner.model.cfg
    k, v = runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.int8 and k.shape[1:] == (16, cfg.n_kv_heads, cfg.head_dim + cfg.head_dim // 16)
    assert runner.block_nbytes == 2 * cfg.n_layers * 16 * cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim // 16)
    assert runner.native_rows > 1  # FastDecode attached: the native decode step runs q8_0


@pytest.mark.parametrize("isa", si4.available_isas())
def test_the_native_decode_step_writes_and_reads_q8_as_the_torch_layers(q8: Engine, isa: str) -> None:
    """Step by step over a prompt, from the same cache: the native step (K/V rows quantized in
    C, attention over int8 * scale) and the torch layers (quantized in torch, dequantized before
    attention) write the same rows but for an int8 rounded the other way where the two computed
    a value a last bit apart (at a half step; the layers after it then differ a little more),
    and where they wrote the same rows they give the same logits to float rounding. (One such flip in an early layer moves every later layer's
    rows and the logits by up to ~0.15 on the starter: greedy runs of the two paths drift apart
    at near ties, as f16's do where a key rounds to the neighbouring fp16 value.)"""
    runner = q8.backend.runner
    ids = q8.backend.tokenizer.encode("The moon is Earth's only natural satellite. It orbits the planet about "
                                      "every 27 days and keeps the same face turned towards us all the time. Its pull raises the "
                                      "tides, and its phases run from new moon to full moon and back in about a month.", False)
    seq = Sequence(-1, ids)
    seq.block_table = list(range(1, 1 + -(-len(ids) // 16)))  # the engine is idle: blocks of our own
    first = 8  # 46 steps
    runner.execute([StepItem(seq, 0, first, True)])
    compared = 0
    before = si4.isa()
    si4.set_isa(isa)  # the native step's vector variant (avx512, avx2, scalar: what this machine runs)
    try:
        for pos in range(first, len(ids)):
            slot = seq.block_table[pos // 16] * 16 + pos % 16
            out, rows = {}, {}
            for fast in (True, False):
                FastDecode.enabled = fast
                out[fast], _ = runner.execute([StepItem(seq, pos, 1, True)])
                rows[fast] = [t.view(-1, *t.shape[2:])[slot].clone() for layer in runner.kv_caches for t in layer]
            same = all(torch.equal(a, b) for a, b in zip(rows[True], rows[False]))
            if same:
                # on the other ISAs the torch layers' projections sum in another order than the
                # native step's (as with an f16 or f32 cache): a looser bound, still far below
                # what a misread row (a wrong scale or offset) moves
                tol = dict(atol=2e-4, rtol=1e-4) if isa == before else dict(atol=5e-2, rtol=0.0)
                torch.testing.assert_close(out[True], out[False], **tol)
                compared += 1
            for a, b in zip(rows[True], rows[False]):
                hd = runner.model.cfg.head_dim
                # a flip in an earlier layer of the step moves the later layers' rows a little more
                assert (a[:, :hd].int() - b[:, :hd].int()).abs().max() <= 2
                torch.testing.assert_close(a[:, hd:].contiguous().view(torch.float16), b[:, hd:].contiguous().view(torch.float16),
                                           atol=0, rtol=1e-2)
    finally:
        si4.set_isa(before)
        FastDecode.enabled = True
        for t in (t for layer in runner.kv_caches for t in layer):
            t[seq.block_table] = 0
    # a flip at a near tie in any of the 30 layers' K and V rows is common: 6 to 11 steps of 46
    # here wrote the same rows on each ISA (the count moves with every last bit either path
    # computes, so it is only a floor)
    assert compared >= 3


def test_q8_greedy_text_stays_with_f16_but_for_near_ties(q8: Engine) -> None:
    """Rule: the q8_0 run's tokens equal the f16 run's up to their first difference, and there
    the f16 run's two best log-probabilities (so logits) are within MARGIN of each other."""
    with Engine.load(plan(kv_dtype="f16")) as f16:
        for prompt in PROMPTS:
            want = greedy(f16, prompt, logprobs=2)
            got = tokens(greedy(q8, prompt, logprobs=0))
            ref = tokens(want)
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            if first is None:
                continue
            top = want.logprobs[first].top
            assert top[0][1] - top[1][1] < MARGIN, (prompt, first, top)


def test_block_copies_and_disk_payloads_carry_the_scales(q8: Engine) -> None:
    runner = q8.backend.runner
    greedy(q8, PROMPTS[1], max_tokens=4)  # some blocks with live rows
    k, _ = runner.kv_caches[0]
    live = [b for b in range(k.shape[0]) if k[b].any()][:3]
    assert live
    free = [b for b in range(k.shape[0] - 1, -1, -1) if not k[b].any()][: len(live)]
    payload = runner.read_blocks(live)
    assert payload.shape == (len(live), runner.block_nbytes)
    runner.write_blocks(free, [bytearray(row.numpy().tobytes()) for row in payload])
    for layer in runner.kv_caches:
        for t in layer:
            assert torch.equal(t[free], t[live])
            assert torch.equal(dequantize_q8(t[free]), dequantize_q8(t[live]))  # the scales came along
    for t in (t for layer in runner.kv_caches for t in layer):
        t[free] = 0
    runner.copy_blocks(list(zip(live, free)))
    assert all(torch.equal(t[free], t[live]) for layer in runner.kv_caches for t in layer)
    for t in (t for layer in runner.kv_caches for t in layer):
        t[free] = 0
