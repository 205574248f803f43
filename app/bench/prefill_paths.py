"""The paged engine's prompt paths against each other, in one process, taking turns, each round
a cold prompt of its own for each path. One engine serves both, so the comparison is of the
kernels alone, on the same weights and the same memory (a benchmark: it prints).

    python -m llmlocal.app.bench.prefill_paths --model FILE.gguf --prompt-tokens 1000 --rounds 3
    python -m llmlocal.app.bench.prefill_paths --model FILE.gguf --prompt-tokens 4000 --compare attention
    python -m llmlocal.app.bench.prefill_paths --model FILE.gguf --compare activation

``--compare projections`` (the default): prompt rows through the AMX-BF16 tiles against the
int8 kernels (`runtime.set_qmat_tiles`), attention following them. ``--compare attention``:
the projections as this CPU runs them both times, the prompt's attention in the native kernel
(`kernels().attn_kernel()`: the tiles, AVX512-BF16 or float32 on AVX2) against torch's float32
attention (`runtime.set_attn_tiles`). ``--compare activation``: the MLP's act(gate) * up made by
the fused gate/up projection (`QuantLinear.gated`) against the projection's (N, 2F) product and
a native pass over it (`DecoderLayer.fuse_gated`).

Prints each round's time to first token per path and the median of the per-round ratios
(above 1, the tiles, the native attention or the fused activation are faster). Where the CPU has no such path it
says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from llmlocal.engine import Engine, Plan
from llmlocal.engine.model.llama import DecoderLayer
from llmlocal.native.cpu import runtime

from .scenarios import _prompt, _run

def _fuse_gated(on: bool) -> None:
    DecoderLayer.fuse_gated = on


SWITCHES = {"projections": runtime.set_qmat_tiles, "attention": runtime.set_attn_tiles, "activation": _fuse_gated}


def compare(model: str, prompt_tokens: int, rounds: int, what: str = "projections") -> dict[str, list[float]]:
    """TTFT per path (``tiles``, ``other``), one cold prompt per path and round."""
    switch = SWITCHES[what]
    ttft: dict[str, list[float]] = {"tiles": [], "other": []}
    with Engine.load(Plan(model=model, backend="paged", n_ctx=max(2048, 2 * prompt_tokens))) as engine:
        _run(engine, [{"role": "user", "content": "Say hello."}], 8)
        try:
            for i in range(rounds):
                for n, path in enumerate(ttft):
                    switch(path == "tiles")
                    text = "Summarise this list of words: " + _prompt(prompt_tokens, 500 + 2 * i + n)
                    done = _run(engine, [{"role": "user", "content": text}], 1, ignore_eos=True)
                    ttft[path].append(done.stats.ttft_s or 0.0)
        finally:
            switch(True)
    return ttft


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlocal.app.bench.prefill_paths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", choices=sorted(SWITCHES), default="projections",
                    help="the projections (tiles against int8 kernels), the attention (native kernel against float32) "
                         "or the MLP's activation (fused into the gate/up projection against a pass over its product)")
    args = ap.parse_args(argv)
    if args.compare == "projections" and not runtime.qmat_tiles():
        print("This CPU has no AMX-BF16 tiles (or LLMLOCAL_QMAT_TILES=0): prompt rows take the int8 kernels only.")
        return 2
    if args.compare == "attention" and not runtime.attn_tiles():
        print("This CPU has no native prompt attention (the scalar path, or AMX-BF16 tiles switched off): torch's only.")
        return 2
    ttft = compare(args.model, args.prompt_tokens, args.rounds, args.compare)
    ours, other = {"projections": ("tiles", "int8"), "attention": (runtime.kernels().attn_kernel(), "float32"),
                   "activation": ("fused", "a pass")}[args.compare]
    for path, times in ttft.items():
        print(f"{ours if path == 'tiles' else other:>7}: TTFT " + ", ".join(f"{t:.2f} s" for t in times))
    ratios = [b / a for a, b in zip(ttft["tiles"], ttft["other"]) if a]
    print(f"{args.compare} on {ours}, speed vs {other}: median {statistics.median(ratios):.2f}x, rounds "
          + ", ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
