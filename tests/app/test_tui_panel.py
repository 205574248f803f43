"""The engine panel's figures: what each backend reports is shown, what it does not is hidden
(never 0); live figures from token arrival times."""

from __future__ import annotations

import io

from llmlocal.app.tui.engine_panel import (
    PanelState,
    figures_table,
    head_text,
    speed_table,
)
from llmlocal.app.tui.live_stats import LiveStats, downsample
from llmlocal.engine.types import Stats
from rich.console import Console


def text(renderable: object) -> str:
    console = Console(width=60, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def panel(stats: Stats, n_ctx: int = 2048) -> str:
    state = PanelState(model="m", backend=stats.backend, device=stats.device, n_ctx=n_ctx)
    state.take_stats(stats.to_dict() | {"token_rates": [10.0, 12.0]})
    return "\n".join(text(r) for r in (head_text(state), speed_table(state), figures_table(state)))


def test_llamacpp_figures_only() -> None:
    shown = panel(Stats("llamacpp", "cpu", prompt_tokens=30, completion_tokens=10, cached_prompt_tokens=0,
                        ttft_s=0.25, decode_tok_s=80.0, itl_ms_p50=12.0, itl_ms_p95=15.5))
    assert "250 ms" in shown
    assert "80.0 tok/s" in shown and "12.0 ms" in shown and "15.5 ms" in shown
    assert "30 tok (0 cached)" in shown and "10 tok" in shown and "40 / 2048  2%" in shown
    for hidden in ("KV blocks", "Draft", "Sparsity"):
        assert hidden not in shown


def test_paged_speculative_and_sparse_figures_appear_when_reported() -> None:
    shown = panel(Stats("paged", "cuda:0", prompt_tokens=100, completion_tokens=20, kv_blocks_used=8,
                        kv_blocks_total=512, drafted_tokens=40, accepted_tokens=30, achieved_sparsity=0.42))
    assert "paged · cuda:0" in shown
    assert "8 / 512" in shown and "75% (30/40)" in shown and "42%" in shown
    assert "TTFT" not in shown and "ITL" not in shown  # not reported: hidden, not 0
    assert "cached" not in shown  # cached_prompt_tokens None


def test_context_warns_near_the_end_and_counts_may_be_estimates() -> None:
    state = PanelState(n_ctx=100, context_tokens=95)
    assert state.context_share == 0.95 and "95 / 100  95%" in text(figures_table(state))
    state = PanelState(n_ctx=None, context_tokens=95, estimated=True)  # a server without a window size
    assert state.context_share is None and "~95 tok" in text(figures_table(state))
    assert "no reply yet" in text(speed_table(PanelState()))


def test_live_stats_from_arrival_times() -> None:
    live = LiveStats(prompt_tokens=10)
    live.add(0.5, 1)  # first token after 0.5 s
    live.add(0.6, 1)
    live.add(0.6, 0)  # held-back text: no token
    live.add(0.8, 2)  # two tokens in one event (a batched backend)
    assert live.ttft_s == 0.5 and live.completion_tokens == 4
    assert [round(r, 6) for r in live.rates] == [10.0, 10.0]
    assert round(live.decode_tok_s, 6) == 10.0  # 3 tokens after the first in 0.3 s
    assert downsample([1.0, 3.0] * 300, limit=3) == [2.0, 2.0, 2.0]
    assert downsample([1.234], limit=3) == [1.23]
