"""The paged backend's state of one request's sample (`Stream`, hung on `Sequence.extra`: `stream_of`) and
what a failed step pushes to every open request (`EngineFailure`)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from ..core.model_runner import StepItem
from ..core.sampling import make_generator
from ..core.sequence import Sequence
from ..core.stats import StatsRecorder
from ..prompt.detokenize import TextStream
from ..prompt.grammar import Constraint
from ..spec.drafter import Proposal
from ..types import Request, TokenLogprob


@dataclass
class Stream:
    """Per-request state, hung on `Sequence.extra`."""

    request: Request
    cancel: threading.Event
    recorder: StatsRecorder
    text: TextStream
    generator: torch.Generator | None
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # shared by a request's samples
    index: int = 0  # which of the request's n samples
    siblings: list[Stream] = field(default_factory=list)  # samples 1..n-1, forked at the first token
    kv_blocks_used: int = 0  # pool blocks in use at this sequence's last step
    proposal: Proposal | None = None  # the drafts appended to the sequence for this step
    drafted: int = 0  # draft tokens verified, and how many of them the target kept
    accepted: int = 0
    target_steps: int = 0  # steps that produced tokens for this sample
    start_mark: tuple[int, int] | None = None  # a subclass's counters when the request started (`_extra_stats`)
    constraint: Constraint | None = None  # the request's grammar: where this sample stands in it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens' so far, when asked for


def new_stream(request: Request, cancel: threading.Event, events: queue.SimpleQueue, index: int, backend: str,
               device: torch.device) -> Stream:
    """The stream of sample ``index`` of ``request`` (a seeded request's samples: seed + index)."""
    p = request.sampling
    seed = p.seed + index if p.seed is not None else None
    return Stream(request=request, cancel=cancel, recorder=StatsRecorder(backend, str(device)), text=TextStream(p.stop),
                  generator=None if p.greedy else make_generator(seed, device), events=events, index=index)


class EngineFailure:
    """Pushed to every open stream when a step raises: the consumer re-raises it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def stream_of(seq: Sequence) -> Stream:
    """The `Stream` a paged backend's sequence carries (each it makes has one)."""
    stream = seq.extra
    assert isinstance(stream, Stream), "a sequence of the paged backend without its stream"
    return stream


def logprob_rows(logits: torch.Tensor, items: list[StepItem]) -> dict[int, torch.Tensor]:
    """A copy of a step's logits rows (each item's ``num_logits``, in order) of the sequences
    whose requests report logprobs, by sequence id."""
    out, row = {}, 0
    for it in items:
        stream = stream_of(it.seq)
        if stream.request.sampling.logprobs is not None:
            out[it.seq.seq_id] = logits[row : row + it.num_logits].clone()
        row += it.num_logits
    return out
