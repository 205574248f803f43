"""The real model: the starter checkpoint converted, loaded in llama.cpp, chatted with, and
measured. Claims about quality are made here, on the real weights, never on random ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGUFReader
from quant_builders import starter_tensors
from quant_checks import leftovers

from llmlocal.engine import Engine, Plan, Request, SamplingParams
from llmlocal.quant.evaluate import builtin_eval_text, evaluate_quality
from llmlocal.quant.pipeline import QuantizeJob, QuantizeResult, quantize

Outputs = Callable[[str], QuantizeResult]

# Descriptive general.* keys of the original file that a checkpoint does not carry, and keys
# the two files legitimately differ in.
_NOT_IN_CHECKPOINT = {"general.name", "general.organization", "general.finetune", "general.basename",
                      "general.languages", "general.file_type", "tokenizer.ggml.add_space_prefix"}


def test_f32_reproduces_the_dequantized_starter_exactly(starter_outputs: Outputs, starter_path: str) -> None:
    result = starter_outputs("f32")
    out = {t.name: t for t in GGUFReader(result.output).tensors}
    n = 0
    for name, expected in starter_tensors(starter_path):
        got = np.asarray(out[name].data)
        assert out[name].tensor_type.name == "F32"
        assert got.shape == expected.shape, name
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), name
        n += 1
    assert n == len(out) == 272


def test_metadata_matches_the_original_gguf(starter_outputs: Outputs, starter_path: str) -> None:
    original = GGUFReader(starter_path).fields
    converted = GGUFReader(starter_outputs("q8_0").output).fields
    compared = 0
    for key, field in original.items():
        if key.startswith("GGUF.") or key in _NOT_IN_CHECKPOINT:
            continue
        assert key in converted, key
        assert converted[key].contents() == field.contents(), key
        assert converted[key].types == field.types, key
        compared += 1
    assert compared >= 20  # hyperparameters, tokenizer (tokens, merges, types, ids, pre), template
    assert converted["general.file_type"].contents() == 7  # MOSTLY_Q8_0


def test_llama_cpp_tokenizes_like_the_hf_tokenizer(starter_outputs: Outputs, starter_checkpoint: Path) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(starter_checkpoint / "tokenizer.json"))
    text = builtin_eval_text()[:6000] + "\n  3.14159 naïve café <|im_start|>user\nhi<|im_end|>"
    with Engine.load(Plan(model=starter_outputs("q8_0").output, backend="llamacpp", n_ctx=256, threads=1)) as engine:
        assert engine.tokenize(text, add_special=False) == hf.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("type_name", ["q8_0", "q4_k_m"])
def test_outputs_chat_coherently(starter_outputs: Outputs, type_name: str) -> None:
    result = starter_outputs(type_name)
    if type_name == "q4_k_m":
        assert "Q4_K" in result.tensor_types or "Q5_0" in result.tensor_types  # llama.cpp's mix
    with Engine.load(Plan(model=result.output, backend="llamacpp", n_ctx=512)) as engine:
        request = Request.chat([{"role": "user", "content": "What color is the sky on a clear day?"}],
                               SamplingParams(temperature=0, max_tokens=40))
        done = list(engine.generate(request))[-1]
    assert "blue" in done.text.lower(), done.text


def test_a_float_gguf_source_gives_the_same_file_as_the_checkpoint(starter_outputs: Outputs, tmp_path: Path) -> None:
    from_gguf = tmp_path / "from-gguf.gguf"
    quantize(QuantizeJob(src=starter_outputs("f32").output, out=str(from_gguf), type="q8_0", evaluate=False))
    assert from_gguf.read_bytes() == Path(starter_outputs("q8_0").output).read_bytes()


def test_quality_numbers_are_sane(starter_outputs: Outputs) -> None:
    text = builtin_eval_text()
    reference = starter_outputs("f32").output
    q8 = evaluate_quality(reference, starter_outputs("q8_0").output, text, type_name="Q8_0", source_type="F32",
                          max_tokens=512)
    q4 = evaluate_quality(reference, starter_outputs("q4_0").output, text, type_name="Q4_0", source_type="F32",
                          max_tokens=512)
    assert q8.eval_tokens == q4.eval_tokens == 511
    assert q8.source_ppl == pytest.approx(q4.source_ppl)  # the same reference, the same text
    assert 1 < q8.source_ppl < 100  # a real model on real English
    assert abs(q8.output_ppl / q8.source_ppl - 1) < 0.01
    assert 0 <= q8.kld < q4.kld
    assert q8.top1_agreement > 0.9 and q8.top1_agreement >= q4.top1_agreement


def test_cli_prints_and_saves_the_quality_report(cli: Callable[..., tuple[int, str, str]], starter_checkpoint: Path,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "smol-q8.gguf"
    code, stdout, err = cli("quantize", str(starter_checkpoint), "-o", str(out), "--type", "q8_0",
                            "--eval-tokens", "200", "--eval-ctx", "128")
    assert code == 0, err
    assert "Traceback" not in err and "converting to Q8_0" in err and "evaluating" in err
    assert f"Wrote {out}: Q8_0" in stdout and "Quality of Q8_0 against the F32 source" in stdout
    report = json.loads(Path(f"{out}.quality.json").read_text())
    for key in ("type", "source_ppl", "output_ppl", "kld", "top1_agreement", "eval_tokens"):
        assert key in report, key
    assert report["type"] == "Q8_0" and report["eval_tokens"] == 200 - 2  # two windows of 128 tokens
    assert report["source"] == str(starter_checkpoint)
    assert abs(report["output_ppl"] / report["source_ppl"] - 1) < 0.02
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol-q8.gguf", "smol-q8.gguf.quality.json"]
    assert leftovers(tmp_path) == []


def test_the_paged_engine_loads_the_output(starter_outputs: Outputs) -> None:
    with Engine.load(Plan(model=starter_outputs("q4_0").output, backend="paged", n_ctx=256)) as engine:
        request = Request.chat([{"role": "user", "content": "What color is the sky on a clear day?"}],
                               SamplingParams(temperature=0, max_tokens=24))
        done = list(engine.generate(request))[-1]
    assert "sky" in done.text.lower(), done.text
