"""`llmlocal quantize SRC`: a Hugging Face checkpoint or a GGUF -> a quantized GGUF, with a
report of what the quantization cost in quality.

SRC is a checkpoint directory (config.json, *.safetensors, tokenizer.json), a Hugging Face
repo id already in the local cache, or an F32/F16/BF16 GGUF. The output loads in
`llmlocal run/chat`. Unless --no-eval, the source and the output are run on the same text and
compared (perplexity, KL divergence, top-1 agreement); the numbers are printed and saved as
OUT.gguf.quality.json.

Examples:

    llmlocal quantize ~/models/Llama-3.2-1B-Instruct          # -> ./Llama-3.2-1B-Instruct-Q4_K_M.gguf
    llmlocal quantize Qwen/Qwen2.5-0.5B-Instruct --type q8_0 -o qwen-q8.gguf
    llmlocal quantize model-F16.gguf --type q5_k_m --eval my-notes.txt
    llmlocal quantize model-Q8_0.gguf --type q4_k_m --allow-requantize --no-eval
    llmlocal quantize ~/models/Llama-3.2-1B-Instruct --type q4_0 --sparsity 0.4
    llmlocal quantize model-Q4_0.gguf --sparsity 0.4 -o model-sparse.gguf   # calibrate only
    llmlocal quantize model-Q4_K_M.gguf --sparsity ffn_down=0.6             # a profile: one projection

With --sparsity S, the output is run on calibration text (half of the built-in text, or
--calib FILE) and per-layer thresholds that zero a fraction S of each projection's input
activations are stored in it (llmlocal.sparsity.* keys), for llmlocal's sparse CPU engine;
llama.cpp ignores them. --sparsity ffn_down=0.6 (a profile) sparsifies only the projections
named, each at its own level: the MLP's down projection loses the least quality per weight
skipped (docs/performance.md). The report then adds the sparse model against the dense one on the
other half of the text (saved as OUT.gguf.sparsity.json). A 4-bit GGUF given without --type
keeps its tensors byte for byte: only the thresholds are added.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from llmlocal.models.spec import DEFAULT_SPARSITY, DEFAULT_SPARSITY_PROFILE, DEFAULT_SPARSITY_REQUEST
from llmlocal.quant.formats import DEFAULT_FORMAT, FORMATS


def _types_epilog() -> str:
    lines = ["types:"]
    for fmt in FORMATS.values():
        by = "" if fmt.writer == "llmlocal" else "  [llama.cpp quantizer]"
        lines.append(f"  {fmt.name:<8} {fmt.description}{by}")
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="convert a Hugging Face checkpoint or GGUF to a quantized GGUF, with a quality report",
        description=__doc__,
        epilog=_types_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="checkpoint directory, Hugging Face repo id (from the local cache) or .gguf file")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="output .gguf file or directory (default: ./<name>-<TYPE>.gguf)")
    p.add_argument("--type", default=None, type=str.lower, choices=list(FORMATS), metavar="TYPE",
                   help=f"output type (default: {DEFAULT_FORMAT}, or with --sparsity on a 4-bit GGUF its own "
                        "tensors; see the list below)")
    g = p.add_argument_group("quality report")
    g.add_argument("--eval", metavar="TEXTFILE", default=None,
                   help="evaluate on this UTF-8 text instead of the built-in text")
    g.add_argument("--no-eval", action="store_true", help="skip the quality report")
    g.add_argument("--eval-ctx", type=int, default=512, metavar="N", help="tokens per evaluation window (default: 512)")
    g.add_argument("--eval-tokens", type=int, default=None, metavar="N",
                   help="evaluate at most N tokens of the text (default: all)")
    sp = p.add_argument_group("activation sparsity")
    sp.add_argument("--sparsity", type=_sparsity, nargs="?", const=DEFAULT_SPARSITY_REQUEST, default=None, metavar="S",
                   help="calibrate thresholds that zero a fraction S of each projection's inputs and store them "
                        "in the GGUF, or of the projections named, each its own: ffn_down=0.6[,attn_output=0.3] "
                        f"(default: {DEFAULT_SPARSITY} for a file of 4-bit types only, such as Q4_0, else "
                        f"{','.join(f'{p}={v}' for p, v in DEFAULT_SPARSITY_PROFILE.items())}; the output type must be 4-bit)"),
    sp.add_argument("--calib", metavar="TEXTFILE", default=None,
                   help="calibrate on this UTF-8 text (default: half of the built-in text; the other half evaluates)")
    p.add_argument("--allow-requantize", action="store_true",
                   help="accept an already-quantized GGUF as SRC (its rounding error compounds)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.set_defaults(func=run)


def _sparsity(text: str) -> object:
    """--sparsity's value: a level, or a profile (a bad one raises the one-sentence error);
    with no value argparse passes the default request here too."""
    from llmlocal.quant.sparsity import parse_sparsity

    return text if text == DEFAULT_SPARSITY_REQUEST else parse_sparsity(text)


def run(args: argparse.Namespace) -> int:
    from llmlocal.quant.pipeline import QuantizeJob, quantize

    job = QuantizeJob(
        src=args.src,
        out=args.output,
        type=args.type,
        evaluate=not args.no_eval,
        eval_text=args.eval,
        eval_ctx=args.eval_ctx,
        eval_tokens=args.eval_tokens,
        allow_requantize=args.allow_requantize,
        threads=args.threads,
        sparsity=args.sparsity,
        calib_text=args.calib,
    )
    result = quantize(job, stream=sys.stderr)
    if args.json:
        print(json.dumps(_result_dict(result), ensure_ascii=False))
        return 0
    from llmlocal.models.sizes import format_size

    types = ", ".join(f"{n} {t}" for t, n in result.tensor_types.items())
    print(
        f"Wrote {result.output}: {result.type}, {format_size(result.output_bytes)}, "
        f"{result.bits_per_weight:.2f} bits per weight, in {result.seconds:.1f} s (tensors: {types})."
    )
    if result.sparsity is not None:
        sp = result.sparsity
        print(
            f"Stored activation thresholds for {sp.describe()} sparsity ({len(sp.thresholds)} projections x "
            f"{len(next(iter(sp.thresholds.values())))} layers), calibrated on {sp.calibration_tokens:,} tokens "
            f"of {sp.calibration_text}."
        )
    if result.quality is not None:
        print(result.quality.table())
        print(f"Saved the report to {result.quality_path}.")
    if result.sparsity_quality is not None:
        print(result.sparsity_quality.table())
        print(f"Saved the sparsity report to {result.sparsity_path}.")
    sys.stdout.flush()
    return 0


def _result_dict(result: Any) -> dict[str, Any]:
    out = {k: v for k, v in result.__dict__.items() if k not in ("quality", "sparsity", "sparsity_quality")}
    out["warnings"] = list(result.warnings)
    out["bits_per_weight"] = round(result.bits_per_weight, 3)
    out["quality"] = result.quality.to_dict() if result.quality is not None else None
    out["sparsity"] = dataclasses.asdict(result.sparsity) if result.sparsity is not None else None
    out["sparsity_quality"] = result.sparsity_quality.to_dict() if result.sparsity_quality is not None else None
    return out
