"""The engine: the `Engine` API, its backends, and what they share (plans, requests, stats).

Importing this package is cheap: backends import their heavy libraries when loaded.
"""

from .openmp import share_cpus

share_cpus()  # first: before numpy, torch or llama.cpp load their thread pools (openmp.py)

from .engine import ContextOverflowError, Engine  # noqa: E402
from .plan import Plan  # noqa: E402
from .types import DoneEvent, Event, Grammar, Message, Request, SamplingParams, Stats, TokenEvent, TokenLogprob  # noqa: E402

__all__ = [
    "ContextOverflowError",
    "DoneEvent",
    "Engine",
    "Event",
    "Grammar",
    "Message",
    "Plan",
    "Request",
    "SamplingParams",
    "Stats",
    "TokenEvent",
    "TokenLogprob",
]
