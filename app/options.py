"""Options shared by several commands, and their translation into engine objects.

An option whose default is `FromConfig(key)` takes the config file's value for ``key`` when
the flag is absent (`fill_from_config`, run by the CLI's parser right after parsing), else its
built-in default: flag > environment > config file > built-in.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmlocal.models.errors import ModelNotFoundError

from .config import BACKENDS

if TYPE_CHECKING:  # keep `--help` free of engine imports
    from llmlocal.engine import Grammar, Plan, SamplingParams
    from llmlocal.engine.planning.planner import Choice, Pins


@dataclass(frozen=True)
class FromConfig:
    """An option's default: the config file's ``key``, else ``builtin``."""

    key: str
    builtin: Any = None

    def __str__(self) -> str:  # what argparse's %(default)s would show
        return f"config {self.key}"


def fill_from_config(args: argparse.Namespace) -> None:
    """Replace every `FromConfig` default in ``args`` by its value, and a --system-preset by
    the preset's text. Reads the config file only when there is something to fill."""
    pending = {name: d for name, d in vars(args).items() if isinstance(d, FromConfig)}
    preset = getattr(args, "system_preset", None)
    wants_preset = preset is not None and getattr(args, "system", None) is None
    if not pending and not wants_preset:
        return
    from . import config

    cfg = config.load()
    for name, default in pending.items():
        value = cfg.get(default.key)
        setattr(args, name, default.builtin if value is None else value)
        if default.key == "model" and value is not None:
            args.model_set_in = str(cfg.path)  # named in the error if that model is gone
    if wants_preset:
        args.system = cfg.system_prompt(preset)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model", "--model, --backend, --ctx and --threads default to the config file's settings\n"
                 "where it has them (`llmlocal config list`)")
    g.add_argument("--model", "-m", default=FromConfig("model"), metavar="M",
                   help="model name or path to a .gguf file (default: `llmlocal models default`, "
                        "else smollm2-135m, bundled)")
    g.add_argument("--backend", default=FromConfig("backend", "auto"), choices=BACKENDS,
                   help="engine backend: llamacpp (GGUF on CPU), paged (our engine: CUDA, or CPU), "
                        "sparse (GGUF INT4 with calibrated activation sparsity, CPU); "
                        "default auto picks for the model and machine")
    g.add_argument("--ctx", type=int, default=FromConfig("ctx"), metavar="N",
                   help="context window in tokens (default: the model's, up to 8192)")
    g.add_argument("--threads", type=int, default=FromConfig("threads"), metavar="N",
                   help="CPU threads (default: physical cores)")
    g.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="render chats with this Jinja template file, or a named one (chatml), "
                        "instead of the model's own")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the paged backend runs (default: CUDA if present)")
    g.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="paged backend: KV cache pool size in blocks of 16 tokens")
    g.add_argument("--kv-cache-dir", default=FromConfig("kv_cache_dir"), metavar="DIR",
                   help="paged backend: keep full KV blocks of prompts and replies here, so a reopened "
                        "chat or a restarted server does not compute them again (default: "
                        "$XDG_CACHE_HOME/llmlocal/kv)")
    g.add_argument("--kv-cache-size", default=FromConfig("kv_cache_size"), metavar="SIZE",
                   help="bytes that directory may hold over all models, least recently used blocks "
                        "removed first (default 4G; 'off' is --no-kv-cache)")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="paged backend: no KV cache on disk (prompts are cached in memory only)")
    g.add_argument("--packed-cache-dir", default=FromConfig("packed_cache_dir"), metavar="DIR",
                   help="paged backend on the CPU: keep the weights in its kernels' layout here, so the "
                        "next load maps them instead of converting the model again (default: "
                        "$XDG_CACHE_HOME/llmlocal/packed)")
    g.add_argument("--packed-cache-size", default=FromConfig("packed_cache_size"), metavar="SIZE",
                   help="bytes that directory may hold over all models, least recently used models "
                        "removed first (default 16G; 'off' is --no-packed-cache)")
    g.add_argument("--no-packed-cache", action="store_true",
                   help="paged backend: convert the weights at every load, keep nothing on disk")
    g.add_argument("--draft", default=None, metavar="M",
                   help="paged backend: speculative decoding with draft model M (same tokenizer), "
                        "or 'ngram' to draft from the prompt itself")
    g.add_argument("--draft-k", type=int, default=None, metavar="K",
                   help="tokens the draft proposes per step (default: adaptive)")
    g.add_argument("--draft-weights", choices=["auto", "file"], default="auto",
                   help="the draft model's weights on the CPU: 'auto' runs its tensors of more than 4.5 bits a "
                        "weight as Q4_0 (faster drafts; the target still checks every token), 'file' as stored")
    g.add_argument("--endpoint", default=None, metavar="URL",
                   help="talk to an OpenAI-compatible server at URL (llama.cpp server, vLLM) "
                        "instead of loading a model here")
    g.add_argument("--api-key", default=None, metavar="K",
                   help="API key for --endpoint (default: $LLMLOCAL_API_KEY or $OPENAI_API_KEY)")
    g.add_argument("--sparsity", type=float, default=None, metavar="S",
                   help="sparse backend: fraction of activations to skip (default: the model's "
                        "calibrated level; 0 runs dense through the same kernels)")
    add_planner_options(g)


def add_planner_options(g: argparse._ActionsContainer) -> None:
    """Flags of the memory planner (shared by `plan`, `chat`, `run`)."""
    g.add_argument("--gpu-layers", type=int, default=None, metavar="N",
                   help="llama.cpp: layers to offload to the GPU (default: as many as fit; 0 is CPU only)")
    g.add_argument("--kv-dtype", default=None, choices=["f32", "f16", "bf16", "q8_0"],
                   help="KV cache type: q8_0 (int8 with a scale per 32 values) holds 1.88x the "
                        "context of f16 in the same memory (default: f16 on a CPU, the run's dtype on a GPU; "
                        "q8_0 where the planner finds f16 does not fit the context)")
    g.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory the model may use, instead of what is free now: 8G, or 8G,gpu=5G "
                        "(default: $LLMLOCAL_MEMORY_BUDGET, else probed)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sampling", "defaults: the config file's settings where it has them (`llmlocal config list`),\n"
                    "else those below")
    system = g.add_mutually_exclusive_group()
    system.add_argument("--system", "-s", default=None, metavar="S", help="system prompt")
    system.add_argument("--system-preset", default=None, metavar="NAME",
                        help="the system prompt saved as NAME in the config file's [system_prompts] "
                             "(`llmlocal config set system_prompts.NAME TEXT`)")
    g.add_argument("--max-tokens", "-n", type=int, default=FromConfig("max_tokens"), metavar="N",
                   help="stop after N tokens (default: when the model stops or the context is full)")
    g.add_argument("--temperature", "-t", type=float, default=FromConfig("temperature"), metavar="T",
                   help="sampling temperature; 0 is greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=FromConfig("top_k"), metavar="K", help="default: 40 (0 disables)")
    g.add_argument("--top-p", type=float, default=FromConfig("top_p"), metavar="P", help="default: 0.95")
    g.add_argument("--min-p", type=float, default=FromConfig("min_p"), metavar="P", help="default: 0.05")
    g.add_argument("--repeat-penalty", type=float, default=FromConfig("repeat_penalty"), metavar="R",
                   help="default: 1.0 (off)")
    g.add_argument("--seed", type=int, default=FromConfig("seed"), metavar="S",
                   help="random seed for reproducible sampling (default: a new one each run)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (repeatable)")


def add_format_options(parser: argparse.ArgumentParser, *, chat: bool = False) -> None:
    """The structured-output flags: --format json and --json-schema FILE (`run` and `chat`);
    for `run` also --regex and --choice. `grammar_from_args` turns them into a `Grammar`."""
    reply = "every reply of a new chat" if chat else "the reply"
    g = parser.add_argument_group(
        "structured output", f"{reply} is constrained token by token" + (" (F3 changes it per chat)" if chat else "")
    ).add_mutually_exclusive_group()
    g.add_argument("--format", choices=["json"], default=None, help=f"json: {reply} is a JSON object")
    g.add_argument("--json-schema", default=None, metavar="FILE", help=f"{reply} is JSON valid against the schema in FILE")
    if chat:
        return
    g.add_argument("--regex", default=None, metavar="RE", help="the whole reply matches the regular expression RE")
    g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the reply is one of these strings (repeat the option)")


def grammar_from_args(args: argparse.Namespace) -> Grammar | None:
    """The grammar the structured-output flags ask for, or None (not yet checked: `check_grammar`)."""
    from llmlocal.engine import Grammar

    if args.format == "json":
        return Grammar.json_object()
    if getattr(args, "regex", None) is not None:
        return Grammar.regex(args.regex)
    if getattr(args, "choice", None) is not None:
        return Grammar.choice(args.choice)
    if args.json_schema is None:
        return None
    return json_schema_file_grammar(args.json_schema, "check the --json-schema path")


def read_json_schema_file(path: str, fix: str) -> str:
    """The text of the JSON schema file ``path``; `LLMLocalError` ending in ``fix`` if it cannot be read."""
    from llmlocal.models.errors import LLMLocalError

    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise LLMLocalError(f"Cannot read the JSON schema {path} ({e.strerror}): {fix}.") from None
    except UnicodeDecodeError:
        raise LLMLocalError(f"The JSON schema {path} is not UTF-8 text: pass a .json file.") from None


def json_schema_file_grammar(path: str, fix: str) -> Grammar:
    from llmlocal.engine import Grammar

    return Grammar.json_schema(read_json_schema_file(path, fix))


def base_plan_from_args(args: argparse.Namespace, model: str | None = None) -> Plan:
    """The Plan the flags spell out, before the planner fills in what they leave open
    (``model``: another model than --model's, with the same flags)."""
    from llmlocal.engine import Plan

    return Plan(
        model=model if model is not None else args.model,
        backend=args.backend,
        device=args.device,
        n_ctx=args.ctx,
        threads=args.threads,
        gpu_layers=args.gpu_layers or 0,
        kv_blocks=args.kv_blocks,
        kv_dtype=getattr(args, "kv_dtype", None) or "auto",
        draft=args.draft,
        draft_k=args.draft_k,
        draft_weights=getattr(args, "draft_weights", "auto"),
        sparsity=args.sparsity,
        chat_template=getattr(args, "chat_template", None),
        endpoint=args.endpoint,
        api_key=args.api_key,
        **kv_cache_from_args(args),
        **packed_cache_from_args(args),
    )


def kv_cache_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Plan's kv_cache_dir and kv_cache_size from --kv-cache-dir, --kv-cache-size and
    --no-kv-cache (flag > environment > config file > the default directory)."""
    from llmlocal.engine.core.kv_disk import default_dir

    return _disk_cache(args, "kv_cache", "KV cache", 4 << 30, "4G or 512M", default_dir)


def packed_cache_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Plan's packed_cache_dir and packed_cache_size from --packed-cache-dir,
    --packed-cache-size and --no-packed-cache (the same order)."""
    from llmlocal.native.cpu.packed_cache import default_dir

    return _disk_cache(args, "packed_cache", "packed weights cache", 16 << 30, "16G or 4G", default_dir)


def _disk_cache(args: argparse.Namespace, key: str, what: str, default_size: int, example: str,
                default_dir: Callable[[], Path]) -> dict[str, Any]:
    """``{key}_dir`` and ``{key}_size`` from the arguments of that name and ``no_{key}``."""
    from llmlocal.models.errors import LLMLocalError

    from .config import kv_cache_bytes

    size_text = getattr(args, f"{key}_size", None)
    size = kv_cache_bytes(str(size_text)) if size_text is not None else default_size
    if size is False:
        raise LLMLocalError(f"Cannot read the {what} size '{size_text}': write it like {example}, or off.")
    if getattr(args, f"no_{key}", False) or size is None:
        return {f"{key}_dir": None}
    directory = getattr(args, f"{key}_dir", None) or default_dir()
    return {f"{key}_dir": str(Path(directory).expanduser()), f"{key}_size": size}


def pins_from_args(args: argparse.Namespace) -> Pins:
    """Every explicit flag pins its dimension; the planner chooses the others."""
    from llmlocal.engine.planning.planner import Pins

    return Pins(
        backend=args.backend if args.backend != "auto" else None,
        device=args.device if args.device != "auto" else None,
        n_ctx=args.ctx,
        gpu_layers=args.gpu_layers,
        draft=True if args.draft else None,
        kv_blocks=args.kv_blocks,
        kv_dtype=getattr(args, "kv_dtype", None),
    )


def choice_from_args(args: argparse.Namespace, model: str | None = None) -> Choice:
    """The planner's choice for the flags (what `llmlocal plan` prints); ``model``: another
    model than --model's (one picked in the chat), planned with the same flags pinned."""
    from llmlocal.engine.planning.planner import plan_model

    name = model if model is not None else args.model
    try:
        return plan_model(name, pins_from_args(args), base_plan_from_args(args, model), memory_budget=args.memory_budget)
    except ModelNotFoundError:
        set_in = getattr(args, "model_set_in", None)
        if set_in is None or model is not None:
            raise
        raise ModelNotFoundError(
            f"The default model '{args.model}' (set in {set_in}) is not on this machine: pull or restore it, "
            "or choose another with `llmlocal models default NAME`."
        ) from None


def plan_from_args(args: argparse.Namespace, model: str | None = None) -> Plan:
    """The Plan `chat` and `run` load: the planner's choice, with the flags' dimensions pinned
    (``model``: another model than --model's, as `choice_from_args`).

    Remote endpoints and the sparse backend are not sized by the planner: their Plan is the
    flags as given.
    """
    base = base_plan_from_args(args, model)
    if base.endpoint or base.backend in ("sparse", "remote"):
        return base
    return choice_from_args(args, model).plan


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags; what neither a flag nor the config file sets keeps the engine's default."""
    from llmlocal.engine import SamplingParams

    names = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "max_tokens")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return SamplingParams(**given, stop=tuple(args.stop))
