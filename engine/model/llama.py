"""A Llama-family decoder (llama, mistral, qwen2) over a paged KV cache.

    h = embed(tokens)
    per layer:  h = h + o_proj(attention(rope(q), rope(k), v))   on rms_norm(h)
                h = h + down(silu(gate(x)) * up(x)),               x = rms_norm(h)
    logits = lm_head(rms_norm(h))

q/k/v and gate/up are fused into one matmul each (fewer, larger GEMVs per token). RoPE rotates
interleaved pairs (2j, 2j + 1), llama.cpp's layout for llama GGUFs; the loader permutes
Hugging Face (and qwen2) q/k rows into it (see `Rotary`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .gguf_tensors import QuantEmbedding
from .linear import Int8Linear, Linear


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused call; in fp32 whatever the activations' dtype
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotation factors e^(i pos f_j) for every position up to `max_position`.

    The model keeps q and k heads in the interleaved layout: dims (2j, 2j + 1) form pair j,
    rotated by angle pos * f_j. That is how llama.cpp stores llama and mistral GGUFs; the
    loader permutes other sources into it (attention scores are unchanged by a permutation
    applied to both q and k). A head is then D/2 complex numbers and RoPE one complex product.
    """

    def __init__(self, inv_freq: torch.Tensor, max_position: int) -> None:
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float32)
        angles = torch.outer(t, inv_freq.float())  # (P, D/2)
        self.register_buffer("cis", torch.polar(torch.ones_like(angles), angles), persistent=False)  # complex64

    def tables(self, positions: torch.Tensor) -> torch.Tensor:
        """(N, 1, D/2) complex factors of the step's positions, shared by every layer."""
        return self.cis[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D), interleaved pairs, rotated by position."""
    n, heads, d = x.shape
    xf = x if x.dtype == torch.float32 else x.float()
    xc = torch.view_as_complex(xf.reshape(n, heads, d // 2, 2))  # (N, heads, D/2)
    out = torch.view_as_real(xc * cis).reshape(n, heads, d)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


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
        rope: torch.Tensor,  # (N, 1, D/2) complex rotation factors
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv(self.attn_norm(h))  # (N, (H + 2 Hkv) D)
        hd = self.head_dim
        qk, v = qkv.split([(self.n_heads + self.n_kv) * hd, self.n_kv * hd], dim=-1)
        # q and k heads rotate together: one set of elementwise ops instead of two
        qk = apply_rotary(qk.reshape(n, self.n_heads + self.n_kv, hd), rope)  # (N, H + Hkv, D)
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
        embed: torch.Tensor | QuantEmbedding,  # (vocab, d), or rows read from the file
        layers: list[DecoderLayer],
        norm: RMSNorm,
        lm_head: Linear | None,  # None: tied to the embedding
        inv_freq: torch.Tensor,
        max_position: int,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        quant = isinstance(embed, QuantEmbedding)
        if quant and lm_head is None:
            raise ValueError("an embedding read from the file needs its own output head")
        self._dtype, self._device = (torch.float32, torch.device("cpu")) if quant else (embed.dtype, embed.device)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = Rotary(inv_freq.to(self._device), max_position).to(self._device)
        self.embed: torch.Tensor | None = None if quant else nn.Parameter(embed, requires_grad=False)
        self.embed_quant: QuantEmbedding | None = embed if quant else None
        self.embed_int8: Int8Linear | None = None

    def quantize_tied_head(self) -> None:
        """Store a tied embedding as per-row INT8, for the token lookup and (without a head of
        its own) the output head: the head reads a quarter of the fp32 bytes per token (on the
        starter model the fp32 head alone is 113 MB a token), and a looked-up row is dequantized
        on the fly."""
        if self.embed is None:
            return
        self.embed_int8 = Int8Linear(self.embed.data.float())
        self.embed = None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (N,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """(N, d) final hidden states (normalized)."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, rope, kv, meta)
        return self.norm(h)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(N,) token ids -> (N, d) rows of the embedding, in a new tensor."""
        if self.embed_quant is not None:
            return self.embed_quant(input_ids)
        if self.embed_int8 is not None:
            q = self.embed_int8  # (vocab, d) int8 rows, (vocab,) scales
            return F.embedding(input_ids, q.qweight).to(self._dtype) * q.scale[input_ids, None].to(self._dtype)
        return F.embedding(input_ids, self.embed)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(M, d) hidden -> (M, vocab) float32 logits."""
        if self.lm_head is not None:
            return self.lm_head(h).float()
        if self.embed_int8 is not None:
            return self.embed_int8(h).float()
        return F.linear(h, self.embed).float()

    def weight_bytes(self) -> int:
        """Bytes of weights read per token (what decode speed is bound by)."""
        total = 0
        if self.lm_head is None and self.embed is not None:
            total = self.embed.numel() * self.embed.element_size()
        for m in self.modules():
            if hasattr(m, "weight_bytes") and m is not self:
                total += m.weight_bytes()
        return total
