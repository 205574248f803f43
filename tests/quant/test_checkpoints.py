"""Small random-weight checkpoints: sharding, dtypes, architectures, tensor types, the Hub cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGUFReader
from quant_builders import byte_level_vocab

from llmlocal.models.tensor_names import permute_qk
from llmlocal.quant.encode import decode, encode
from llmlocal.quant.pipeline import QuantizeJob, quantize
from llmlocal.quant.safetensors_file import SafetensorsFile

Make = Callable[..., Path]


def _convert(src: Path | str, out: Path, type_name: str) -> GGUFReader:
    quantize(QuantizeJob(src=str(src), out=str(out), type=type_name, evaluate=False))
    return GGUFReader(out)


def _tensors(reader: GGUFReader) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in reader.tensors}


def _hf_rows(src: Path, name: str) -> np.ndarray:
    """A checkpoint tensor's stored values (BF16 as uint16 bits), whichever shard holds it."""
    for path in sorted(src.glob("*.safetensors")):
        with SafetensorsFile(path) as st:
            if name in st.entries:
                entry = st.entries[name]
                return np.array(st.rows(entry, 0, entry.n_rows))
    raise KeyError(name)


def test_sharded_and_single_file_checkpoints_convert_identically(random_checkpoint: Make, tmp_path: Path) -> None:
    single = random_checkpoint("single/model", shards=1, seed=3)
    sharded = random_checkpoint("sharded/model", shards=3, seed=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a = _convert(single, tmp_path / "a.gguf", "q8_0")
    b = _convert(sharded, tmp_path / "b.gguf", "q8_0")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert len(a.tensors) == len(b.tensors) == 2 * 9 + 3


def test_bf16_output_keeps_the_checkpoint_bits(random_checkpoint: Make, tmp_path: Path) -> None:
    src = random_checkpoint(dtype="BF16", heads=4, kv_heads=2)
    out = _tensors(_convert(src, tmp_path / "o.gguf", "bf16"))
    q_type, q = out["blk.0.attn_q.weight"]
    assert q_type == "BF16"
    assert np.array_equal(q.view(np.uint16), permute_qk(_hf_rows(src, "model.layers.0.self_attn.q_proj.weight"), 4))
    _, k = out["blk.1.attn_k.weight"]
    assert np.array_equal(k.view(np.uint16), permute_qk(_hf_rows(src, "model.layers.1.self_attn.k_proj.weight"), 2))
    norm_type, norm = out["blk.0.attn_norm.weight"]
    assert norm_type == "F32"  # vectors are widened, exactly
    assert np.array_equal(norm, decode(_hf_rows(src, "model.layers.0.input_layernorm.weight"), "BF16").ravel())


def test_q4_0_types_follow_llama_cpp_conventions(random_checkpoint: Make, tmp_path: Path) -> None:
    src = random_checkpoint(dtype="BF16", tie=False)
    reader = _convert(src, tmp_path / "o.gguf", "q4_0")
    out = _tensors(reader)
    assert out["output.weight"][0] == "Q8_0"  # the output projection keeps 8 bits
    assert out["token_embd.weight"][0] == "Q4_0"
    assert out["blk.0.ffn_down.weight"][0] == "Q4_0"
    assert out["output_norm.weight"][0] == "F32"
    expected = encode(decode(_hf_rows(src, "model.layers.0.mlp.down_proj.weight"), "BF16"), "Q4_0")
    assert np.array_equal(out["blk.0.ffn_down.weight"][1].ravel(), expected.ravel())
    assert reader.fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0


def test_tied_embeddings_make_token_embd_the_output_projection(random_checkpoint: Make, tmp_path: Path) -> None:
    out = _tensors(_convert(random_checkpoint(tie=True), tmp_path / "o.gguf", "q4_1"))
    assert "output.weight" not in out
    assert out["token_embd.weight"][0] == "Q8_0"


def test_rows_that_are_not_whole_blocks_fall_back_to_f16(random_checkpoint: Make, tmp_path: Path) -> None:
    src = random_checkpoint(d=80, heads=4, kv_heads=2, ffn=96)  # rows of 80 values: 2.5 blocks of 32
    out = _tensors(_convert(src, tmp_path / "o.gguf", "q8_0"))
    assert out["blk.0.attn_q.weight"][0] == "F16"
    assert out["blk.0.ffn_down.weight"][0] == "Q8_0"  # rows of 96 are whole blocks


def test_qwen2_keeps_hf_row_order_and_biases(random_checkpoint: Make, tmp_path: Path) -> None:
    src = random_checkpoint(model_type="qwen2", dtype="F16")
    reader = _convert(src, tmp_path / "o.gguf", "f16")
    out = _tensors(reader)
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert "qwen2.attention.head_count_kv" in reader.fields
    assert np.array_equal(out["blk.0.attn_q.weight"][1], _hf_rows(src, "model.layers.0.self_attn.q_proj.weight"))
    assert out["blk.0.attn_q.bias"][0] == "F32"
    assert out["blk.1.attn_v.bias"][1].shape == (32,)


def test_llama3_rope_scaling_becomes_rope_freqs(random_checkpoint: Make, tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    src = random_checkpoint(d=128, heads=2, kv_heads=1, extra_config={"rope_scaling": scaling, "rope_theta": 500000.0})
    out = _tensors(_convert(src, tmp_path / "o.gguf", "q8_0"))
    kind, divisors = out["rope_freqs.weight"]
    assert kind == "F32" and divisors.shape == (32,)  # head_dim / 2
    assert divisors[0] == 1.0 and divisors[-1] == 32.0  # fast rotations untouched, slow ones stretched
    assert np.all(np.diff(divisors) >= 0)


def test_vocabulary_is_padded_to_the_embedding_rows(random_checkpoint: Make, tmp_path: Path) -> None:
    tokens, merges = byte_level_vocab()
    reader = _convert(random_checkpoint(vocab=len(tokens) + 5), tmp_path / "o.gguf", "f32")
    f = reader.fields
    names = f["tokenizer.ggml.tokens"].contents()
    kinds = f["tokenizer.ggml.token_type"].contents()
    assert names[: len(tokens)] == tokens and names[-1] == f"[PAD{len(tokens) + 4}]"
    assert kinds[0] == 3 and kinds[10] == 1 and kinds[-1] == 5  # control, normal, unused
    assert f["tokenizer.ggml.merges"].contents() == merges
    assert f["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert f["tokenizer.ggml.bos_token_id"].contents() == 1 and f["tokenizer.ggml.eos_token_id"].contents() == 2


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_random_models_load_and_generate_in_llama_cpp(random_checkpoint: Make, tmp_path: Path, model_type: str) -> None:
    from llmlocal.engine import Engine, Plan, Request, SamplingParams

    src = random_checkpoint(model_type=model_type)
    _convert(src, tmp_path / "o.gguf", "q8_0")
    with Engine.load(Plan(model=str(tmp_path / "o.gguf"), backend="llamacpp", n_ctx=64, threads=1)) as engine:
        events = list(engine.generate(Request.chat([{"role": "user", "content": "hi"}],
                                                   SamplingParams(temperature=0, max_tokens=4))))
        assert events[-1].finish_reason in ("length", "stop")


def test_repo_id_resolves_from_the_local_hub_cache(random_checkpoint: Make, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--llmlocal-tests--tiny-llama"
    random_checkpoint("hub/models--llmlocal-tests--tiny-llama/snapshots/" + commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    result = quantize(QuantizeJob(src="llmlocal-tests/tiny-llama", type="q8_0", evaluate=False))
    assert Path(result.output) == tmp_path / "tiny-llama-Q8_0.gguf"
    reader = GGUFReader(result.output)
    assert reader.fields["general.name"].contents() == "tiny-llama"
    assert json.loads((repo / "snapshots" / commit / "config.json").read_text())["model_type"] == "llama"


def test_sentencepiece_style_vocabulary_tokenizes_like_hf(random_checkpoint: Make, tmp_path: Path) -> None:
    """Llama 2 / Mistral 7B tokenizers: BPE over '▁'-joined text with byte fallback. llama.cpp
    merges by score; our scores must reproduce the HF merge order exactly."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    from llmlocal.engine import Engine, Plan
    from llmlocal.quant.evaluate import builtin_eval_text

    text = builtin_eval_text()
    special = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=800, special_tokens=special + [f"<0x{i:02X}>" for i in range(256)], limit_alphabet=100))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    src = random_checkpoint(vocab=tok.get_vocab_size())
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    reader = _convert(src, tmp_path / "spm.gguf", "q8_0")
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.token_type"].contents()[3:259] == [6] * 256  # byte tokens
    samples = [text[:2500], "Naïve café — 3.14 ✓ 日本語", "  two leading spaces\tand a tab\n\nlines", "qzxv unusual"]
    with Engine.load(Plan(model=str(tmp_path / "spm.gguf"), backend="llamacpp", n_ctx=64, threads=1)) as engine:
        for sample in samples:
            assert engine.tokenize(sample) == [1] + tok.encode(sample, add_special_tokens=False).ids, sample


def test_cli_json_prints_one_object(cli: Callable[..., tuple[int, str, str]], random_checkpoint: Make,
                                    tmp_path: Path) -> None:
    code, stdout, err = cli("quantize", str(random_checkpoint()), "-o", str(tmp_path), "--type", "Q4_1",
                            "--no-eval", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["output"] == str(tmp_path / "tiny-Q4_1.gguf")  # a directory -o gets the default name
    assert result["type"] == "Q4_1" and result["quality"] is None
    assert result["tensor_types"]["Q4_1"] > 0 and result["bits_per_weight"] > 4
