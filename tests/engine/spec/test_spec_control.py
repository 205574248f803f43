"""The draft-length controller's choices, from the costs and acceptance it has observed."""

from __future__ import annotations

import pytest
from llmlocal.engine.spec.spec_control import DraftLength


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


def _measured() -> DraftLength:
    """Costs where drafting pays at a high acceptance (a Sapphire Rapids step of the 1.5B: 45 ms
    plain, 65 ms checking 4 tokens; a 0.5B draft pass 17 ms), measured: probed."""
    dl = DraftLength(draft_ratio=0.4, per_token=0.8)
    for _ in range(4):
        dl.observe_target(1, 0.045, plain=True)
    for width, seconds in ((2, 0.053), (3, 0.059), (4, 0.065), (5, 0.077)):
        for _ in range(2):
            dl.observe_target(width, seconds)
    for _ in range(4):
        dl.observe_draft(1, 1, 0.017)
    dl._probed = True
    return dl


def test_a_new_sequence_measures_its_own_acceptance_after_poor_ones() -> None:
    """Where drafting pays (`_measured`), a request whose drafts were mostly rejected stops
    drafting; the next request still tries, and keeps drafting if its own are kept."""
    dl = _measured()
    for _ in range(30):
        dl.observe(1, 3, 0)  # a poor request
    assert dl.choose([1], 1, {1: 100}) == {1: 0}
    assert dl.choose([2], 1, {2: 100})[2] >= 1  # the next one tries
    for _ in range(6):
        dl.observe(2, 3, 3)
    assert dl.choose([2], 1, {2: 100})[2] >= 2


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


def _probed_on_a_cpu(check_seconds_per_token: float) -> tuple[DraftLength, list[int]]:
    """A CPU controller with a draft model of 0.4 of the target's bytes, plain steps of 70 ms,
    then whatever it drafts, with checking steps costing 70 ms + ``check_seconds_per_token``
    per token beyond the first, draft passes 28 ms, and 9 drafted tokens in 10 kept."""
    from llmlocal.engine.spec.spec_control import PER_TOKEN_PRIOR

    dl = DraftLength(draft_ratio=0.4, per_token=PER_TOKEN_PRIOR["cpu"])
    room, ks = {7: 100}, []
    for step in range(40):
        k = dl.choose([7], 1, room)[7]
        ks.append(k)
        if k == 0:
            dl.observe_target(1, 0.070, plain=True)
            dl.decay_idle([7])
            continue
        dl.observe_draft(k, k, 0.028 * k)
        dl.observe_target(1 + k, 0.070 + check_seconds_per_token * k)
        accepted = k if step % 10 else k - 1
        dl.observe(7, k, accepted)
    return dl, ks


def test_on_a_cpu_a_draft_model_is_probed_once_and_kept_where_it_pays() -> None:
    """On its priors (a CPU step bound by arithmetic) a draft model does not pay, so it is not
    drafted from the first step: after four plain steps it is probed with draft lengths 1-4,
    and the measured costs decide. Where checking a token costs a tenth of a step (a CPU bound
    by memory) drafting goes on, and a new sequence starts from the acceptance measured;
    where it costs most of a step, drafting stops after the probe."""
    from llmlocal.engine.spec.spec_control import PROBE_KS

    cheap, ks = _probed_on_a_cpu(0.007)
    assert ks[:4] == [0, 0, 0, 0] and tuple(ks[4 : 4 + len(PROBE_KS)]) == PROBE_KS
    assert min(ks[4 + len(PROBE_KS) :]) >= 2  # measured to pay: several tokens every step
    assert cheap.choose([8], 1, {8: 100})[8] >= 2  # a new sequence: the pooled acceptance
    dear, ks = _probed_on_a_cpu(0.060)
    assert tuple(ks[4 : 4 + len(PROBE_KS)]) == PROBE_KS
    assert set(ks[4 + len(PROBE_KS) + 4 :]) == {0}  # measured not to pay: stopped


def test_a_gpu_drafts_at_once_and_a_free_drafter_is_tried_on_a_cpu() -> None:
    from llmlocal.engine.spec.spec_control import PER_TOKEN_PRIOR

    room = {7: 100}
    gpu = DraftLength(draft_ratio=0.4, per_token=PER_TOKEN_PRIOR["cuda"])
    gpu.observe_target(1, 0.070, plain=True)
    assert gpu.choose([7], 1, room)[7] >= 1
    ngram = DraftLength(draft_ratio=0.0, per_token=PER_TOKEN_PRIOR["cpu"])
    ngram.observe_target(1, 0.070, plain=True)
    assert ngram.choose([7], 1, room)[7] >= 1


def test_a_width_measured_is_priced_by_its_measurements_not_the_line() -> None:
    """On a CPU the kernels take a step's rows four at a time: checking 4 tokens costs 1.3
    plain steps, 5 tokens 1.9. A line fitted across those widths prices 4 tokens dearer and 5
    cheaper than they are (here it chose k = 1); the widths' own measurements choose k = 3."""
    from llmlocal.engine.spec.spec_control import PER_TOKEN_PRIOR

    dl = DraftLength(draft_ratio=0.35, per_token=PER_TOKEN_PRIOR["cpu"])
    step = {1: 0.050, 2: 0.055, 3: 0.060, 4: 0.065, 5: 0.095, 6: 0.100}
    for _ in range(4):
        dl.observe_target(1, step[1], plain=True)
    for _ in range(3):
        for width in range(2, 7):
            dl.observe_target(width, step[width])
            dl.observe_draft(width - 1, width - 1, 0.017 * (width - 1))
    for _ in range(30):
        dl.observe(7, 4, 4)
        dl.observe(7, 4, 3)  # about 0.9 per token
    assert dl.target(5) == step[5] and dl.target(4) == step[4]
    assert dl.choose([7], 1, {7: 100}) == {7: 3}


def test_not_drafting_is_never_priced_above_a_checking_step_of_as_many_tokens() -> None:
    """Plain steps measured at batch 1 only leave the plain fit's slope at the CPU prior (a
    token costs most of a step), which prices a plain batch-8 step at several seconds' worth
    of steps; a checking step of 8 tokens measured at twice a one-token step bounds it, and
    drafting a token each (16-token steps, about twice the cost again) does not pay."""
    from llmlocal.engine.spec.spec_control import PER_TOKEN_PRIOR

    dl = DraftLength(draft_ratio=0.35, per_token=PER_TOKEN_PRIOR["cpu"])
    for _ in range(4):
        dl.observe_target(1, 0.050, plain=True)
    for _ in range(2):
        dl.observe_target(8, 0.105)
        dl.observe_target(16, 0.200)
    for _ in range(4):
        dl.observe_draft(8, 1, 0.040)
    seqs = list(range(8))
    for sid in seqs:
        for _ in range(10):
            dl.observe(sid, 1, 1)
    ks = dl.choose(seqs, 8, {sid: 100 for sid in seqs})
    assert sum(ks.values()) <= 1  # at most one sequence tries one token (a width not yet measured)


def _paying() -> DraftLength:
    """`_measured`, and a sequence whose drafts are all kept."""
    dl = _measured()
    for _ in range(6):
        dl.observe(1, 3, 3)
    return dl


def test_a_long_catch_up_waits_until_the_reply_left_can_repay_it() -> None:
    # a 650-token prompt at 17 ms a token (the target's prompt steps) and a draft of 0.4 of its
    # bytes: about 4.4 s of catch-up, which 47 tokens left cannot repay, nor a reply expected to
    # run REPLY_PRIOR tokens; one that has run 600 of its 1,000 can
    dl = _paying()
    dl.observe_prompt(650, 650 * 0.017)
    assert dl.catch_up_cost(650) == pytest.approx(650 * 0.017 * 0.4)
    assert dl.choose([1], 1, {1: 47}, lag={1: 650}, decoded={1: 1}) == {1: 0}
    assert dl.choose([1], 1, {1: 1000}, lag={1: 650}, decoded={1: 1}) == {1: 0}
    assert dl.choose([1], 1, {1: 1000}, lag={1: 650}, decoded={1: 600})[1] >= 2
    # with no max_tokens a reply is expected to run REPLY_PRIOR tokens, or as long as it has
    # run already: the same sequence drafts once it has decoded enough to repay it
    assert dl.choose([1], 1, {1: 4000}, lag={1: 4000}, decoded={1: 1}) == {1: 0}
    assert dl.choose([1], 1, {1: 4000}, lag={1: 4000}, decoded={1: 3000})[1] >= 2
    # a short prompt's catch-up, or a draft that keeps up already, drafts at once; another
    # sequence of the step is not held back by one that waits
    assert dl.choose([1, 2], 2, {1: 47, 2: 47}, lag={1: 650, 2: 16}, decoded={1: 1, 2: 1})[2] >= 1
    # measured catch-ups price it from then on
    dl.observe_draft(600, 3, 600 * 0.001)
    assert dl.catch_up_cost(650) < 650 * 0.017 * 0.4


def test_the_probe_waits_for_a_sequence_whose_catch_up_it_can_repay() -> None:
    dl = DraftLength(draft_ratio=0.3, per_token=0.8)
    for _ in range(4):
        dl.observe_target(1, 0.070, plain=True)
    dl.observe_prompt(700, 700 * 0.018)
    # the priors say no: the probe would start, but not on a 700-token catch-up for 40 tokens
    assert dl.choose([1], 1, {1: 40}, lag={1: 700}, decoded={1: 5}) == {1: 0}
    assert dl._probe in ([], list((1, 2, 3, 4, 2, 3)))  # not consumed by the wait
    assert dl.choose([2], 1, {2: 400}, lag={2: 30}, decoded={2: 1}) == {2: 1}  # the probe's first
