"""A Llama-family decoder (llama, mistral, qwen2) over a paged KV cache.

    h = embed(tokens)
    per layer:  h = h + o_proj(attention(rope(q), rope(k), v))   on rms_norm(h)
                h = h + down(silu(gate(x)) * up(x)),               x = rms_norm(h)
    logits = lm_head(rms_norm(h))

q/k/v and gate/up are fused into one matmul each (fewer, larger GEMVs per token). RoPE uses
the Hugging Face convention (`rotate_half`: pairs (i, i + D/2)); GGUF weights are un-permuted
at load time to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position up to `max_position`."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int) -> None:
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # (P, D/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 1, D/2) cos and sin of the step's positions, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D) rotated by position, pairing dims i and i + D/2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        attn_norm: RMSNorm,
        qkv: Linear,
        o_proj: Linear,
        mlp_norm: RMSNorm,
        gate_up: Linear,
        down: Linear,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.d_ffn = cfg.d_ffn
        self.scale = cfg.head_dim**-0.5
        self.attn_norm, self.qkv, self.o_proj = attn_norm, qkv, o_proj
        self.mlp_norm, self.gate_up, self.down = mlp_norm, gate_up, down

    def forward(
        self,
        h: torch.Tensor,  # (N, d)
        rope: tuple[torch.Tensor, torch.Tensor],  # (N, 1, D/2) cos, sin
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv(self.attn_norm(h))  # (N, (H + 2 Hkv) D)
        hd = self.head_dim
        qk, v = qkv.split([(self.n_heads + self.n_kv) * hd, self.n_kv * hd], dim=-1)
        # q and k heads rotate together: one set of elementwise ops instead of two
        qk = apply_rotary(qk.reshape(n, self.n_heads + self.n_kv, hd), *rope)  # (N, H + Hkv, D)
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)  # (N, H, D), (N, Hkv, D)
        v = v.reshape(n, self.n_kv, hd)
        attn = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # (N, H, D)
        h = h + self.o_proj(attn.reshape(n, self.n_heads * hd))
        gate, up = self.gate_up(self.mlp_norm(h)).split(self.d_ffn, dim=-1)
        return h + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,  # (vocab, d)
        layers: list[DecoderLayer],
        norm: RMSNorm,
        lm_head: Linear | None,  # None: tied to the embedding
        inv_freq: torch.Tensor,
        max_position: int,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = Rotary(inv_freq.to(embed.device), max_position).to(embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """(N, d) final hidden states (normalized)."""
        h = F.embedding(input_ids, self.embed)  # (N, d)
        rope = self.rotary.tables(positions)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, rope, kv, meta)
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(M, d) hidden -> (M, vocab) float32 logits."""
        if self.lm_head is None:
            return F.linear(h, self.embed).float()
        return self.lm_head(h).float()

    def weight_bytes(self) -> int:
        """Bytes of weights read per token (what decode speed is bound by)."""
        total = self.embed.numel() * self.embed.element_size() if self.lm_head is None else 0
        for m in self.modules():
            if hasattr(m, "weight_bytes") and m is not self:
                total += m.weight_bytes()
        return total
