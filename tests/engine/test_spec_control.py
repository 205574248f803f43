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
