"""`bench resume`: the first request after a restart, with the prefix cache's disk tier and without.

Two things users do every day, each measured as a restart: every engine runs in a process of
its own (`bench._EngineProcess`) and is asked its first request without a warm-up, so nothing
in memory survives from one to the next.

* chat    a saved chat of about ``history_tokens`` reopened: the earlier session computed the
          history and the model's last reply (and kept their blocks); the new session sends one
          more message. TTFT of that message with the blocks on disk, and cold.
* serve   a server restarted under an editor that sends the same long system prompt (about
          ``history_tokens``) with every request: TTFT of the new process's first request.

Rounds take turns (warm, then cold), each with a text of its own, in a fresh cache directory.
Per case: the median TTFT of each, their ratio, the prompt tokens read from the cache, and how
long the warm process took to load.

With ``draft`` (a draft model, `--draft`), every engine drafts with it, and each measured
request asks for `DRAFT_REPLY` tokens: a draft catches up with the history after the first
token, so what it reads from its own disk tier (or computes) shows in the reply's time
(``reply_warm_s``, ``reply_cold_s``), not in TTFT.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

from llmlocal.engine.plan import Plan
from llmlocal.engine.types import Stats

from .scenarios import _EngineProcess, _prompt

DRAFT_REPLY = 32  # tokens of each measured reply when drafting


def _chat_history(tokens: int, seed: int) -> list[dict[str, str]]:
    """Turns of about 60 words each (about a token a word) until ``tokens`` words, ending with
    a user message."""
    history: list[dict[str, str]] = []
    words = 0
    while words < tokens:
        history += [{"role": "user", "content": "Remember these words: " + _prompt(60, seed * 1000 + len(history))},
                    {"role": "assistant", "content": "Noted: " + _prompt(60, seed * 1000 + len(history) + 1)}]
        words += 124
    return history + [{"role": "user", "content": "Which of those words name a place?"}]


def _once(plan: Plan, messages: list[dict[str, str]], max_tokens: int,
          ignore_eos: bool = False) -> tuple[Stats, str, dict[str, float]]:
    """One request in a process of its own: its stats, its reply, the process's load figures."""
    engine = _EngineProcess(plan, [])
    try:
        stats, text = engine.reply(messages, max_tokens, ignore_eos)
        return stats, text, engine.info
    finally:
        engine.close()


def bench_resume(model: str | None, history_tokens: int = 4000, rounds: int = 2, threads: int | None = None,
                 draft: str | None = None) -> dict[str, Any]:
    n_ctx = max(2048, history_tokens + 1024)
    out: dict[str, Any] = {"scenario": "resume", "model": model or "smollm2-135m", "history_tokens": history_tokens}
    new_tokens = DRAFT_REPLY if draft else 1  # of each measured request (all of them: past an end of text)
    if draft:
        out["draft"] = draft
    runs: dict[str, dict[str, list]] = {case: {"warm": [], "cold": [], "load_s": []} for case in ("chat", "serve")}
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="llmlocal-bench-kv-") as kv:
            warm = Plan(model=model, backend="paged", n_ctx=n_ctx, threads=threads, kv_cache_dir=kv, draft=draft)
            cold = warm.replace(kv_cache_dir=None)
            # chat: the earlier session answered the history's last message; the app quit
            history = _chat_history(history_tokens, seed=10 + r)
            _, reply, _ = _once(warm, history, 48)
            follow = history + [{"role": "assistant", "content": reply},
                                {"role": "user", "content": "Now list them in alphabetical order."}]
            stats, _, info = _once(warm, follow, new_tokens, bool(draft))
            runs["chat"]["warm"].append(stats)
            runs["chat"]["load_s"].append(info["load_s"])
            runs["chat"]["cold"].append(_once(cold, follow, new_tokens, bool(draft))[0])
            # serve: the same system prompt, another question, a new process
            system = {"role": "system", "content": "Use these notes to answer: " + _prompt(history_tokens, 500 + r)}
            # a reply of several tokens (a draft computes its K/V only once it proposes)
            _once(warm, [system, {"role": "user", "content": "Which words name a colour?"}], 48 if draft else 1)
            second = [system, {"role": "user", "content": "Which words name a season?"}]
            stats, _, info = _once(warm, second, new_tokens, bool(draft))
            runs["serve"]["warm"].append(stats)
            runs["serve"]["load_s"].append(info["load_s"])
            runs["serve"]["cold"].append(_once(cold, second, new_tokens, bool(draft))[0])
    for case, got in runs.items():
        warm_ttft = statistics.median(s.ttft_s or 0.0 for s in got["warm"])
        cold_ttft = statistics.median(s.ttft_s or 0.0 for s in got["cold"])
        out[case] = {
            "prompt_tokens": got["warm"][0].prompt_tokens,
            "cached_prompt_tokens": min(s.cached_prompt_tokens for s in got["warm"]),
            "ttft_warm_s": round(warm_ttft, 3),
            "ttft_cold_s": round(cold_ttft, 3),
            "speedup": round(cold_ttft / warm_ttft, 2) if warm_ttft else None,
            "ttft_warm_s_per_round": [round(s.ttft_s or 0.0, 3) for s in got["warm"]],
            "ttft_cold_s_per_round": [round(s.ttft_s or 0.0, 3) for s in got["cold"]],
            "load_s": round(statistics.median(got["load_s"]), 2),
        }
        if draft:  # the reply's time: the draft's catch-up is in it
            out[case]["reply_tokens"] = got["warm"][0].completion_tokens
            out[case]["reply_warm_s"] = round(statistics.median(s.total_s or 0.0 for s in got["warm"]), 3)
            out[case]["reply_cold_s"] = round(statistics.median(s.total_s or 0.0 for s in got["cold"]), 3)
    return out
