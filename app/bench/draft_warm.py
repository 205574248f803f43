"""A prefill with a draft model, the draft's K/V computed too (`DraftModel.warm`) against the
target's alone, in one engine, taking turns, each round a pasted text of its own (a benchmark:
it prints).

    python -m llmlocal.app.bench.draft_warm --model TARGET.gguf --draft DRAFT.gguf --prompt-tokens 700 --rounds 4

Each round plays the chat: the pasted text is prefilled as the chat does while the question is
typed (`Engine.prefill`, or the prefill of the target alone that the paged engine did before:
`LocalBackend.prefill`), then the message is sent for a reply of 32 tokens. Prints the
prefill's time and, from Enter, the time to the first token, to the 32nd, and the draft's share.
"""

from __future__ import annotations

import argparse
import threading
import time

from llmlocal.engine import Engine, Plan, Request, SamplingParams
from llmlocal.engine.backends.base import LocalBackend
from llmlocal.engine.types import DoneEvent

from .scenarios import _prompt, _run

REPLY = 32


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlocal.app.bench.draft_warm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the two prefills alternating (default: 4)")
    args = ap.parse_args(argv)
    plan = Plan(model=args.model, backend="paged", n_ctx=max(2048, args.prompt_tokens + 512), draft=args.draft)
    with Engine.load(plan) as engine:
        _run(engine, [{"role": "user", "content": "Say hi."}], 8)
        for r in range(args.rounds):
            warm = r % 2 == 0
            paste = f"({r}) Here is some text.\n" + _prompt(args.prompt_tokens, 20 + r)
            typed = Request.chat([{"role": "user", "content": paste + "\nSummarise"}])
            t = time.perf_counter()
            if warm:
                computed = engine.prefill(typed)
            else:
                computed = LocalBackend.prefill(engine.backend, typed, engine._prompt(typed), threading.Event())
            prefill_s = time.perf_counter() - t
            sent = Request.chat([{"role": "user", "content": paste + "\nSummarise it in one line."}],
                                SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True))
            drafter = engine.backend.drafter  # type: ignore[attr-defined]
            d0, t = drafter.seconds, time.perf_counter()
            done = [ev for ev in engine.generate(sent) if isinstance(ev, DoneEvent)][0]
            reply_s = time.perf_counter() - t
            print(f"{'target and draft' if warm else 'target alone    '}: prefill {prefill_s:.2f} s ({computed} tokens); "
                  f"from Enter: first token {done.stats.ttft_s:.2f} s, {REPLY} tokens {reply_s:.2f} s, "
                  f"the draft {drafter.seconds - d0:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
