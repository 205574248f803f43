"""A random-weight Hugging Face checkpoint of a real model's shape, built on the machine itself.

The GPU check measures speed and memory, which depend on a model's shapes and tensor types,
not on its values: so no weights travel to the GPU machine. This writes, into one directory,

* ``model.safetensors`` and ``config.json``: transformers' own Qwen2 model of the chosen
  shape with its random initialisation, saved in bf16 (built on the GPU where there is one);
* ``tokenizer.json``, ``tokenizer_config.json`` (a ChatML chat template) and
  ``generation_config.json``: a byte-level BPE trained here on the repository's evaluation
  text, with Qwen's three special tokens. Its vocabulary is smaller than the embedding; the
  converter names the rows past it as padding tokens, as it does for real Qwen checkpoints.

    python packaging/gpu_check_model.py OUT_DIR --shape qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB = 2048

# Qwen2.5-1.5B-Instruct's config.json, and a two-layer model of the same family for dry runs.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=BPE_VOCAB, max_position_embeddings=4096,
                 rope_theta=1000000.0, rms_norm_eps=1e-6),
}

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(directory: Path) -> dict[str, int]:
    """Train the byte-level BPE on the evaluation text; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = (REPO / "quant" / "eval_text.txt").read_text(encoding="utf-8")
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL}
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "add_bos_token": False, "chat_template": CHATML, "model_max_length": 32768}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    return ids


def build(directory: Path, shape: str, seed: int = 0) -> dict[str, Any]:
    """Write the checkpoint; returns what was built (for the check's log)."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ids = write_tokenizer(directory)
    config = transformers.Qwen2Config(
        **SHAPES[shape], hidden_act="silu", tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 1.5B values is quick there
    with torch.device(device), torch.no_grad():
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)  # safetensors
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return {"shape": shape, "parameters": params, "safetensors_bytes": size, "layers": config.num_hidden_layers,
            "hidden": config.hidden_size, "vocab": config.vocab_size, "built_on": device,
            "seconds": round(time.perf_counter() - t0, 1), "path": str(directory)}


def main() -> None:
    p = argparse.ArgumentParser(description="Write a random-weight Qwen2 checkpoint of a real shape.")
    p.add_argument("directory", type=Path)
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    args = p.parse_args()
    print(json.dumps(build(args.directory, args.shape)))


if __name__ == "__main__":
    main()
