"""Linear layers with dense, INT4 or INT8 weight-only storage.

INT4 (group-wise, asymmetric): the weight W (out N, in K) is stored as 4-bit codes
q in [0, 15] with one (scale, zero) pair per group of `group_size` inputs:

    W[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g]

which is the form torch's `_weight_int4pack_mm*` ops compute with. GGUF's 4-bit formats map
onto it exactly with g = 32:  Q4_0  w = (q - 8) d           -> scale d, zero 0
                              Q4_1  w = q d + m             -> scale d, zero m + 8 d
                              Q4_K  w = d sc q - dmin mn    -> scale d sc, zero 8 d sc - dmin mn
INT8 (per output channel, symmetric): W[n, k] = q[n, k] * scale[n], q in [-128, 127].

On CPU the INT4 and INT8 ops are fast only with bf16 activations (they fall back to slow
paths for fp32), so those layers compute in bf16 there and return the caller's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlocal.native.quant_matmul import int8_matmul


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (N, K)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int4Linear(nn.Module):
    def __init__(
        self,
        codes: torch.Tensor,  # (N, K) int32 in [0, 15]
        scale: torch.Tensor,  # (N, K // g)
        zero: torch.Tensor,  # (N, K // g)
        group_size: int,
        bias: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        n, k = codes.shape
        if k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"INT4 weight of shape {(n, k)} does not match scales {tuple(scale.shape)} for group {group_size}")
        device = torch.device(device)
        self.group_size = group_size
        self.in_features, self.out_features = k, n
        self.compute_dtype = torch.bfloat16
        # (K // g, N, 2): the op's layout of per-group scale and zero
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(self.compute_dtype)
        codes = codes.to(torch.int32)
        if device.type == "cuda":
            # CUDA op packs two codes per byte first: (N, K / 2) uint8, even k in the high nibble.
            packed_u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).to(device)
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", sz.to(device), persistent=False)
        self.bias = nn.Parameter(bias.to(device), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])  # (M, K)
        x2 = x2.to(self.compute_dtype)
        if self.packed.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype)
        if x.dim() != 2:
            y = y.reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def weight_bytes(self) -> int:
        return self.in_features * self.out_features // 2 + self.scales_and_zeros.numel() * 2


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (N,)
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scale", scale.to(weight.dtype), persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        if self.qweight.is_cuda:
            # our Triton kernel: torch's CUDA op read a 1.5B model's head at 0.23 TB/s at one
            # row and 0.03 at 16 (H200), this at 3.9 and 3.7 (native.quant_matmul)
            y = int8_matmul(x2, self.qweight, self.scale.to(x.dtype))
        else:
            # on CPU the op is several times faster with bf16 activations than with fp32
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self.scale.to(torch.bfloat16))
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()


Linear = DenseLinear | Int4Linear | Int8Linear


def int4_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) float32 weight from INT4 codes: the reference for `Int4Linear`."""
    s = scale.float().repeat_interleave(group_size, dim=1)  # (N, K)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (codes.float() - 8.0) * s + z
