"""The sparse backend's prefix cache: each sparsity level's blocks kept apart, in memory and on
the disk tier, and the same prompt giving the same reply cold, cached or after a restart (on the
real starter calibrated at 50%: conftest `sparse_starter`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmlocal.engine import Engine, Plan
from llmlocal.engine.types import DoneEvent, Request, SamplingParams
from llmlocal.quant.sparsity import split_builtin_text

TEXT = split_builtin_text()[1]


@pytest.fixture(scope="module")
def sparse(sparse_starter: tuple[Path, dict]) -> Engine:
    with Engine.load(Plan(model=str(sparse_starter[0]), backend="sparse", n_ctx=1024)) as e:
        yield e


def test_the_prefix_cache_never_serves_blocks_of_another_level(sparse: Engine) -> None:
    """KV blocks computed at one sparsity level are another model's: after `set_sparsity` a
    repeated prompt is prefilled again, and at the same level again it is served from cache."""
    request = Request.chat([{"role": "user", "content": "Name three colours of the rainbow, please."}],
                           SamplingParams(temperature=0, max_tokens=2))

    def cached() -> int:
        done = [e for e in sparse.generate(request) if isinstance(e, DoneEvent)][0]
        return done.stats.cached_prompt_tokens or 0

    try:  # levels no other test runs at (a chat's first block, the system prompt, is every prompt's)
        sparse.backend.set_sparsity(0.37)
        assert cached() == 0
        assert cached() > 0  # the same level: the prompt's full blocks come from the cache
        sparse.backend.set_sparsity(0.21)
        assert cached() == 0  # another level: none of them
        sparse.backend.set_sparsity(0.37)
        assert cached() > 0  # back: that level's blocks are still there
    finally:
        sparse.backend.set_sparsity(0.5)


def test_a_restarted_engine_reads_a_levels_blocks_from_disk_and_no_other_levels(sparse_starter: tuple[Path, dict],
                                                                                 tmp_path: Path) -> None:
    """The prefix cache's disk tier keeps the sparse backend's blocks too (a namespace of its
    own, each level's chain from a root of its own): a new engine at the same level reads the
    prompt's blocks instead of computing them, one at another level finds none."""
    request = Request.chat([{"role": "user", "content": TEXT[:600] + "\nSummarise that in one line."}],
                           SamplingParams(temperature=0, max_tokens=8))

    def run(level: float) -> tuple[DoneEvent, int]:
        plan = Plan(model=str(sparse_starter[0]), backend="sparse", n_ctx=1024, sparsity=level, kv_cache_dir=str(tmp_path))
        with Engine.load(plan) as e:
            done = [ev for ev in e.generate(request) if isinstance(ev, DoneEvent)][0]
            return done, e.backend.disk.counts["read"]

    first, _ = run(0.3)
    again, read = run(0.3)
    other, other_read = run(0.5)
    assert first.stats.cached_prompt_tokens == 0
    assert read > 0 and again.stats.cached_prompt_tokens >= first.stats.prompt_tokens - 2 * 16
    # the same reply: a cold prompt's last rows run as a hit runs them (the scheduler's tail_alone)
    assert again.text == first.text and first.text
    assert other_read == 0 and other.stats.cached_prompt_tokens == 0
