"""`ModelShape`: the sizes of a decoder, defined once for every view of a model.

Three objects describe a model at different stages, and each is a `ModelShape` with facts of
its own beside the sizes:

* `llmlocal.models.ModelSpec`: what a file holds (header, tensors, tokenizer), read without
  loading weights: the planner and `models info` use it;
* `llmlocal.engine.model.config.ModelConfig`: what the paged engine's decoder runs (RoPE,
  norms, windows, the family's options);
* `llmlocal.quant.hf_config.LlamaFamilyConfig`: what a Hugging Face checkpoint converts into
  (its spelling of the architecture, biases, how q/k rows are ordered).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab_size: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> int:
        """K and V for one token across all layers: 2 x layers x KV heads x head dim x bytes."""
        return int(2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_value)
