"""`llmlocal bench` output: every shape of result the benchmarks return prints."""

from __future__ import annotations

from llmlocal.app.commands.bench import render


def test_render_prints_per_backend_groups_and_a_nested_group_of_figures() -> None:
    decode = {"scenario": "decode", "bandwidth_gb_s": 28.98,
              "backends": {"llamacpp": {"decode_tok_s": 19.29, "completion_tokens": 64}, "paged": {"decode_tok_s": 19.85}}}
    spec = {"scenario": "spec", "speedup": 0.9468, "batch8": {"speedup": 1.02, "tokens_per_step": 1.5}}
    assert render(decode).splitlines() == [
        "              scenario: decode",
        "        bandwidth_gb_s: 28.98",
        "  llamacpp: decode_tok_s 19.29, completion_tokens 64",
        "     paged: decode_tok_s 19.85",
    ]
    assert render(spec).splitlines()[-1] == "                batch8: speedup 1.02, tokens_per_step 1.5"


def test_rounds_below_one_is_refused_for_decode_and_spec() -> None:
    import subprocess
    import sys

    for scenario in ("decode", "spec"):
        result = subprocess.run([sys.executable, "-m", "llmlocal.app", "bench", scenario, "--rounds", "0"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "--rounds must be 1 or more" in result.stderr


def test_a_negative_pause_is_refused_for_draft() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "llmlocal.app", "bench", "draft", "--pause", "-1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "--pause at least 0" in result.stderr


def test_a_negative_temperature_is_refused_for_spec() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "llmlocal.app", "bench", "spec", "--temperature", "-1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "temperature must be >= 0" in result.stderr


def test_render_prints_per_round_lists() -> None:
    spec = {"scenario": "spec", "speedup": 1.09, "speedup_per_round": [0.98, 1.206], "batch8": {"speedup_per_round": [1.5]}}
    lines = render(spec).splitlines()
    assert lines[2] == "     speedup_per_round: [0.98, 1.206]"
    assert lines[3] == "                batch8: speedup_per_round [1.5]"


def test_bench_prefill_times_a_long_prompt_in_each_backend_taking_turns() -> None:
    """The real starter in both backends, each in a process of its own: a prompt of about the
    asked length in every round, a time to first token, and the per-round ratios to the first."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "llmlocal.app", "bench", "prefill", "--backends", "llamacpp,paged",
                             "--prompt-tokens", "120", "--rounds", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["scenario"] == "prefill" and set(out["backends"]) == {"llamacpp", "paged"}
    for name, figures in out["backends"].items():
        assert 120 <= figures["prompt_tokens"] <= 200, (name, figures)
        assert figures["ttft_s"] > 0 and figures["prefill_tok_s"] == figures["prompt_tokens"] / figures["ttft_s"]
        assert len(figures["speed_vs_llamacpp_per_round"]) == 2 and figures["speed_vs_llamacpp"] > 0
    assert out["backends"]["llamacpp"]["speed_vs_llamacpp_per_round"] == [1.0, 1.0]
    # the two engines tokenize alike: the same prompt in both
    assert out["backends"]["llamacpp"]["prompt_tokens"] == out["backends"]["paged"]["prompt_tokens"]
    refused = subprocess.run([sys.executable, "-m", "llmlocal.app", "bench", "prefill", "--prompt-tokens", "3"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--prompt-tokens must be at least 16" in refused.stderr
