"""`bench decode --prompt-tokens N --kv-dtype f16,q8_0`: decode after a long prompt, once per KV
cache type, on the starter at toy sizes. The figures' consistency, not their speed."""

from __future__ import annotations

import json

from llmlocal.app.bench.scenarios import bench_decode


def test_decode_after_a_long_prompt_per_kv_cache_type() -> None:
    out = bench_decode(None, ["paged"], max_tokens=8, rounds=1, prompt_tokens=300, kv_dtypes=["f16", "q8_0"])
    assert json.loads(json.dumps(out)) == out
    figures = out["backends"]
    assert list(figures) == ["paged:f16", "paged:q8_0"]
    for f in figures.values():
        assert 300 <= f["prompt_tokens"] <= 400  # about one token a word, and the chat template's
        assert f["completion_tokens"] == 8 and f["decode_tok_s"] > 0
    # bytes a token reads: the same weights, and the context's KV at 68 bytes a head row, not 128
    f16, q8 = figures["paged:f16"], figures["paged:q8_0"]
    assert q8["bytes_per_token"] < f16["bytes_per_token"]
    assert figures["paged:f16"]["decode_vs_paged:f16"] == 1.0
