"""A small random-weight Llama checkpoint written by the tests, and an unpaged reference
forward pass written independently of the engine's model code (plain causal attention over
the whole sequence, Hugging Face conventions)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def write_checkpoint(directory: Path, seed: int = 0, **overrides: object) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    cfg = {**CONFIG, **overrides}
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(v, d, scale=1.0), "model.norm.weight": 1 + rnd(d)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(d),
            p + "post_attention_layernorm.weight": 1 + rnd(d),
            p + "self_attn.q_proj.weight": rnd(d, d),
            p + "self_attn.k_proj.weight": rnd(kv, d),
            p + "self_attn.v_proj.weight": rnd(kv, d),
            p + "self_attn.o_proj.weight": rnd(d, d),
            p + "mlp.gate_proj.weight": rnd(f, d),
            p + "mlp.up_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f),
        }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file({k: t.contiguous() for k, t in w.items()}, str(directory / "model.safetensors"))
    return w


def reference_logits(w: dict[str, torch.Tensor], tokens: list[int], cfg: dict | None = None) -> torch.Tensor:
    """(T, vocab) logits of every position, float64, no cache."""
    cfg = {**CONFIG, **(cfg or {})}
    w = {k: t.double() for k, t in w.items()}
    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // nh
    t = len(tokens)
    eps = cfg["rms_norm_eps"]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]  # (T, hd/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, hd)

    def rope(x: torch.Tensor) -> torch.Tensor:  # (heads, T, hd)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(nh // nkv, 0)
        v = v.repeat_interleave(nh // nkv, 0)
        scores = q @ k.transpose(1, 2) / hd**0.5  # (nh, T, T)
        scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, d)
        h = h + a @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + (F.silu(gate) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    h = norm(h, w["model.norm.weight"])
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return h @ head.T
