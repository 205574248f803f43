"""`Sequence`: one request's token stream as the paged engine's scheduler sees it.

A sequence is integers only: the prompt and the tokens generated so far, the KV blocks that
hold their keys and values, and how far the model has computed. The block manager fills
``block_table``; the scheduler moves ``status`` and ``num_computed_tokens``; the model runner
reads them and may hang its own per-request state on ``extra``.

Positions: token ``i`` of ``token_ids`` sits at position ``i``. Its K/V live in block
``block_table[i // block_size]`` at row ``i % block_size``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..types import FinishReason


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` slots hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


class SequenceStatus(enum.Enum):
    # WAITING   not in the cache: never admitted, or preempted (blocks freed, to be recomputed)
    # RUNNING   holds blocks; scheduled every step while the token budget allows
    # FINISHED  done (stopped, length, context or cancelled); holds no blocks
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens (prompt + generated) and their place in the KV cache.

    Sequences compare by identity: two requests with the same tokens are still two sequences.
    """

    seq_id: int
    token_ids: list[int]
    max_tokens: int | None = None  # generated tokens allowed; None = until stop or the limit
    extra: object | None = None  # the runner's per-request state (sampling params, stream...)
    num_prompt_tokens: int = field(init=False)
    block_table: list[int] = field(default_factory=list, init=False)
    # NOTE: tokens [0, num_computed_tokens) have their K/V in the blocks of block_table;
    # the scheduler schedules [num_computed_tokens, num_tokens) and advances it after a step.
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prompt tokens found cached at the last allocation
    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    arrival: int = field(default=-1, init=False)  # set by Scheduler.add: smaller = older
    num_preemptions: int = field(default=0, init=False)
    # NOTE: speculative decoding appends proposed tokens before a step; the last
    # ``num_draft_tokens`` of ``token_ids`` are such guesses, verified (kept or dropped) by
    # that step's update. The scheduler may trim them but never splits them over two steps.
    num_draft_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seq_id, int):
            raise TypeError(f"seq_id must be an int, got {type(self.seq_id).__name__}")
        self.token_ids = list(self.token_ids)  # own the list: the caller's stays untouched
        if not self.token_ids:
            raise ValueError(f"sequence {self.seq_id} has no prompt tokens")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 or None, got {self.max_tokens}")
        self.num_prompt_tokens = len(self.token_ids)

    # ---- counts --------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet: what the next steps must compute."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks that hold every token of the sequence."""
        return blocks_for(len(self.token_ids), block_size)

    # ---- changes -------------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        """Add one generated token. Its K/V are computed by a later step."""
        self.token_ids.append(token_id)

    def add_draft(self, token_ids: list[int]) -> None:
        """Append proposed tokens, to be verified by the next step."""
        self.token_ids.extend(token_ids)
        self.num_draft_tokens += len(token_ids)

    def drop_draft(self, count: int | None = None) -> None:
        """Remove the last ``count`` proposed tokens (all of them by default), before any of
        them is computed. A sequence holding blocks goes through `BlockManager.truncate`."""
        count = self.num_draft_tokens if count is None else count
        if not 0 <= count <= self.num_draft_tokens:
            raise ValueError(f"sequence {self.seq_id}: cannot drop {count} of {self.num_draft_tokens} draft tokens")
        self.truncate(len(self.token_ids) - count)
        self.num_draft_tokens -= count

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens from position ``num_tokens`` on (generated tokens only).

        The block manager's ``truncate`` calls this and releases the blocks past the new end.
        """
        if not self.num_prompt_tokens <= num_tokens <= len(self.token_ids):
            raise ValueError(
                f"sequence {self.seq_id}: cannot truncate to {num_tokens} tokens; it has "
                f"{len(self.token_ids)} of which {self.num_prompt_tokens} are prompt"
            )
        del self.token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)

    def fork(self, seq_id: int) -> Sequence:
        """A new waiting sequence with the same tokens, limits and ``extra``, and no blocks.

        ``BlockManager.fork`` then shares this sequence's blocks with it. The caller may
        replace the child's tokens that are not computed yet (e.g. its own sampled token).
        """
        child = Sequence(seq_id, self.token_ids, max_tokens=self.max_tokens, extra=self.extra)
        child.num_prompt_tokens = self.num_prompt_tokens
        return child
