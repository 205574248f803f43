"""Every family the engine runs, against `transformers` in fp32: a tiny random model of each,
built offline from a config, saved as a checkpoint and run through our loader and paged model.

The logits must match over a whole prefill, a chunked prefill over a cached prefix and batched
decodes, at positions past the sliding window where the family has one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llmlocal.engine.core.block_manager import BlockManager
from llmlocal.engine.core.model_runner import ModelRunner, StepItem
from llmlocal.engine.core.sequence import Sequence
from llmlocal.engine.model.loader import load_hf

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VOCAB = 128
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=256)


def _configs() -> dict[str, object]:
    t = transformers
    return {
        "llama3": t.LlamaConfig(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
        "mistral": t.MistralConfig(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, sliding_window=8),
        "qwen2": t.Qwen2Config(**SHAPE, num_hidden_layers=2, num_key_value_heads=2),
        "qwen3": t.Qwen3Config(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, head_dim=32),
        # six layers: five local (window 8, RoPE base 10^4) and one global (10^6)
        "gemma3": t.Gemma3TextConfig(**SHAPE, num_hidden_layers=6, num_key_value_heads=1, head_dim=32,
                                     sliding_window=8, query_pre_attn_scalar=24),
        # Gemma 2's final-logit soft-capping, on Gemma 3's block: z -> 5 tanh(z / 5)
        "gemma3-softcap": t.Gemma3TextConfig(**SHAPE, num_hidden_layers=2, num_key_value_heads=1, head_dim=32,
                                             sliding_window=8, query_pre_attn_scalar=32, final_logit_softcapping=5.0),
        # Gemma 3 4B and up ship as image-text checkpoints: the language model is read, the vision tower left
        "gemma3-multimodal": t.Gemma3Config(
            text_config=t.Gemma3TextConfig(**SHAPE, num_hidden_layers=6, num_key_value_heads=1, head_dim=32,
                                           sliding_window=8, query_pre_attn_scalar=32),
            vision_config=t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=32, patch_size=8),
            mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2),
        "phi3": t.Phi3Config(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0, sliding_window=12),
        "phi3-longrope": t.Phi3Config(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0,
                                      original_max_position_embeddings=32, rope_scaling={
                                          "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                          "long_factor": [1.0 + 0.9 * i for i in range(8)]}),
        # Phi-4-mini's RoPE: 3/4 of each head rotates, with LongRoPE factors
        "phi3-partial": t.Phi3Config(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0,
                                     original_max_position_embeddings=32, rope_parameters={
                                         "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                         "long_factor": [1.0 + 0.9 * i for i in range(6)]}),
    }


def _checkpoint(name: str, directory: Path) -> torch.nn.Module:
    """A random model with weights large enough that every part moves the logits."""
    cfg = _configs()[name]
    torch.manual_seed(0)
    if cfg.model_type == "gemma3":  # image-text
        model = transformers.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager").float().eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norms: around 1 (Gemma stores w of 1 + w)
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if gemma else 1.0))
            elif "embed" in pname:
                p.copy_(torch.randn_like(p) * (0.3 if gemma else 1.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    model.save_pretrained(directory)
    return model


def _paged(directory: Path, positions: int = 256) -> ModelRunner:
    model = load_hf(directory, CPU, torch.float32, weights="dense", max_position=positions)
    return ModelRunner(model, num_blocks=64, block_size=4, kv_dtype=torch.float32)


FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma3", "gemma3-softcap", "gemma3-multimodal", "phi3", "phi3-longrope", "phi3-partial"]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    hf = _checkpoint(name, tmp_path)
    n = 40  # past every window (8, 12) and past phi3-longrope's original context (32)
    tokens = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    other = tokens[::-1]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
        ref_b = hf(torch.tensor([other])).logits[0].float()
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    runner = _paged(tmp_path)
    blocks = BlockManager(64, 4, enable_prefix_caching=False)

    def close(got: torch.Tensor, want: torch.Tensor, where: object) -> None:
        err = float((got - want).abs().max())
        assert err < tol, (name, where, err, tol)

    # one prefill of everything
    seq = Sequence(0, tokens)
    blocks.allocate(seq)
    logits, _ = runner.execute([StepItem(seq, 0, n, True)], all_rows=True)
    close(logits, ref, "prefill")
    blocks.free(seq)

    # chunked prefills over cached prefixes, then decodes batched with a second sequence
    a, b = Sequence(1, tokens), Sequence(2, other)
    # their tokens from positions 25 and 19 on stand for generated ones: decode rows (a prompt's
    # own rows take the prompt path however few)
    a.num_prompt_tokens, b.num_prompt_tokens = 25, 19
    blocks.allocate(a)
    blocks.allocate(b)
    out, _ = runner.execute([StepItem(a, 0, 11, True), StepItem(b, 0, 19, True)])
    close(out[0], ref[10], "chunk a")
    close(out[1], ref_b[18], "chunk b")
    out, _ = runner.execute([StepItem(a, 11, 14, True), StepItem(b, 19, 1, True)])
    close(out[0], ref_b[19], "decode b beside a chunk")
    close(out[1], ref[24], "second chunk a")
    for pos in range(25, n):
        items = [StepItem(a, pos, 1, True)] + ([StepItem(b, pos - 5, 1, True)] if pos - 5 >= 20 else [])
        out, order = runner.execute(items)
        close(out[0], ref[pos], ("decode a", pos))
        if len(items) > 1:
            close(out[1], ref_b[pos - 5], ("decode b", pos - 5))


def test_the_family_options_are_read_from_the_config(tmp_path: Path) -> None:
    from llmlocal.engine.model.config import config_from_hf

    _checkpoint("gemma3", tmp_path / "g")
    cfg = config_from_hf(tmp_path / "g")
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.sandwich_norms and cfg.activation == "gelu_tanh"
    assert cfg.layer_windows == (8, 8, 8, 8, 8, 0) and cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6
    assert cfg.scale == pytest.approx(24**-0.5) and cfg.embed_scale == pytest.approx(8.0) and cfg.tie_embeddings
    _checkpoint("phi3-longrope", tmp_path / "p")
    short, long = config_from_hf(tmp_path / "p", context=32), config_from_hf(tmp_path / "p", context=256)
    assert short.rope_scaling.divisors[1] == pytest.approx(1.1) and long.rope_scaling.divisors[1] == pytest.approx(1.9)
    assert long.rope_scaling.magnitude == pytest.approx((1 + torch.log(torch.tensor(8.0)).item() / torch.log(torch.tensor(32.0)).item()) ** 0.5)
