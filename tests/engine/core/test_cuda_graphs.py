"""CUDA-graph decode: the bucket arithmetic everywhere; replay against eager steps on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from llmlocal.engine.core.cuda_graphs import bucket_for, buckets


def test_buckets_cover_every_batch_size_up_to_the_maximum() -> None:
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(1) == [1]
    sizes = buckets(12)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]
    assert bucket_for(13, sizes) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_equals_eager_decoding(monkeypatch) -> None:
    from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams

    # the GPU check's random model of a real shape where it runs (the machines lack the starter)
    model = os.environ.get("LLMLOCAL_GPU_CHECK_MODEL")

    def tokens(graphs: str) -> tuple[list[str], int]:
        monkeypatch.setenv("LLMLOCAL_CUDA_GRAPHS", graphs)
        with Engine.load(Plan(model=model, backend="paged", device="cuda", n_ctx=512, max_batch=4)) as e:
            out = []
            for p in ("Name three rivers.", "Count to ten."):
                req = Request.chat([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=24))
                out.append(next(ev for ev in e.generate(req) if isinstance(ev, DoneEvent)).text)
            graphs = e.backend.runner.graphs
            return out, graphs.replays if graphs is not None else 0

    (replayed, replays), (eager, none) = tokens("1"), tokens("0")
    assert replays > 0 and none == 0  # the decode steps did replay graphs, and only when asked to
    assert replayed == eager
