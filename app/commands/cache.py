"""`llmlocal cache [list|clear]`: the KV blocks kept on disk, so prompts are not computed twice.

The paged engine keeps the full KV blocks of every prompt and reply it computes in a cache
directory (--kv-cache-dir, the config key kv_cache_dir, default $XDG_CACHE_HOME/llmlocal/kv),
up to a size bound (kv_cache_size, default 4G), least recently used blocks removed first. A
reopened chat or a restarted server reads the blocks it has seen instead of computing them.
Blocks are kept per model file and per way of computing them (backend, device, dtypes), so a
changed model file never reuses them.

On the CPU the paged engine also keeps each model's weights in its kernels' layout
(--packed-cache-dir, the config key packed_cache_dir, default $XDG_CACHE_HOME/llmlocal/packed,
up to packed_cache_size, default 16G), so a later load maps them instead of converting the
model again. They are listed and cleared here too.

Examples:

    llmlocal cache                    # what is kept, per model: blocks, tokens, size, last used
    llmlocal cache --json
    llmlocal cache clear              # remove everything
    llmlocal cache clear qwen2.5      # remove the blocks of the models whose name contains this
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmlocal.models.errors import LLMLocalError
from llmlocal.models.sizes import format_size

from ..options import FromConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help="list, size and clear the KV cache kept on disk",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", nargs="?", choices=["list", "clear"], default="list", help="list (default) or clear")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="clear: only the models whose name or path contains this")
    p.add_argument("--kv-cache-dir", default=FromConfig("kv_cache_dir"), metavar="DIR",
                   help="the cache directory (default: the config's kv_cache_dir, else $XDG_CACHE_HOME/llmlocal/kv)")
    p.add_argument("--packed-cache-dir", default=FromConfig("packed_cache_dir"), metavar="DIR",
                   help="the packed weights' directory (default: the config's packed_cache_dir, else "
                        "$XDG_CACHE_HOME/llmlocal/packed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmlocal.engine.core.kv_disk import clear, default_dir, describe
    from llmlocal.native.cpu.packed_cache import PackedCache
    from llmlocal.native.cpu.packed_cache import default_dir as packed_dir

    root = Path(args.kv_cache_dir).expanduser() if args.kv_cache_dir else default_dir()
    packed = PackedCache(Path(args.packed_cache_dir).expanduser() if args.packed_cache_dir else packed_dir())
    spaces, weights = describe(root), packed.entries()
    if args.action == "clear":
        if args.model is not None:
            def matches(*names: object) -> bool:
                return args.model.lower() in " ".join(map(str, names)).lower()

            spaces = [s for s in spaces if matches(s.model, s.path)]
            weights = [w for w in weights if matches(w["model"], w["path"])]
            if not spaces and not weights:
                raise LLMLocalError(f"Nothing kept for a model matching '{args.model}' in {root} or {packed.root}: "
                                    "`llmlocal cache` lists the models that have something.")
        files, size = clear(root, spaces)
        packed_files, packed_size = packed.clear(weights)
        if args.json:
            print(json.dumps({"directory": str(root), "removed_blocks": files, "removed_bytes": size,
                              "packed_directory": str(packed.root), "removed_packed_models": packed_files,
                              "removed_packed_bytes": packed_size}))
        else:
            print(f"Removed {files} blocks ({format_size(size)}) from {root}.")
            if packed_files:
                models = f"{packed_files} model{'s' if packed_files != 1 else ''}"
                print(f"Removed the packed weights of {models} ({format_size(packed_size)}) from {packed.root}.")
        return 0
    if args.json:
        print(json.dumps({"directory": str(root), "bytes": sum(s.bytes for s in spaces),
                          "models": [s.as_dict() for s in spaces],
                          "packed": {"directory": str(packed.root), "bytes": sum(int(w["bytes"]) for w in weights),  # type: ignore[call-overload]
                                     "models": weights}}, indent=1))
        return 0
    if not spaces:
        print(f"No KV blocks kept in {root} yet: the paged engine adds them as it computes prompts.")
    else:
        rows = [("model", "blocks", "tokens", "size", "last used")]
        rows += [(s.model, str(s.blocks), str(s.tokens), format_size(s.bytes), _ago(s.last_used)) for s in spaces]
        _table(rows)
        print(f"\n{format_size(sum(s.bytes for s in spaces))} in {root}")
    if weights:
        print()
        _table([("packed weights of", "size", "last used")] +
               [(str(w["model"]), format_size(int(w["bytes"])), _ago(float(w["last_used"]))) for w in weights])  # type: ignore[call-overload,arg-type]
        print(f"\n{format_size(sum(int(w['bytes']) for w in weights))} in {packed.root}")  # type: ignore[call-overload]
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())


def _ago(t: float | None) -> str:
    if t is None:
        return "-"
    seconds = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"
