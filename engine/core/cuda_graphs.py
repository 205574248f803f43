"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode step of a small model on a GPU is bound by kernel launches (a few hundred per
token), not by the GPU's arithmetic: replaying a captured graph launches them all at once.
Graphs need fixed shapes and addresses, so each bucket (1, 2, 4, 8, ... up to max_batch)
owns a slice of static input buffers; a step with B sequences runs the smallest bucket >= B
with the extra rows padded (slot -1, which the KV write kernel skips; context length 1, whose
output is discarded). The paged decode kernel sizes its context splits from
``max_context_len``, a host integer: the graphs are captured with the whole window, so a
replay never needs more splits than it was captured with.

Only pure decode steps replay graphs (no prefill chunks, one token per sequence); anything
else runs eagerly. NOTE: written for CUDA and unproven here (no GPU on the development
machines); the CPU path never constructs it.
"""

from __future__ import annotations

import torch

from ..model.attention import AttentionMetadata
from ..model.llama import LlamaModel


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two up to ``max_batch``, and ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    return next((s for s in sizes if s >= batch), None)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
    ) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        dev = model.device
        self.model, self.kv_caches = model, kv_caches
        self.sizes = buckets(max_batch)
        self.max_context = max_blocks_per_seq * block_size
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # decode steps run by replay (the rest ran eagerly)
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first: the others fit in its memory pool
            self._forward(size)  # warm up: Triton compiles, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode=size,
            block_tables=self.tables[:size],
            context_lens=self.lens[:size],
            max_context_len=self.max_context,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)  # (size, d)
        return self.model.logits(hidden)  # (size, vocab)

    def can_run(self, batch: int, max_blocks: int) -> bool:
        return bucket_for(batch, self.sizes) is not None and max_blocks <= self.tables.shape[1]

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # (B,) on the device
        positions: torch.Tensor,  # (B,)
        slots: torch.Tensor,  # (B,)
        tables: torch.Tensor,  # (B, W) int32, W <= max_blocks_per_seq
        lens: torch.Tensor,  # (B,) int32
    ) -> torch.Tensor:
        """(B, vocab) float32 logits of one decode step, by graph replay."""
        b, width = tables.shape
        size = bucket_for(b, self.sizes)
        if size is None:
            raise ValueError(f"no graph for a batch of {b}")
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.slots[b:size].fill_(-1)  # padding rows write nothing
        self.tables[:b, :width].copy_(tables)
        self.lens[:b].copy_(lens)
        self.lens[b:size].fill_(1)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:b]
