"""`bench draft`: the first token of a long pasted message whose prefill ran while the question
under it was typed, against the same message sent cold.

What the chat does (`app/tui/draft_prefill.py`): a user pastes about ``tokens`` of text and the
prefill of the conversation with it starts at once; the user types a question for ``pause_s``
seconds and presses Enter, which stops the prefill where it is (the blocks it finished stay
cached) and sends the message. TTFT is counted from Enter. Cold: the same wait, nothing
computed ahead. Rounds take turns (prefilled, then cold), each with a text of its own; one
engine per backend in ``backends``.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from llmlocal.engine import Engine, Plan, Request

from .scenarios import _prompt, _run

QUESTION = "Which of the words above name an animal?"


def _turn(engine: Engine, paste: str, pause_s: float, ahead: bool) -> tuple[float, int]:
    """One message: (TTFT from Enter, prompt tokens that came from the cache)."""
    stop = threading.Event()
    worker = None
    if ahead:
        draft = Request.chat([{"role": "user", "content": paste + "\n\n"}])
        worker = threading.Thread(target=engine.prefill, args=(draft, stop))
        worker.start()
    time.sleep(pause_s)  # the question being typed
    stop.set()
    done = _run(engine, [{"role": "user", "content": paste + "\n\n" + QUESTION}], 1, ignore_eos=True)
    if worker is not None:
        worker.join()
    return done.stats.ttft_s or 0.0, done.stats.cached_prompt_tokens or 0


def bench_draft(model: str | None, backends: list[str], tokens: int = 1000, pause_s: float = 5.0, rounds: int = 2,
                threads: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": "draft", "model": model or "smollm2-135m", "pause_s": pause_s}
    for backend in backends:
        with Engine.load(Plan(model=model, backend=backend, n_ctx=max(2048, tokens + 512), threads=threads)) as engine:
            _run(engine, [{"role": "user", "content": "warm up"}], 1)
            runs: dict[str, list[tuple[float, int]]] = {"prefilled": [], "cold": []}
            for r in range(rounds):
                runs["prefilled"].append(_turn(engine, _prompt(tokens, 700 + 2 * r), pause_s, True))
                runs["cold"].append(_turn(engine, _prompt(tokens, 701 + 2 * r), pause_s, False))
            prompt_tokens = engine.count_tokens([{"role": "user", "content": _prompt(tokens, 700) + "\n\n" + QUESTION}])
        warm = statistics.median(t for t, _ in runs["prefilled"])
        cold = statistics.median(t for t, _ in runs["cold"])
        out[backend] = {
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": min(c for _, c in runs["prefilled"]),
            "ttft_prefilled_s": round(warm, 3),
            "ttft_cold_s": round(cold, 3),
            "speedup": round(cold / warm, 2) if warm else None,
            "ttft_prefilled_s_per_round": [round(t, 3) for t, _ in runs["prefilled"]],
            "ttft_cold_s_per_round": [round(t, 3) for t, _ in runs["cold"]],
        }
    return out
