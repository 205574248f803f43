"""`ModelRunner`: one engine step's integers -> tensors -> the model -> logits.

It owns the KV cache: per layer a K and a V tensor of shape
(num_blocks, block_size, n_kv_heads, head_dim), preallocated once; a q8_0 cache (int8) has
head_dim + head_dim / 16 bytes a row, each (token, kv head) row's int8 values and then the
fp16 scales of its groups of 32 (`llmlocal.native.paged_attention.kv_quant`), so that a block is still one run of bytes of
each tensor: the block copies, the disk tier's payloads and the scratch caches hold the
scales with the values. The scheduler decides
which tokens to compute; the runner lays them out as one flat batch (decodes first, then
prefill chunks), builds slot mappings and block tables from each sequence's block table,
runs the model and returns the logits of the rows that sample a next token.
"""

from __future__ import annotations

import math
import mmap
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from llmlocal.models.errors import LLMLocalError
from llmlocal.native.cpu import runtime
from llmlocal.native.cpu.linear import QuantLinear, prompt_rows
from llmlocal.native.paged_attention.kv_quant import row_width

from ..model.attention import AttentionMetadata, PrefillChunk
from ..model.llama import PROJECTIONS, LlamaModel
from .sequence import Sequence

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On the CPU it is mapped from anonymous memory, which the kernel hands
    out zeroed page by page as it is first written: reserving the pool costs nothing up front,
    and memory is taken only for the blocks that get used (the default pool of the 1.5B is
    0.9 GB; zeroing it took 0.3-1.1 s of every load here, and a short chat touches a few MB)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


@dataclass(frozen=True)
class StepItem:
    """Compute K/V for seq.token_ids[start : start + num_tokens]; `sample` asks for logits
    at the last ``num_logits`` of them (the chunk reaches the end of the sequence; more than
    one row when the target verifies draft tokens)."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    num_logits: int = 1


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        if kv_dtype == torch.int8 and cfg.head_dim % 32:
            raise LLMLocalError(f"A q8_0 KV cache keeps a scale per 32 values, and this model's heads have "
                                f"{cfg.head_dim}: use --kv-dtype f16.")
        shape = (num_blocks, block_size, cfg.n_kv_heads, row_width(cfg.head_dim, kv_dtype))
        self.kv_caches = [(_zeros(shape, kv_dtype, self.device), _zeros(shape, kv_dtype, self.device)) for _ in range(cfg.n_layers)]
        self.graphs: DecodeGraphs | None = None
        # chunks of up to this many tokens after a context run as decode rows (1: only single
        # tokens); set by a native decode path whose rows compute what decoding alone would
        self.native_rows = 1
        # Which rows are prompt rows (`prompt_rows`): 0, a sequence's prompt tokens, in a chunk
        # of any size, so that a prompt's numbers do not depend on what the cache held (a warm
        # prompt's last few tokens are computed as a cold one computed them) and generated tokens
        # recomputed after a preemption as they were decoded; N > 0, any chunk of N or more
        # tokens (a draft model's mirror, whose outputs only propose: speed decides).
        self.prompt_chunk_min = 0
        # a prompt's rows on the bfloat16 tiles, projections and attention, where the CPU has
        # them (`runtime.qmat_tiles`, read at each step) and the projections are the GGUF types'
        # kernels (`QuantLinear`; float32 and INT4 weights keep their own paths)
        kernels = _layer_kernels(model)
        self.prompt_tiles = self.device.type == "cpu" and bool(kernels) and all(isinstance(k, QuantLinear) for k in kernels)

    def enable_cuda_graphs(self, max_batch: int, max_context: int) -> None:
        """Capture decode steps as CUDA graphs (see `cuda_graphs`); a no-op off CUDA."""
        if self.device.type == "cuda":
            from .cuda_graphs import DecodeGraphs

            max_blocks = -(-max_context // self.block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks, self.block_size)

    @property
    def prompt_rows_vary(self) -> bool:
        """Whether a prompt's last rows would compute other numbers on a prefix-cache hit than
        cold: on the CPU where a hit's few rows run as decode rows (`native_rows`) and prompt rows
        do not take the tiles (the scheduler's ``tail_alone`` then computes them alone cold too)."""
        return self.native_rows > 1 and not (self.prompt_tiles and runtime.qmat_tiles())

    @property
    def kv_bytes(self) -> int:
        k, _ = self.kv_caches[0]
        return 2 * len(self.kv_caches) * k.numel() * k.element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K and V rows over all layers: what the disk tier keeps of it."""
        k, _ = self.kv_caches[0]
        return 2 * len(self.kv_caches) * k[0].numel() * k.element_size()

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """(n, block_nbytes) uint8 on the CPU, a copy: each block's K then V rows, layer by layer."""
        idx = torch.tensor(block_ids, device=self.device)
        rows = torch.stack([t.index_select(0, idx) for kv in self.kv_caches for t in kv], dim=1)  # (n, 2L, bs, h, d)
        return rows.view(torch.uint8).reshape(len(block_ids), -1).cpu()

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], payloads: list[bytearray], per_copy: int = 32) -> None:
        """Fill blocks with rows laid out as `read_blocks` gives them (one payload a block), in
        copies of ``per_copy`` blocks: the transient beside the payloads stays a few MB."""
        k0, _ = self.kv_caches[0]
        for at in range(0, len(block_ids), per_copy):
            ids, part = block_ids[at : at + per_copy], payloads[at : at + per_copy]
            flat = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in part]).to(self.device)
            rows = flat.view(k0.dtype).view(len(ids), 2 * len(self.kv_caches), *k0.shape[1:])  # (n, 2L, bs, h, d)
            idx = torch.tensor(ids, device=self.device)
            for layer, (k, v) in enumerate(self.kv_caches):
                k.index_copy_(0, idx, rows[:, 2 * layer])
                v.index_copy_(0, idx, rows[:, 2 * layer + 1])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block src into block dst in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(end - start,) int64 slots of positions start..end-1 through a block table."""
        pos = torch.arange(start, end, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def scratch_cache(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A private KV cache for one sequence of `num_tokens` (block table 0, 1, 2, ...),
        for work that must not touch the shared pool, such as scoring a text."""
        k, _ = self.kv_caches[0]
        shape = (-(-num_tokens // self.block_size),) + tuple(k.shape[1:])
        return [(torch.empty(shape, dtype=k.dtype, device=self.device), torch.empty(shape, dtype=k.dtype, device=self.device))
                for _ in self.kv_caches]

    def _prompt_chunks(self, prefills: list[StepItem]) -> tuple[list[StepItem], list[StepItem]]:
        """The prefill items split into (the others, prompt rows' chunks) by `prompt_chunk_min`;
        an item that runs past its sequence's prompt (a recompute after preemption) is split
        there, the logits staying with its second part."""
        if self.prompt_chunk_min:
            big = [it for it in prefills if it.num_tokens >= self.prompt_chunk_min]
            return [it for it in prefills if it.num_tokens < self.prompt_chunk_min], big
        rest: list[StepItem] = []
        prompts: list[StepItem] = []
        for it in prefills:
            inside = it.seq.num_prompt_tokens - it.start  # of its tokens, those in the prompt
            if inside >= it.num_tokens:
                prompts.append(it)
            elif inside <= 0:
                rest.append(it)
            else:
                prompts.append(StepItem(it.seq, it.start, inside, False))
                rest.append(StepItem(it.seq, it.start + inside, it.num_tokens - inside, it.sample, it.num_logits))
        return rest, prompts

    @torch.inference_mode()
    def execute(
        self,
        items: list[StepItem],
        all_rows: bool = False,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[StepItem]]:
        """Run one step. Returns (R, vocab) float32 logits and the sampling items they belong
        to, in order, each with its ``num_logits`` rows (R is the sum of those).

        With ``all_rows`` the logits of every computed token are returned (N rows, in the
        order of ``items``; used for scoring a text), and the item list is empty.
        """
        if all_rows and any(it.num_tokens == 1 and it.start > 0 for it in items):
            raise ValueError("all_rows is for prefill chunks only")
        # A few tokens after a context (speculative verification) run as decode rows where the
        # model decodes natively (`native_rows`): each token one row over its own context, so
        # its numbers are those of decoding it alone.
        # On the bfloat16 tiles a prompt's own rows never do (a prompt resumed from the cache
        # with a few new tokens, or its last token alone): they take the tiles however few they
        # are, so that the prompt's numbers are those of a cold run. Elsewhere a prompt's rows
        # depend on the rows beside them, and a short tail stays native. A draft model's mirror
        # keeps its short catch-ups native (`prompt_chunk_min`: its tokens only propose).
        short = 1 if all_rows or kv_caches is not None else max(1, self.native_rows)
        tiles = self.prompt_tiles and not self.prompt_chunk_min and runtime.qmat_tiles()

        def native(it: StepItem) -> bool:
            return it.start > 0 and it.num_tokens <= short and not (tiles and it.start < it.seq.num_prompt_tokens)

        decodes = [it for it in items if native(it)]
        prefills = [it for it in items if not native(it)]
        # the prompt rows last, one run of rows for the tiles (scoring keeps its rows in order:
        # all of them are a prompt's)
        rest, prompts = ([], prefills) if all_rows else self._prompt_chunks(prefills)
        prefills = rest + prompts
        ordered = decodes + prefills
        dev = self.device

        input_ids: list[int] = []
        positions: list[int] = []
        for it in ordered:
            input_ids.extend(it.seq.token_ids[it.start : it.start + it.num_tokens])
            positions.extend(range(it.start, it.start + it.num_tokens))
        slot_parts: list[torch.Tensor] = []
        decode_rows = [(it, it.start + r) for it in decodes for r in range(it.num_tokens)]  # (item, position)
        # (a CPU without the tiles: a prompt's attention in the native kernel, bfloat16 on AVX512-BF16 or
        # float32 on AVX2, its rows' projections on the int8 kernels; on two Zen 5 cores 4.5-5x faster
        # than torch's float32 attention in bfloat16, 1.3-1.5x in float32 held to AVX2)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=len(decode_rows),
                                 prompt_tiles=tiles or (self.prompt_tiles and runtime.attn_without_tiles()))

        if decodes:
            width = max(len(it.seq.block_table) for it in decodes)
            tables = torch.zeros((len(decode_rows), width), dtype=torch.int32)  # (B, max_blocks), 0-padded
            for row, (it, _) in enumerate(decode_rows):
                tables[row, : len(it.seq.block_table)] = torch.tensor(it.seq.block_table, dtype=torch.int32)
            tables = tables.to(dev)
            pos = torch.tensor([p for _, p in decode_rows], device=dev)
            rows = torch.arange(len(decode_rows), device=dev)
            blocks = tables[rows, pos // self.block_size].long()
            slot_parts.append(blocks * self.block_size + pos % self.block_size)
            meta.block_tables = tables
            meta.context_lens = (pos + 1).to(torch.int32)
            meta.max_context_len = max(p for _, p in decode_rows) + 1
            if (
                self.graphs is not None and not prefills and kv_caches is None and len(decode_rows) == len(decodes)
                and self.graphs.can_run(len(decodes), width)
            ):
                ids = torch.tensor(input_ids, device=dev)
                logits = self.graphs.run(ids, pos, slot_parts[0], tables, meta.context_lens)
                return logits, list(decodes)
            if dev.type == "cpu":
                # every position of every context, once for all layers: (B, L) slots
                length = meta.max_context_len
                offsets = torch.arange(self.block_size, device=dev)
                slots = (tables.long()[:, :, None] * self.block_size + offsets).view(len(decode_rows), -1)[:, :length]
                meta.decode_slots = slots.contiguous()
                if any(p + 1 != length for _, p in decode_rows):
                    valid = torch.arange(length, device=dev)[None, :] < meta.context_lens[:, None]  # (B, L)
                    # padding points at slot 0, which holds finite values (the pool is zeroed)
                    meta.decode_slots = torch.where(valid, slots, 0).contiguous()
                    meta.decode_mask = valid[:, None, None, :]

        offset = len(decode_rows)
        first_prompt_row = offset + sum(it.num_tokens for it in rest)
        for it in prefills:
            table = torch.tensor(it.seq.block_table, dtype=torch.long, device=dev)
            all_slots = self._slots(table, 0, it.start + it.num_tokens)
            slot_parts.append(all_slots[it.start :])
            meta.prefills.append(PrefillChunk(offset, it.num_tokens, it.start, all_slots))
            offset += it.num_tokens
        meta.slot_mapping = torch.cat(slot_parts) if slot_parts else meta.slot_mapping

        # the prompt rows (the CPU's GGUF kernels may take them through bfloat16 tiles)
        ids, pos_all = torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev)
        with prompt_rows(first_prompt_row) if prompts else nullcontext():
            hidden = self.model(ids, pos_all, kv_caches or self.kv_caches, meta)  # (N, d)
        if all_rows:
            return self.model.logits(hidden), []
        # the last row of each sampling item
        sampled: list[StepItem] = []
        rows_out: list[int] = []
        end = 0
        for it in ordered:
            end += it.num_tokens
            if it.sample:
                sampled.append(it)
                rows_out.extend(range(end - it.num_logits, end))
        if not rows_out:
            return torch.empty((0, self.model.cfg.vocab_size)), []
        logits = self.model.logits(hidden[torch.tensor(rows_out, device=dev)])  # (S, vocab)
        return logits, sampled


def _layer_kernels(model: LlamaModel) -> list[object]:
    """The kernel behind each projection of the decoder layers: a native projection holds its
    own as ``kernel``; a torch one has none (None)."""
    return [getattr(getattr(layer, name), "kernel", None) for layer in model.layers for name in PROJECTIONS]
