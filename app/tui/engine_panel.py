"""The live engine panel: what the engine is doing for this chat.

Speed (TTFT, decode tok/s with a sparkline over the reply, inter-token latency), tokens
(prompt, cached, completion), how full the context window is, and the backend's own figures
(KV blocks, draft acceptance, sparsity). A figure the backend does not report is left out,
never shown as zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from statistics import fmean
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import LoadingIndicator, Sparkline, Static

WARN_AT = 0.9  # context share from which the panel (and a notification) warns
BAR_WIDTH = 22


@dataclass
class PanelState:
    model: str | None = None
    backend: str | None = None
    device: str | None = None
    n_ctx: int | None = None
    activity: str = ""  # "loading model…", "generating…", ""
    loading: bool = False  # a model is being loaded: a loading indicator shows
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    rates: list[float] = field(default_factory=list)
    itl_ms_p50: float | None = None
    itl_ms_p95: float | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    context_tokens: int | None = None  # tokens of the window in use
    estimated: bool = False  # token counts are estimates (a remote server that cannot count)
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    achieved_sparsity: float | None = None
    reply_format: str | None = None  # the chat's constraint ("JSON", "JSON schema"); None: free text

    def clear_reply(self) -> None:
        """Forget the figures of the last reply (a chat without one is shown)."""
        blank = PanelState()
        for f in fields(self):
            if f.name not in ("model", "backend", "device", "n_ctx", "activity", "loading", "context_tokens", "estimated",
                              "reply_format"):
                setattr(self, f.name, getattr(blank, f.name))

    def take_stats(self, stats: dict[str, Any]) -> None:
        """Figures of a finished reply (`Stats.to_dict()` plus the stored ``token_rates``)."""
        self.clear_reply()
        for f in fields(self):
            if f.name in stats and f.name not in ("model", "backend", "device", "n_ctx", "activity", "loading", "estimated",
                                                  "reply_format"):
                setattr(self, f.name, stats[f.name])
        self.rates = list(stats.get("token_rates", []))
        if "prompt_tokens" in stats and "completion_tokens" in stats:
            self.context_tokens = stats["prompt_tokens"] + stats["completion_tokens"]

    @property
    def context_share(self) -> float | None:
        if self.context_tokens is None or not self.n_ctx:
            return None
        return self.context_tokens / self.n_ctx


def _grid() -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(no_wrap=True)
    return table


def speed_table(s: PanelState) -> Table | Text:
    table = _grid()
    if s.ttft_s is not None:
        table.add_row("TTFT", f"{s.ttft_s * 1000:.0f} ms")
    if s.decode_tok_s is not None:
        table.add_row("Decode", f"{s.decode_tok_s:.1f} tok/s")
    if not table.rows:
        return Text("no reply yet" if not s.activity else s.activity, style="dim")
    return table


def figures_table(s: PanelState) -> Table:
    table = _grid()
    if s.itl_ms_p50 is not None:
        table.add_row("ITL p50", f"{s.itl_ms_p50:.1f} ms")
    if s.itl_ms_p95 is not None:
        table.add_row("ITL p95", f"{s.itl_ms_p95:.1f} ms")
    if s.prompt_tokens is not None:
        cached = f" ({s.cached_prompt_tokens} cached)" if s.cached_prompt_tokens is not None else ""
        table.add_row("Prompt", f"{s.prompt_tokens} tok{cached}")
    if s.completion_tokens is not None:
        table.add_row("Reply", f"{s.completion_tokens} tok")
    share = s.context_share
    about = "~" if s.estimated else ""
    if share is not None:
        style = "bold red" if share >= 1 else ("bold yellow" if share >= WARN_AT else "green")
        table.add_row("Context", Text(f"{about}{s.context_tokens} / {s.n_ctx}  {share:.0%}", style=style))
        filled = min(BAR_WIDTH, round(share * BAR_WIDTH))
        table.add_row("", Text("█" * filled, style=style) + Text("░" * (BAR_WIDTH - filled), style="dim"))
    elif s.context_tokens is not None:  # the window size is not reported
        table.add_row("Context", f"{about}{s.context_tokens} tok")
    if s.kv_blocks_used is not None:
        total = f" / {s.kv_blocks_total}" if s.kv_blocks_total is not None else ""
        table.add_row("KV blocks", f"{s.kv_blocks_used}{total}")
    if s.drafted_tokens is not None:
        if s.drafted_tokens and s.accepted_tokens is not None:
            rate = f"{s.accepted_tokens / s.drafted_tokens:.0%} ({s.accepted_tokens}/{s.drafted_tokens})"
        else:
            rate = f"{s.drafted_tokens} drafted"
        table.add_row("Draft accept", rate)
    if s.achieved_sparsity is not None:
        table.add_row("Sparsity", f"{s.achieved_sparsity:.0%}")
    return table


def head_text(s: PanelState) -> Text:
    text = Text(s.model or "no model", style="bold")
    where = " · ".join(x for x in (s.backend, s.device) if x)
    if where:
        text.append(f"\n{where}", style="dim")
    if s.n_ctx:
        text.append(f" · ctx {s.n_ctx}", style="dim")
    if s.reply_format:
        text.append("\nreplies: ", style="dim")
        text.append(s.reply_format, style="bold")
    if s.activity:
        text.append(f"\n{s.activity}", style="italic")
    return text


class EnginePanel(Vertical):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = PanelState()

    def compose(self) -> ComposeResult:
        yield Static(id="engine-head")
        yield LoadingIndicator(id="engine-loading")
        yield Static(id="engine-speed")
        yield Sparkline([], summary_function=fmean, id="engine-spark")
        yield Static(id="engine-figures")

    def on_mount(self) -> None:
        self.border_title = "Engine"
        self.render_state()

    def render_state(self) -> None:
        s = self.state
        self.query_one("#engine-head", Static).update(head_text(s))
        self.query_one("#engine-loading").display = s.loading
        self.query_one("#engine-speed", Static).update(speed_table(s))
        spark = self.query_one("#engine-spark", Sparkline)
        spark.data = list(s.rates)
        spark.display = len(s.rates) >= 2
        self.query_one("#engine-figures", Static).update(figures_table(s))
        share = s.context_share
        self.set_class(share is not None and share >= WARN_AT, "-context-warn")
