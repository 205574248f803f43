"""The engine's decoder (llama, mistral, qwen2, qwen3, gemma3, phi3) over a paged KV cache.

    h = embed(tokens) * embed_scale
    per layer:  q, k, v = qkv(rms_norm(h));  q, k = qk_norm(q), qk_norm(k)        (QK-norm)
                a = o_proj(attention(rope(q), rope(k), v))   over the layer's window
                h = h + post_norm(a)                                              (sandwich)
                m = down(act(gate(x)) * up(x)),               x = rms_norm(h)
                h = h + post_norm(m)                                              (sandwich)
    logits = softcap(lm_head(rms_norm(h)))

The parts in parentheses are the families' options (`ModelConfig`); without them this is the
llama block.

q/k/v and gate/up are fused into one matmul each (fewer, larger GEMVs per token). RoPE rotates
interleaved pairs (2j, 2j + 1), llama.cpp's layout for llama GGUFs; the loader permutes
Hugging Face (and qwen2) q/k rows into it (see `Rotary`).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from llmlocal.native.cpu import runtime

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

    def __init__(self, inv_freq: torch.Tensor, max_position: int, magnitude: float = 1.0) -> None:
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        angles = torch.outer(t, inv_freq.float())  # (P, D/2)
        # |cis| = magnitude on the rotating pairs: longrope's attention factor on cos and sin (1
        # for every other scaling); pairs of frequency 0 (past a partial rotary) stay as they are
        radius = torch.where(inv_freq.float() > 0, magnitude, 1.0).expand_as(angles)
        self.register_buffer("cis", torch.polar(radius, angles), persistent=False)  # complex64

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


def head_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm over each head of x (N, heads, D)."""
    n, heads, d = x.shape
    return norm(x.reshape(n * heads, d)).reshape(n, heads, d)


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
_GLU_IDS = {"silu": 0, "gelu_tanh": 1}  # kernels().glu's, as the native decode step's


@cache
def _native_glu() -> bool:
    return runtime.built()


def gated(gate_up: torch.Tensor, d_ffn: int, activation: str) -> torch.Tensor:
    """act(gate) * up of gate_up (N, 2 d_ffn: gate, then up). On the CPU one native pass on the
    kernels' threads (`kernels().glu`, the function the native decode step and the fused GGUF
    projection run, so prompt and decode rows compute it alike); elsewhere torch."""
    n = gate_up.shape[0]
    if n and gate_up.device.type == "cpu" and gate_up.dtype is torch.float32 and gate_up.is_contiguous() and _native_glu():
        out = torch.empty(n, d_ffn)
        runtime.kernels().glu(gate_up.data_ptr(), out.data_ptr(), n, d_ffn, _GLU_IDS[activation])
        return out
    gate, up = gate_up.split(d_ffn, dim=-1)
    return _ACTIVATIONS[activation](gate) * up


# a decoder layer's projections, by attribute
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


class DecoderLayer(nn.Module):
    # act(gate) * up by the fused gate/up projection where its kernels make it (`_gated`); off,
    # the projection's (N, 2 F) and a pass over it (`bench.prefill_paths --compare activation`)
    fuse_gated = True

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        attn_norm: RMSNorm,
        qkv: Linear,
        o_proj: Linear,
        mlp_norm: RMSNorm,
        gate_up: Linear,
        down: Linear,
        q_norm: RMSNorm | None = None,  # QK-norm (cfg.qk_norm)
        k_norm: RMSNorm | None = None,
        post_attn_norm: RMSNorm | None = None,  # sandwich norms (cfg.sandwich_norms)
        post_mlp_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.d_ffn = cfg.d_ffn
        self.scale = cfg.scale
        self.window = cfg.window(index)
        self.local = cfg.local_rope(index)  # rotates with the windowed layers' RoPE table
        self.activation = cfg.activation
        self.attn_norm, self.qkv, self.o_proj = attn_norm, qkv, o_proj
        self.mlp_norm, self.gate_up, self.down = mlp_norm, gate_up, down
        self.q_norm, self.k_norm = q_norm, k_norm
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm

    def forward(
        self,
        h: torch.Tensor,  # (N, d)
        rope: torch.Tensor,  # (N, 1, D/2) complex rotation factors of this layer's table
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv(self.attn_norm(h))  # (N, (H + 2 Hkv) D)
        hd = self.head_dim
        qk, v = qkv.split([(self.n_heads + self.n_kv) * hd, self.n_kv * hd], dim=-1)
        qk = qk.reshape(n, self.n_heads + self.n_kv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.n_heads, self.n_kv], dim=1)
            qk = torch.cat([head_norm(q, self.q_norm), head_norm(k, self.k_norm)], dim=1)
        # q and k heads rotate together: one set of elementwise ops instead of two
        qk = apply_rotary(qk, rope)  # (N, H + Hkv, D)
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)  # (N, H, D), (N, Hkv, D)
        v = v.reshape(n, self.n_kv, hd)
        attn = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window)  # (N, H, D)
        a = self.o_proj(attn.reshape(n, self.n_heads * hd))
        h = h + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.down(self._gated(self.mlp_norm(h)))
        return h + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the MLP's input x (N, d): by the kernels of a fused GGUF projection
        where they make it (`QuantProjection.gated`), else from the projection's (N, 2 F)."""
        fused = getattr(self.gate_up, "gated", None) if self.fuse_gated else None
        y = fused(x, _GLU_IDS[self.activation]) if fused is not None else None
        return y if y is not None else gated(self.gate_up(x), self.d_ffn, self.activation)


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
        local_inv_freq: torch.Tensor | None = None,  # the windowed layers' own RoPE (Gemma 3)
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
        magnitude = cfg.rope_scaling.magnitude
        self.rotary = Rotary(inv_freq.to(self._device), max_position, magnitude).to(self._device)
        self.rotary_local = None
        if local_inv_freq is not None and any(layer.local for layer in layers):
            self.rotary_local = Rotary(local_inv_freq.to(self._device), max_position).to(self._device)
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
        rope_local = self.rotary_local.tables(positions) if self.rotary_local is not None else rope
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, rope_local if layer.local else rope, kv, meta)
        return self.norm(h)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(N,) token ids -> (N, d) rows of the embedding (times the family's embed_scale), in a
        new tensor."""
        if self.embed_quant is not None:
            h = self.embed_quant(input_ids)
        elif self.embed_int8 is not None:
            q = self.embed_int8  # (vocab, d) int8 rows, (vocab,) scales
            h = F.embedding(input_ids, q.qweight).to(self._dtype) * q.scale[input_ids, None].to(self._dtype)
        else:
            h = F.embedding(input_ids, self.embed)
        return h * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(M, d) hidden -> (M, vocab) float32 logits."""
        if self.lm_head is not None:
            z = self.lm_head(h).float()
        elif self.embed_int8 is not None:
            z = self.embed_int8(h).float()
        else:
            z = F.linear(h, self.embed).float()
        cap = self.cfg.final_softcap
        return torch.tanh(z / cap) * cap if cap else z

    def weight_bytes(self) -> int:
        """Bytes of weights read per token (what decode speed is bound by)."""
        total = 0
        if self.lm_head is None and self.embed is not None:
            total = self.embed.numel() * self.embed.element_size()
        for m in self.modules():
            if hasattr(m, "weight_bytes") and m is not self:
                total += m.weight_bytes()
        return total
