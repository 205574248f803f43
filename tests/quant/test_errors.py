"""Everything a user can get wrong ends in one sentence naming the fix, exit code 2, no file."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
from quant_checks import assert_one_sentence_error, leftovers

Cli = Callable[..., tuple[int, str, str]]


def _convert(cli: Cli, src: Path | str, out: Path, *extra: str) -> tuple[int, str, str]:
    return cli("quantize", str(src), "-o", str(out), "--no-eval", *extra)


def test_missing_source(cli: Cli, tmp_path: Path) -> None:
    code, _, err = _convert(cli, tmp_path / "nowhere", tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "does not exist")


def test_repo_id_not_in_the_cache(cli: Cli, tmp_path: Path) -> None:
    code, _, err = _convert(cli, "llmlocal-tests/not-downloaded-anywhere", tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "not in the local Hugging Face cache", "hf download")


def test_directory_without_config(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = _convert(cli, tmp_path / "empty", tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "no config.json")


def test_unsupported_architecture(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(extra_config={"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]})
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "'gemma2'", "llama, mistral, qwen2, qwen3")


def test_missing_shard(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(shards=3)
    (src / "model-00002-of-00003.safetensors").unlink()
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "missing model-00002-of-00003.safetensors", "download")


@pytest.mark.parametrize("damage", ["length", "json", "truncated", "offsets"])
def test_corrupt_safetensors(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path, damage: str) -> None:
    src = random_checkpoint()
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if damage == "length":
        data[:8] = struct.pack("<Q", 10**15)
    elif damage == "json":
        data[8:12] = b"\x00{[:"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        header = json.loads(data[8 : 8 + n])
        first = next(k for k in header if k != "__metadata__")
        header[first]["data_offsets"][1] += 4
        raw = json.dumps(header).encode().ljust(n)
        assert len(raw) == n
        data[8 : 8 + n] = raw
    path.write_bytes(bytes(data))
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "not a valid safetensors file")


def test_shapes_that_disagree_with_config(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(d=64)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "config.json implies", "does not belong")


def test_missing_layer(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(layers=2)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "lacks tensor 'model.layers.2.", "3 layers")


def test_missing_tokenizer(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint()
    (src / "tokenizer.json").unlink()
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "no tokenizer.json")


def test_pickle_weights_are_not_loaded(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint()
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "pickle", "safe_serialization=True")


def test_prequantized_checkpoint(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(extra_config={"quantization_config": {"quant_method": "gptq", "bits": 4}})
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "already quantized (gptq)")


def test_quantized_gguf_needs_allow_requantize(cli: Cli, starter_path: str, tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    code, _, err = _convert(cli, starter_path, out, "--type", "q8_0")
    assert_one_sentence_error(code, err, "already quantized (Q4_1)", "--allow-requantize")
    assert not out.exists()

    code, stdout, err = _convert(cli, starter_path, out, "--type", "q8_0", "--allow-requantize")
    assert code == 0, err
    assert "compounds" in err and "Traceback" not in err
    assert out.exists() and "Q8_0" in stdout


def test_output_directory_must_exist(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    code, _, err = _convert(cli, random_checkpoint(), tmp_path / "no" / "such" / "o.gguf")
    assert_one_sentence_error(code, err, "output directory", "does not exist")


def test_output_must_not_overwrite_the_source(cli: Cli, starter_path: str, tmp_path: Path) -> None:
    src = tmp_path / "model.gguf"
    shutil.copy(starter_path, src)
    code, _, err = _convert(cli, src, src, "--allow-requantize", "--type", "q8_0")
    assert_one_sentence_error(code, err, "source file itself")


def test_bad_eval_text_fails_before_converting(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    code, _, err = cli("quantize", str(random_checkpoint()), "-o", str(out), "--eval", str(tmp_path / "missing.txt"))
    assert_one_sentence_error(code, err, "does not exist", "--eval")
    assert not out.exists() and leftovers(tmp_path) == []


def test_unknown_type_is_rejected_by_the_library_too() -> None:
    from llmlocal.models.errors import LLMLocalError
    from llmlocal.quant.pipeline import QuantizeJob

    with pytest.raises(LLMLocalError, match="choose one of f32, f16"):
        QuantizeJob(src="x", type="q3_z")


def test_not_enough_free_space_is_found_before_writing(cli: Cli, random_checkpoint: Callable[..., Path],
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    from llmlocal.quant import pipeline

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "o.gguf"
    code, _, err = _convert(cli, random_checkpoint(), out)
    assert_one_sentence_error(code, err, "needs about", "free some space")
    assert not out.exists() and leftovers(tmp_path) == []


def test_unsupported_tensor_dtype(cli: Cli, random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(dtype="BF16")
    path = src / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n].replace(b'"dtype": "BF16"', b'"dtype": "I16" ', 1)  # same length, other type
    path.write_bytes(data[:8] + header + data[8 + n :])
    code, _, err = _convert(cli, src, tmp_path / "o.gguf")
    assert_one_sentence_error(code, err, "stored as I16", "BF16, F16 or F32")
