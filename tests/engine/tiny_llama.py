"""A small random-weight Llama checkpoint written by the tests, and an unpaged reference
forward pass written independently of the engine's model code (plain causal attention over
the whole sequence, Hugging Face conventions)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_llama_weights(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A llama-architecture GGUF's weights as `reference_logits` takes them: float64, Hugging
    Face names, every tensor dequantized by gguf-py (the exact values the file stores), the rows
    of q and k back in Hugging Face's order (llama.cpp's converter interleaves each head's two
    halves for its RoPE); and the config."""
    from gguf import GGUFReader, quants

    reader = GGUFReader(path)
    meta = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("llama.")}
    nh, nkv = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    w: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        a = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
        if t.name in ("token_embd.weight", "output_norm.weight", "output.weight"):
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[t.name[:-7]]
        else:
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{_GGUF_NAMES[kind]}"
            if kind in ("attn_q", "attn_k"):  # rows (heads, hd / 2, 2) in the file -> (heads, 2, hd / 2)
                heads = nh if kind == "attn_q" else nkv
                a = a.reshape(heads, a.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(a.shape)
        w[name + ".weight"] = torch.from_numpy(np.ascontiguousarray(a))
    d = int(meta["llama.embedding_length"])
    cfg = {
        "hidden_size": d, "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]), "num_attention_heads": nh, "num_key_value_heads": nkv,
        "vocab_size": w["model.embed_tokens.weight"].shape[0], "rope_theta": float(meta["llama.rope.freq_base"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "tie_word_embeddings": "lm_head.weight" not in w,
    }
    return w, cfg


def reference_logits(w: dict[str, torch.Tensor], tokens: list[int], cfg: dict | None = None,
                     thresholds: dict[str, list[float]] | None = None) -> torch.Tensor:
    """(T, vocab) logits of every position, float64, no cache. `thresholds` (per projection of
    SPARSITY_PROJECTIONS, per layer) zero each projection's inputs of magnitude <= t first, as
    the sparse backend does: attn_qkv (the normed h into q, k, v), attn_output (the attention's
    output), ffn_gate_up (the normed h into gate and up), ffn_down (silu(gate) * up)."""
    cfg = {**CONFIG, **(cfg or {})}

    def sparse(x: torch.Tensor, proj: str, layer: int) -> torch.Tensor:
        if thresholds is None:
            return x
        t = float(thresholds[proj][layer])
        return torch.where(x.abs() > t, x, torch.zeros((), dtype=x.dtype))
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
        x = sparse(norm(h, w[p + "input_layernorm.weight"]), "attn_qkv", i)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(nh // nkv, 0)
        v = v.repeat_interleave(nh // nkv, 0)
        scores = q @ k.transpose(1, 2) / hd**0.5  # (nh, T, T)
        scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, d)
        h = h + sparse(a, "attn_output", i) @ w[p + "self_attn.o_proj.weight"].T
        x = sparse(norm(h, w[p + "post_attention_layernorm.weight"]), "ffn_gate_up", i)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + sparse(F.silu(gate) * (x @ w[p + "mlp.up_proj.weight"].T), "ffn_down", i) @ w[p + "mlp.down_proj.weight"].T
    h = norm(h, w["model.norm.weight"])
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return h @ head.T
