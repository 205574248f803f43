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
