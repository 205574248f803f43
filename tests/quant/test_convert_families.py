"""qwen3, gemma3_text, phi3 and Mistral with a sliding window: tiny random models built with
transformers, converted by `llmlocal quantize --type f32`, run in llama.cpp and in the engine's
own decoder (through its GGUF loader), and compared logit for logit with transformers' fp32
forward pass. And one config per family that
llama.cpp cannot run as transformers does, refused with a sentence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from quant_builders import byte_level_vocab, write_tokenizer
from llmlocal.quant.errors import CheckpointError
from llmlocal.quant.pipeline import QuantizeJob, QuantizeResult, quantize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS, MERGES = byte_level_vocab()
VOCAB = len(TOKENS)
# A sequence longer than the sliding windows below (8), so windowed layers differ from full ones.
SEQUENCE = [5, 77, 123, 9, 250, 31, 18, 200, 64, 3, 111, 42, 199, 7, 88, 150, 23, 61, 240, 12, 99, 175, 36, 58]
TOLERANCE = 1e-3  # on log-probabilities; llama.cpp's f32 path differs from torch by float rounding only
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _build(directory: Path, config: Any, seed: int = 0) -> Any:
    """A random model of ``config`` saved as a checkpoint (fp32 safetensors, tokenizer files);
    returns the model. Norm weights are perturbed so that their values (and Gemma's ``1 + w``)
    matter."""
    torch.manual_seed(seed)
    if config.model_type == "gemma3":  # an image-text checkpoint (Gemma 3 4B and up)
        model = transformers.Gemma3ForConditionalGeneration._from_config(config).float().eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    write_tokenizer(directory, TOKENS, MERGES, [0, 1, 2],
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
                    {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    return model


def _log_probs(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _llama_cpp_logits(gguf: Path, tokens: list[int], n_ctx: int = 64) -> np.ndarray:
    from llmlocal.engine.backends.llamacpp import open_llama

    llm = open_llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1,
                     n_threads_batch=1, logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


class _Fp16TableGelu(torch.nn.Module):  # type: ignore[misc]
    """GELU as ggml's CPU kernel computes it: a table of fp16 results indexed by the fp16 input
    (identity from 10 up, zero from -10 down). Its rounding moves Gemma's log-probabilities by
    about 3e-3; a reference that rounds the same way isolates what the conversion does."""

    def __init__(self, act: Any) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: Any) -> Any:
        y = self.act(x.half().float()).half().float()
        return torch.where(x >= 10, x, torch.where(x <= -10, torch.zeros_like(x), y))


def _compare(tmp_path: Path, config: Any, n_ctx: int = 64, fp16_gelu: bool = False) -> QuantizeResult:
    src = tmp_path / "model"
    model = _build(src, config)
    with torch.no_grad():
        plain = model(torch.tensor([SEQUENCE])).logits[0].numpy()
        if fp16_gelu:
            for layer in getattr(model.model, "language_model", model.model).layers:
                layer.mlp.act_fn = _Fp16TableGelu(layer.mlp.act_fn)
        expected = model(torch.tensor([SEQUENCE])).logits[0].numpy()
    out = tmp_path / "model-f32.gguf"
    result = quantize(QuantizeJob(src=str(src), out=str(out), type="f32", evaluate=False))
    got = _llama_cpp_logits(out, SEQUENCE, n_ctx)
    assert got.shape == expected.shape
    assert expected.std() > 0.5  # logits that differ enough between tokens for the check to mean something
    diff = np.abs(_log_probs(got) - _log_probs(expected))
    worst = np.unravel_index(diff.argmax(), diff.shape)[0]
    assert diff.max() < TOLERANCE, f"max |log p| difference {diff.max():.2e} at position {worst}"
    assert np.abs(_log_probs(got) - _log_probs(plain)).max() < 10 * TOLERANCE
    # and the engine's own decoder on the same file: exact (fp32) against transformers
    ours = _engine_logits(out, SEQUENCE, n_ctx)
    assert np.abs(_log_probs(ours) - _log_probs(plain)).max() < 1e-4
    return result


def _engine_logits(gguf: Path, tokens: list[int], n_ctx: int) -> np.ndarray:
    from llmlocal.engine.core.block_manager import BlockManager
    from llmlocal.engine.core.model_runner import ModelRunner, StepItem
    from llmlocal.engine.core.sequence import Sequence
    from llmlocal.engine.model.loader import load_gguf
    from llmlocal.models import spec_from_gguf

    model = load_gguf(spec_from_gguf(gguf), torch.device("cpu"), torch.float32, "dense", max_position=n_ctx)
    runner = ModelRunner(model, num_blocks=16, block_size=16, kv_dtype=torch.float32)
    seq = Sequence(0, tokens)
    BlockManager(16, 16).allocate(seq)
    logits, _ = runner.execute([StepItem(seq, 0, len(tokens), True)], all_rows=True)
    return logits.numpy()


def _refused(tmp_path: Path, config: Any, edit: Callable[[dict[str, Any]], None], *phrases: str) -> None:
    src = tmp_path / "bad"
    _build(src, config)
    data = json.loads((src / "config.json").read_text())
    edit(data)
    (src / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        quantize(QuantizeJob(src=str(src), out=str(tmp_path / "bad.gguf"), type="f32", evaluate=False))
    message = str(info.value)
    assert "\n" not in message and message.endswith("."), message
    for phrase in phrases:
        assert phrase in message, message
    assert not (tmp_path / "bad.gguf").exists()


# ---- qwen3 ---------------------------------------------------------------------------------
def _qwen3(**kw: Any) -> Any:
    # head_dim 32 with 4 heads of a 64-wide model: key_length differs from hidden / heads
    return transformers.Qwen3Config(**{**SHAPE, "num_hidden_layers": 2, "head_dim": 32, "tie_word_embeddings": True,
                                       "rope_theta": 1_000_000.0, **kw})


def test_qwen3_matches_transformers(tmp_path: Path) -> None:
    _compare(tmp_path, _qwen3())


def test_qwen3_with_sliding_window_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, _qwen3(), lambda c: c.update(use_sliding_window=True, sliding_window=8),
             "use_sliding_window")


# ---- gemma3_text ---------------------------------------------------------------------------
def _gemma3(**kw: Any) -> Any:
    # 7 layers: five sliding-window layers, the global layer 5, and a sliding one after it
    return transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 7, "head_dim": 16, "query_pre_attn_scalar": 16,
                                            "sliding_window": 8, **kw})


def test_gemma3_matches_transformers(tmp_path: Path) -> None:
    _compare(tmp_path, _gemma3(), fp16_gelu=True)


def test_gemma3_image_text_checkpoint_converts_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the language model under
    `language_model.`, its config under `text_config`, beside a vision tower. The conversion
    writes the language model (llama.cpp and the engine compute transformers' text logits) and
    says the vision tower was left out."""
    text = _gemma3()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    result = _compare(tmp_path, config, fp16_gelu=True)
    assert any("vision tower" in w for w in result.warnings), result.warnings


def test_gemma3_norms_are_written_plus_one(tmp_path: Path) -> None:
    from gguf import GGUFReader

    src = tmp_path / "model"
    model = _build(src, _gemma3(num_hidden_layers=1))
    quantize(QuantizeJob(src=str(src), out=str(tmp_path / "o.gguf"), type="f32", evaluate=False))
    reader = GGUFReader(tmp_path / "o.gguf")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    q_norm = model.model.layers[0].self_attn.q_norm.weight.detach().numpy()
    assert np.array_equal(tensors["blk.0.attn_q_norm.weight"], q_norm + np.float32(1))
    assert "output.weight" not in tensors  # tied embeddings
    assert reader.fields["gemma3.attention.sliding_window"].contents() == 8
    assert reader.fields["gemma3.attention.key_length"].contents() == 16


@pytest.mark.parametrize("edit, phrase", [
    (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_theta=50000.0), "RoPE base"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"] * 3 + ["sliding_attention"]), "global layer"),
    (lambda c: c.update(query_pre_attn_scalar=64), "query_pre_attn_scalar"),
])
def test_gemma3_configs_llama_cpp_cannot_run_are_refused(tmp_path: Path, edit: Callable[[dict[str, Any]], None],
                                                         phrase: str) -> None:
    _refused(tmp_path, _gemma3(num_hidden_layers=7), edit, phrase)


# ---- phi3 ----------------------------------------------------------------------------------
def _phi3(**kw: Any) -> Any:
    return transformers.Phi3Config(**{**SHAPE, "num_hidden_layers": 2, **kw})


def test_phi3_matches_transformers(tmp_path: Path) -> None:
    _compare(tmp_path, _phi3(sliding_window=32))


@pytest.mark.parametrize("original", [512, 16])
def test_phi3_longrope_and_partial_rotary_match_transformers(tmp_path: Path, original: int) -> None:
    """Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE factors, an attention factor
    from max / original context. With an original context of 512 both run the short factors
    (llama.cpp's context, 64, and the 24-token sequence fit in it); of 16, both the long ones."""
    rng = np.random.default_rng(1)
    rotary = 12  # of head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary / 16,
            "long_factor": (1 + 4 * rng.random(rotary // 2)).tolist(),
            "short_factor": (1 + rng.random(rotary // 2)).tolist()}
    _compare(tmp_path, _phi3(rope_parameters=rope, max_position_embeddings=2048,
                             original_max_position_embeddings=original, tie_word_embeddings=True), n_ctx=64)


def test_phi3_with_unequal_factor_lists_is_refused(tmp_path: Path) -> None:
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}

    def edit(c: dict[str, Any]) -> None:
        c["rope_parameters"]["short_factor"] = [1.0] * 5

    _refused(tmp_path, _phi3(rope_parameters=rope, max_position_embeddings=1024, original_max_position_embeddings=64),
             edit, "LongRoPE factors")


# ---- mistral -------------------------------------------------------------------------------
def _mistral(**kw: Any) -> Any:
    return transformers.MistralConfig(**{**SHAPE, "num_hidden_layers": 2, "sliding_window": 32,
                                         "max_position_embeddings": 128, **kw})


def test_mistral_with_sliding_window_matches_transformers(tmp_path: Path) -> None:
    """Within the window. llama.cpp's llama architecture attends to the whole context whatever
    ``llama.attention.sliding_window`` says, so past the window it parts from transformers
    (measured: log-probabilities 4 apart 13 tokens past a window of 8); the conversion warns."""
    from gguf import GGUFReader

    result = _compare(tmp_path, _mistral())
    assert GGUFReader(result.output).fields["llama.attention.sliding_window"].contents() == 32
    assert any("32-token sliding window" in w for w in result.warnings), result.warnings


def test_mistral_with_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, _mistral(), lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 10000.0}), "dynamic")


# ---- the engine's native decode step on each family ----------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_native_decode_step_gives_the_torch_layers_tokens(tmp_path: Path, family: str) -> None:
    """Converted to Q4_0, each family decodes through the native stack (`FastDecode`: QK-norm,
    sandwich norms, GELU, windows, the local RoPE table, partial rotary) and through the torch
    layers over the same kernels: the same greedy tokens, far past Gemma's window of 8. (A
    4-bit file keeps fp32 activations, so the two paths agree to float rounding; with int8
    activations a rounding flip moves this tiny random model's near ties.)"""
    from llmlocal.engine import Engine, Plan, Request, SamplingParams, TokenEvent
    from llmlocal.engine.model.fast_decode import FastDecode

    config = {"qwen3": _qwen3(), "gemma3": _gemma3(),
              "phi3": _phi3(sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.75})}[family]
    src = tmp_path / "model"
    _build(src, config)
    out = tmp_path / "model-q4_0.gguf"
    quantize(QuantizeJob(src=str(src), out=str(out), type="q4_0", evaluate=False))
    with Engine.load(Plan(model=str(out), backend="paged", n_ctx=256)) as engine:
        stack = engine.backend.runner.model.forward.__self__
        assert isinstance(stack, FastDecode)
        request = Request(prompt="Hello there, model!", sampling=SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        runs = {}
        try:
            for fast in (True, False):
                FastDecode.enabled = fast
                before = stack.tokens
                runs[fast] = [t for e in engine.generate(request) if isinstance(e, TokenEvent) for t in e.token_ids]
                assert (stack.tokens > before) == fast
        finally:
            FastDecode.enabled = True
    assert len(runs[True]) == 48 and runs[True] == runs[False]
