"""The draft-length controller's choices, from the costs and acceptance it has observed."""

from __future__ import annotations

from llmlocal.engine.spec_control import DraftLength


def test_a_dear_catch_up_pass_does_not_stop_drafting_for_good() -> None:
    dl = DraftLength(draft_ratio=0.25)
    dl.observe_target(1, 0.040)
    dl.observe_draft(16, 1, 0.040)  # the draft reading a 16-token prompt: as dear as a target step
    room = {7: 100}
    for _ in range(3):  # too few draft passes to judge: probe with one token
        assert dl.choose([7], 1, room) == {7: 1}
        dl.observe_target(2, 0.041)
        dl.observe_draft(1, 1, 0.005)  # a proposal pass is cheap
        dl.observe(7, 1, 1)
    for _ in range(8):
        dl.observe(7, 4, 4)
    k = dl.choose([7], 1, room)[7]
    assert k >= 2  # cheap, always-accepted drafts: draft several


def test_a_draft_that_is_always_wrong_is_dropped() -> None:
    dl = DraftLength(draft_ratio=0.25)
    for m in (16, 1, 1, 1):
        dl.observe_draft(m, 1, 0.005 + 0.001 * m)
    for _ in range(4):
        dl.observe_target(1, 0.040)
    for _ in range(20):
        dl.observe(7, 1, 0)
    assert dl.choose([7], 1, {7: 100}) == {7: 0}


def _ngram_controller(plain_seconds: float) -> DraftLength:
    """Batch 8, n-gram drafts (no draft passes), acceptance about 0.5; verifying steps over
    8 + 8 tokens measured at 40 ms, plain 8-token steps at ``plain_seconds``."""
    dl = DraftLength(draft_ratio=0.0)
    for _ in range(6):
        dl.observe_target(16, 0.040)
        dl.observe_target(24, 0.044)
        dl.observe_target(8, plain_seconds, plain=True)
    for sid in range(8):
        for _ in range(10):
            dl.observe(sid, 2, 1)
    return dl


def test_drafting_stops_when_plain_steps_are_much_cheaper_than_verifying_ones() -> None:
    """On a CPU a plain decode step runs in one native call and costs a fraction of a step
    that verifies drafts through the torch layers: half-accepted drafts do not pay for that."""
    room = {sid: 100 for sid in range(8)}
    assert set(_ngram_controller(0.010).choose(list(range(8)), 8, room).values()) == {0}
    # priced like the verifying steps (the torch layers for both), the same drafts pay
    assert max(_ngram_controller(0.036).choose(list(range(8)), 8, room).values()) >= 1


def test_on_a_cpu_a_draft_model_is_not_tried_at_the_prior_acceptance() -> None:
    """A CPU step is bound by arithmetic: each checked token costs a good part of a step, so a
    draft model of 0.4 of the target's bytes cannot pay at the prior acceptance, and its first
    try (catching up with the whole prompt) is not made. On a GPU the same draft is tried; on
    the CPU a free drafter (n-gram lookup) still is."""
    from llmlocal.engine.spec_control import PER_TOKEN_PRIOR

    room = {7: 100}
    cpu = DraftLength(draft_ratio=0.4, per_token=PER_TOKEN_PRIOR["cpu"])
    cpu.observe_target(1, 0.070, plain=True)
    assert cpu.choose([7], 1, room) == {7: 0}
    gpu = DraftLength(draft_ratio=0.4, per_token=PER_TOKEN_PRIOR["cuda"])
    gpu.observe_target(1, 0.070, plain=True)
    assert gpu.choose([7], 1, room)[7] >= 1
    ngram = DraftLength(draft_ratio=0.0, per_token=PER_TOKEN_PRIOR["cpu"])
    ngram.observe_target(1, 0.070, plain=True)
    assert ngram.choose([7], 1, room)[7] >= 1
