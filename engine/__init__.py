"""The engine: the `Engine` API, its backends, and what they share (plans, requests, stats).

Importing this package is cheap: backends import their heavy libraries when loaded.
"""

from .engine import ContextOverflowError, Engine
from .openmp import share_cpus
from .plan import Plan
from .types import DoneEvent, Event, Grammar, Message, Request, SamplingParams, Stats, TokenEvent, TokenLogprob

share_cpus()  # before any OpenMP library loads: the imports above load none (openmp.py)

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
