"""`llmlocal bench SCENARIO`: measure the engine; prints one JSON object with --json.

Scenarios:
  decode   load time, batch-1 TTFT, decode tok/s, ITL p50/p95 and memory-bandwidth utilisation, per backend
           (and per KV cache type in --kv-dtype), after a short prompt or --prompt-tokens of context
  batch    N concurrent requests: paged (batched) vs llamacpp (one after another), KV waste
  prefix   TTFT of a follow-up turn on a ~1,500-token chat history, cached vs cold; and N questions on
           a fresh history sent together (--requests, default 4): the prompt rows they computed
  prefill  TTFT of a long prompt (--prompt-tokens), cold, per backend in --backends
  resume   the first request after a restart: a reopened chat and a restarted server whose
           prompt's blocks the KV cache on disk holds (--prompt-tokens of history), vs cold
           (with --draft M: drafting, and the time of a 32-token reply too)
  draft    TTFT of a pasted message of --prompt-tokens whose prefill ran while a question was
           typed for --pause seconds (the chat's draft prefill), vs sent cold, per backend
  spec     speculative decoding (paged): an fp32 target with an INT4 draft of itself on a
           story (or --draft M on a coding and a summarising prompt), and n-gram lookup on
           the summarising prompt; batch 1 and batch 8
  sparse   decode of the sparse backend (at --sparsity S, and at 0 through the same kernels)
           vs dense llama.cpp on the same GGUF, and the kernels' bandwidth; a model without
           thresholds is calibrated first (cached)
  grammar  constrained decoding (a nested JSON schema) against the same engine free, equal
           token counts, batch 1 and 8, per backend in --backends
  kernels  the native kernels' cost curve per GGUF type (and INT4, llmlocal's own 4-bit rows): a
           call of 1, 2, 4, 8, 16, 64 rows against one row, on a Qwen2.5-1.5B layer's shapes,
           one thread (--threads), the kernel this CPU runs (--kernel to pick another); --types
           to choose types

Examples:

    llmlocal bench decode --json
    llmlocal bench decode --backends paged --prompt-tokens 8000 --kv-dtype f16,q8_0 --max-tokens 64
    llmlocal bench batch --requests 16 --json
    llmlocal bench prefix --model ~/models/llama-3.2-1b-q4_0.gguf
    llmlocal bench prefill --model ~/models/qwen2.5-1.5b-q4_k_m.gguf --prompt-tokens 1000
    llmlocal bench resume --model ~/models/qwen2.5-1.5b-q4_k_m.gguf --prompt-tokens 4000
    llmlocal bench draft --model ~/models/qwen2.5-1.5b-q4_k_m.gguf --prompt-tokens 1000 --pause 5
    llmlocal bench spec --json
    llmlocal bench sparse --json --sparsity 0.5
    llmlocal bench grammar --backends paged --rounds 3
    llmlocal bench kernels --types Q4_K,Q6_K --kernel avx2 --json
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="measure speed: decode, batch, prefix, prefill, resume, draft, spec, sparse, grammar, kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenario",
                   choices=["decode", "batch", "prefix", "prefill", "resume", "draft", "spec", "sparse", "grammar", "kernels"])
    p.add_argument("--model", "-m", default=None, metavar="M", help="model name or path (default: smollm2-135m)")
    p.add_argument("--backends", default="paged,llamacpp", metavar="LIST",
                   help="decode, prefill, draft, grammar: backends to compare, comma-separated; batch: paged alone "
                        "compares batch N with the paged engine one request at a time (default: paged,llamacpp)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="batch: concurrent requests (default: 16); prefix: questions sent together (default: 4)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="decode: tokens per run (default: 128)")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="decode: decode after a prompt of about N tokens (default: a short prompt); prefill: the "
                        "prompt's length in tokens, about (default: 1000); resume: the chat history's and the "
                        "system prompt's (default: 4000); draft: the pasted message's (default: 1000)")
    p.add_argument("--pause", type=float, default=5.0, metavar="S",
                   help="draft: seconds between the paste and Enter, the question being typed (default: 5)")
    p.add_argument("--kv-dtype", default=None, metavar="LIST",
                   help="decode: KV cache types to compare, comma-separated, each backend once per type "
                        "(f16, q8_0, ...; default: each backend's own)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="decode, batch, prefill, resume, draft, spec, grammar: rounds in which the backends (spec: the "
                        "target alone, with the draft, with n-gram lookup; grammar: constrained and free) take turns "
                        "(default: 3, batch and spec 1)")
    p.add_argument("--draft", default=None, metavar="M",
                   help="spec: the draft model (default: the target's own file, as INT4); resume: draft with it, "
                        "and time 32-token replies (default: no draft)")
    p.add_argument("--draft-weights", default="auto", metavar="LIST",
                   help="spec: the draft's weights, comma-separated (auto: its tensors wider than 4.5 bits as Q4_0; "
                        "file: as stored); each further one a draft engine of its own, taking turns (default: auto)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="spec: sample at temperature T with the chat's top-k, top-p and min-p (default: 0, greedy)")
    p.add_argument("--sparsity", type=float, default=None, metavar="S",
                   help="sparse: activation sparsity to run at (default: the model's calibrated level; "
                        "0.5 to calibrate a model that has none)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="decode, prefill, draft, sparse: CPU threads (default: physical cores); kernels: default 1")
    p.add_argument("--types", default=None, metavar="LIST",
                   help="kernels: GGUF types, comma-separated (default: Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q4_1,Q5_0)")
    p.add_argument("--kernel", default=None, metavar="K",
                   help="kernels: the variant to run (scalar, avx2, avxvnni, avx512vnni, avx512vnni-amx; "
                        "default: the one this CPU runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmlocal.app.bench import scenarios as bench
    from llmlocal.models.errors import LLMLocalError

    if args.requests is not None and args.requests < 1:
        raise LLMLocalError("--requests must be at least 1.")
    if args.rounds is not None and args.rounds < 1:
        raise LLMLocalError(f"--rounds must be 1 or more, not {args.rounds}.")
    if args.scenario == "decode":
        from llmlocal.engine.plan import KV_DTYPES

        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        if args.prompt_tokens is not None and args.prompt_tokens < 16:
            raise LLMLocalError(f"--prompt-tokens must be at least 16, not {args.prompt_tokens}.")
        kinds = [k.strip() for k in args.kv_dtype.split(",") if k.strip()] if args.kv_dtype else None
        for k in kinds or []:
            if k not in KV_DTYPES:
                raise LLMLocalError(f"Unknown KV cache type '{k}' in --kv-dtype: choose from {', '.join(KV_DTYPES)}.")
        result = bench.bench_decode(args.model, backends, max_tokens=args.max_tokens, rounds=args.rounds or 3,
                                    threads=args.threads, prompt_tokens=args.prompt_tokens, kv_dtypes=kinds)
    elif args.scenario == "batch":
        # without llamacpp in --backends: the paged engine one request at a time is the baseline
        baseline = "llamacpp" if "llamacpp" in [b.strip() for b in args.backends.split(",")] else "paged"
        result = bench.bench_batch(args.model, requests=args.requests or 16, baseline=baseline, rounds=args.rounds or 1)
    elif args.scenario == "prefix":
        result = bench.bench_prefix(args.model, together=args.requests or 4)
    elif args.scenario == "prefill":
        tokens = 1000 if args.prompt_tokens is None else args.prompt_tokens
        if tokens < 16:
            raise LLMLocalError(f"--prompt-tokens must be at least 16, not {tokens}.")
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        result = bench.bench_prefill(args.model, backends, tokens, rounds=args.rounds or 3, threads=args.threads)
    elif args.scenario == "resume":
        from llmlocal.app.bench.resume import bench_resume

        tokens = 4000 if args.prompt_tokens is None else args.prompt_tokens
        if tokens < 64:
            raise LLMLocalError(f"--prompt-tokens must be at least 64, not {tokens}.")
        result = bench_resume(args.model, tokens, rounds=args.rounds or 2, threads=args.threads, draft=args.draft)
    elif args.scenario == "draft":
        from llmlocal.app.bench.draft import bench_draft

        tokens = 1000 if args.prompt_tokens is None else args.prompt_tokens
        if tokens < 16 or args.pause < 0:
            raise LLMLocalError(f"--prompt-tokens must be at least 16 and --pause at least 0, not {tokens} and {args.pause}.")
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        result = bench_draft(args.model, backends, tokens, pause_s=args.pause, rounds=args.rounds or 2, threads=args.threads)
    elif args.scenario == "sparse":
        from llmlocal.app.bench.sparse import bench_sparse

        if args.sparsity is not None and not 0.0 <= args.sparsity < 1.0:
            raise LLMLocalError(f"--sparsity must be in [0, 1), got {args.sparsity}.")
        result = bench_sparse(args.model, args.sparsity, max_tokens=args.max_tokens, threads=args.threads)
    elif args.scenario == "kernels":
        from llmlocal.native.cpu import bench_kernels as bk
        from llmlocal.native.cpu import runtime

        if not runtime.built():
            raise LLMLocalError("The native kernels are not built in this install: reinstall llmlocal with a C compiler.")
        types = [t.strip().upper() for t in (args.types or ",".join(bk.ALL_TYPES)).split(",") if t.strip()]
        unknown = [t for t in types if t not in bk.ALL_TYPES]
        if unknown:
            raise LLMLocalError(f"Unknown type {', '.join(unknown)} for --types: choose from {', '.join(bk.ALL_TYPES)}.")
        if args.kernel is not None and args.kernel not in bk.KERNELS:
            raise LLMLocalError(f"Unknown kernel '{args.kernel}': choose from {', '.join(bk.KERNELS)}.")
        try:
            result = bk.bench_kernels(types, kernel=args.kernel, threads=args.threads or 1)
        except ValueError as e:
            raise LLMLocalError(f"{e}: leave out --kernel for the one this CPU runs.") from None
        print(json.dumps(result) if args.json else bk.format_table(result))
        return 0
    elif args.scenario == "grammar":
        from llmlocal.app.bench.grammar import bench_grammar

        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        result = bench_grammar(args.model, backends, rounds=args.rounds or 3, threads=args.threads)
    else:
        from llmlocal.app.bench.spec import bench_spec
        from llmlocal.engine.plan import DRAFT_WEIGHTS

        weights = tuple(w.strip() for w in args.draft_weights.split(",") if w.strip())
        if not weights or any(w not in DRAFT_WEIGHTS for w in weights):
            raise LLMLocalError(f"--draft-weights takes {' or '.join(DRAFT_WEIGHTS)}, comma-separated, not "
                                f"{args.draft_weights!r}.")
        result = bench_spec(args.model, args.draft, max_tokens=args.max_tokens, rounds=args.rounds or 1,
                            temperature=args.temperature, draft_weights=weights)
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    return 0


def render(result: dict) -> str:
    """The figures of a benchmark as aligned lines: one per backend or group, one per value."""
    lines = []
    for key, value in result.items():
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):  # per backend
            lines += [f"{name:>10}: {_figures(figures)}" for name, figures in value.items()]
        elif isinstance(value, dict):  # one group of figures (bench spec's larger batch)
            lines.append(f"{key:>22}: {_figures(value)}")
        else:
            lines.append(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
    return "\n".join(lines)


def _figures(figures: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
