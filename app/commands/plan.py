"""`llmlocal plan [MODEL]`: what fits this machine, and why — chosen before loading anything.

Prints the configuration `chat` and `run` would load (backend, device, GPU layers, context,
KV cache type), its memory per device as a bar (weights, KV cache, compute buffers,
overhead, free), the reasons, and the best alternatives. Flags pin a dimension; the planner
fills in the rest.

Examples:

    llmlocal plan                                  # the default model (`llmlocal models default`)
    llmlocal plan ~/models/llama-3.1-8b-q4_k_m.gguf --ctx 32768
    llmlocal plan model.gguf --backend llamacpp --gpu-layers 20
    llmlocal plan model.gguf --memory-budget 6G --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import BACKENDS
from ..options import FromConfig, add_planner_options

BAR_WIDTH = 48
# (field, bar character, label)
_PARTS = (("weights", "█", "weights"), ("kv", "▓", "KV cache"), ("compute", "▒", "compute"), ("overhead", "░", "overhead"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="what fits this machine, and why (no model is loaded)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", nargs="?", default=FromConfig("model"),
                   help="model name or path to a .gguf file (default: `llmlocal models default`, "
                        "else smollm2-135m, bundled)")
    g = p.add_argument_group("pins (each flag fixes that dimension; --ctx and --backend default to the config file's)")
    g.add_argument("--ctx", type=int, default=FromConfig("ctx"), metavar="N", help="context window in tokens")
    g.add_argument("--backend", default=FromConfig("backend", "auto"), choices=BACKENDS, help="engine backend")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    g.add_argument("--kv-blocks", type=int, default=None, metavar="N", help="paged backend: KV pool size in blocks of 16 tokens")
    g.add_argument("--draft", default=None, metavar="M", help="paged backend: count draft model M (or 'ngram')")
    add_planner_options(g)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run, threads=FromConfig("threads"), draft_k=None, sparsity=None, endpoint=None, api_key=None)


def run(args: argparse.Namespace) -> int:
    from ..options import choice_from_args

    choice = choice_from_args(args)
    if args.json:
        print(json.dumps(choice.to_dict()))
    else:
        print(render(choice, args.model or "smollm2-135m"))
    return 0


def render(choice: Any, name: str) -> str:
    """The chosen plan, a memory bar per device, the reasons and the alternatives."""
    from llmlocal.engine.planning.memory_model import gib

    c = choice.chosen
    hw = choice.hardware
    machine = f"{gib(hw.available_ram)} of {gib(hw.total_ram)} RAM available ({hw.budget_source})"
    for g in hw.gpus:
        machine += f"; {g.device} {g.name}: {gib(g.free_bytes)} of {gib(g.total_bytes)} free"
    lines = [f"{name}: {c.describe()}", f"this machine: {machine}", ""]
    for d in c.devices:
        budget = c.budgets[d.device]
        lines.append(f"{d.device:<7}{_bar(d, budget)}  {gib(d.need)} of {gib(budget)}")
        legend = [f"{ch} {label} {gib(getattr(d, field))}" for field, ch, label in _PARTS if getattr(d, field)]
        legend.append(f"· free {gib(max(0, budget - d.need))}")
        lines.append(" " * 7 + "  ".join(legend))
        if d.reclaimable:
            lines.append(" " * 7 + f"(weights include {gib(d.reclaimable)} of mapped pages the kernel may drop)")
        if d.load_peak > d.total:
            lines.append(" " * 7 + f"(loading peaks at {gib(d.load_peak)})")
    lines.append("")
    lines += [f"- {r}" for r in choice.reasons]
    if choice.alternatives:
        lines += ["", "alternatives:"] + [f"  {a.describe()}" for a in choice.alternatives]
    return "\n".join(lines)


def _bar(d: Any, budget: int) -> str:
    """One character per budget / BAR_WIDTH bytes; '|' marks where the safety margin starts."""
    from llmlocal.engine.planning.planner import usable_budget

    scale = BAR_WIDTH / max(budget, 1)
    cells: list[str] = []
    used = 0
    for field, ch, _ in _PARTS:  # cumulative rounding: the parts add up to the whole
        used += getattr(d, field)
        cells += [ch] * max(0, round(used * scale) - len(cells))
    cells = cells[:BAR_WIDTH] + ["·"] * max(0, BAR_WIDTH - len(cells))
    margin = min(BAR_WIDTH - 1, round(usable_budget(budget) * scale))
    cells[margin] = "|"
    return "[" + "".join(cells) + "]"
