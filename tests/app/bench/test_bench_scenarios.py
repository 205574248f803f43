"""The benchmark code behind the README's figures (`bench_spec`, `bench_sparse`, decode, batch), end
to end on the starter at toy sizes: every JSON field present and finite, and the figures
consistent with each other (a speedup is the ratio of the two tok/s it names, a share is in
[0, 1], the token counts are those asked for). Not their speed: tests assert no clock."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from llmlocal.app.bench.scenarios import _batch_requests, bench_batch, bench_decode, bench_prefix
from llmlocal.app.bench.sparse import bench_sparse
from llmlocal.app.bench.spec import bench_spec

TOKENS = 12


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def share(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0


def test_bench_spec_figures_are_whole_and_consistent() -> None:
    out = bench_spec(None, max_tokens=TOKENS, batch=2, rounds=1)
    assert json.loads(json.dumps(out)) == out  # one JSON object, as `bench --json` prints it
    assert (out["scenario"], out["model"], out["draft"], out["rounds"], out["temperature"]) == (
        "spec", "smollm2-135m", "smollm2-135m", 1, 0.0)
    for row in (out, out["batch2"]):
        for key in ("target_tok_s", "spec_tok_s", "speedup", "ngram_speedup", "tokens_per_step", "ngram_tokens_per_step"):
            assert positive(row[key]), (key, row[key])
        for key in ("acceptance_rate", "ngram_acceptance_rate"):
            assert share(row[key]), (key, row[key])
        assert row["drafted_per_step"] >= 0 and math.isfinite(row["drafted_per_step"])
        # one round: the median of one ratio is the ratio of the two speeds
        assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["target_tok_s"], rel=1e-12)
        assert row["tokens_per_step"] >= 1.0 and row["ngram_tokens_per_step"] >= 1.0  # a step gives a token or more
        # a greedy draft of the target's own weights (4-bit) is mostly accepted
        assert row["acceptance_rate"] > 0.3


def test_bench_spec_with_a_draft_model_compares_its_weights_and_a_cold_long_prompt() -> None:
    out = bench_spec(None, draft="smollm2-135m", max_tokens=TOKENS, batch=2, rounds=1, draft_weights=("auto", "file"))
    assert json.loads(json.dumps(out)) == out
    for key in ("speedup", "summarise_speedup", "speedup_file", "summarise_speedup_file", "long_prompt_speedup"):
        assert positive(out[key]), (key, out[key])
    assert share(out["acceptance_rate_file"]) and out["long_prompt_drafted"] >= 0
    assert "speedup_file" not in out["batch2"]  # other draft weights run at batch 1 only


def test_bench_sparse_figures_are_whole_and_consistent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the calibrated copy goes here, not to ~/.cache
    out = bench_sparse(None, 0.5, max_tokens=TOKENS, runs=1)
    assert json.loads(json.dumps(out)) == out
    assert Path(out["gguf"]).is_file() and Path(out["gguf"]).is_relative_to(tmp_path)
    assert out["model"] == "smollm2-135m" and out["sparsity"] == pytest.approx(0.5)
    for key in ("sparse_tok_s", "dense_kernel_tok_s", "paged_tok_s", "llamacpp_tok_s", "kernel_bandwidth_gb_s",
                "machine_bandwidth_gb_s", "speedup_vs_llamacpp", "speedup_vs_paged", "dense_ratio_vs_llamacpp"):
        assert positive(out[key]), (key, out[key])
    assert out["speedup_vs_llamacpp"] == pytest.approx(out["sparse_tok_s"] / out["llamacpp_tok_s"], rel=1e-12)
    assert out["speedup_vs_paged"] == pytest.approx(out["sparse_tok_s"] / out["paged_tok_s"], rel=1e-12)
    assert out["dense_ratio_vs_llamacpp"] == pytest.approx(out["dense_kernel_tok_s"] / out["llamacpp_tok_s"], rel=1e-12)
    assert share(out["kernel_weight_share"]) and out["kernel_weight_share"] > 0.9  # every projection of the starter
    assert out["achieved_sparsity"] == pytest.approx(0.5, abs=0.1)
    assert out["completion_tokens"] == TOKENS


def test_bench_decode_figures_are_whole_and_consistent() -> None:
    out = bench_decode(None, ["llamacpp", "paged"], max_tokens=TOKENS, rounds=1)
    assert json.loads(json.dumps(out)) == out
    assert out["scenario"] == "decode" and out["model"] == "smollm2-135m" and positive(out["bandwidth_gb_s"])
    assert set(out["backends"]) == {"llamacpp", "paged"}
    figures = out["backends"]
    for name, f in figures.items():
        for key in ("load_s", "ttft_s", "decode_tok_s", "itl_ms_p50", "itl_ms_p95", "bytes_per_token", "mbu"):
            assert positive(f[key]), (name, key, f[key])
        assert f["itl_ms_p50"] <= f["itl_ms_p95"]
        assert f["completion_tokens"] == TOKENS
        # memory-bandwidth use: the bytes a token reads at the measured speed, over the bandwidth
        # (printed rounded to 2 decimals)
        # of the memory the weights are in (here main memory, the first backend's too)
        assert f["device"] == "cpu" and f["bandwidth_gb_s"] == out["bandwidth_gb_s"]
        assert f["mbu"] == pytest.approx(f["bytes_per_token"] * f["decode_tok_s"] / (f["bandwidth_gb_s"] * 1e9), rel=1e-2)
    assert figures["llamacpp"]["decode_vs_llamacpp_per_round"] == [1.0] and figures["llamacpp"]["decode_vs_llamacpp"] == 1.0
    ratio = figures["paged"]["decode_tok_s"] / figures["llamacpp"]["decode_tok_s"]
    assert figures["paged"]["decode_vs_llamacpp_per_round"] == [round(ratio, 3)]
    assert figures["paged"]["decode_vs_llamacpp"] == round(ratio, 3)


def test_bench_batch_rounds_take_turns_on_new_texts() -> None:
    """Each round's figures are kept and the speedup is their median; every round asks requests
    of the same lengths in another text (a round would otherwise find its prompts in the prefix
    cache the round before it filled, and the paged baseline the batch's)."""
    out = bench_batch(None, requests=2, baseline="paged", rounds=2)
    assert json.loads(json.dumps(out)) == out
    assert (out["scenario"], out["model"], out["requests"]) == ("batch", "smollm2-135m", 2)
    for key in ("paged_tok_s", "paged_batch1_tok_s", "speedup"):
        assert positive(out[key]), (key, out[key])
    assert len(out["speedup_per_round"]) == 2 and all(positive(r) for r in out["speedup_per_round"])
    assert out["speedup"] == pytest.approx(statistics.median(out["speedup_per_round"]), abs=1e-3)
    first, second = _batch_requests(4, text_seed=0), _batch_requests(4, text_seed=1)
    assert [len(p.split()) for p, _ in first] == [len(p.split()) for p, _ in second]
    assert [n for _, n in first] == [n for _, n in second]
    assert all(a != b for (a, _), (b, _) in zip(first, second))


def test_bench_prefix_counts_the_rows_of_questions_sent_together() -> None:
    """Questions on one fresh history, sent at once: the history's rows are computed once."""
    out = bench_prefix(None, history_tokens=200, together=3)
    assert out["scenario"] == "prefix" and out["cached_prompt_tokens"] > 0
    n, shared = out["together_requests"], out["together_shared_tokens"]
    own = out["together_prompt_tokens"] / n - shared  # each question's rows after the history
    assert n == 3 and shared >= 400 and own > 0
    assert out["together_computed_tokens"] <= shared + n * (own + 16), out
    assert out["together_last_ttft_s"] <= out["together_wall_s"]
