"""CUDA-graph decode: the bucket arithmetic everywhere; replay against eager steps on a GPU."""

from __future__ import annotations

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

    def tokens(graphs: str) -> list[str]:
        monkeypatch.setenv("LLMLOCAL_CUDA_GRAPHS", graphs)
        with Engine.load(Plan(backend="paged", device="cuda", n_ctx=512, max_batch=4)) as e:
            out = []
            for p in ("Name three rivers.", "Count to ten."):
                req = Request.chat([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=24))
                out.append(next(ev for ev in e.generate(req) if isinstance(ev, DoneEvent)).text)
            return out

    assert tokens("1") == tokens("0")
