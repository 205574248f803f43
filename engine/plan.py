"""`Plan`: the one configuration object that flows from the CLI to a backend.

Until the memory planner chooses them, the fields are filled from CLI flags and defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from llmlocal.models.errors import LLMLocalError

BACKENDS = ("auto", "llamacpp")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MAX_CTX = 8192  # default context cap when the user does not ask for one


@dataclass(frozen=True)
class Plan:
    model: str | None = None  # name or path; None is the starter model
    backend: str = "auto"
    device: str = "auto"
    n_ctx: int | None = None  # None: the model's trained context, capped at DEFAULT_MAX_CTX
    threads: int | None = None  # None: physical cores
    n_batch: int = 512  # prompt tokens per forward pass during prefill
    gpu_layers: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise LLMLocalError(f"Unknown backend '{self.backend}': choose one of {', '.join(BACKENDS)}.")
        if self.device not in DEVICES:
            raise LLMLocalError(f"Unknown device '{self.device}': choose one of {', '.join(DEVICES)}.")
        if self.n_ctx is not None and self.n_ctx < 16:
            raise LLMLocalError(f"The context length must be at least 16 tokens, got {self.n_ctx}.")
        if self.threads is not None and self.threads < 1:
            raise LLMLocalError(f"threads must be at least 1, got {self.threads}.")
        if self.n_batch < 1:
            raise LLMLocalError(f"n_batch must be at least 1, got {self.n_batch}.")
        if self.gpu_layers < 0:
            raise LLMLocalError(f"gpu_layers must be >= 0, got {self.gpu_layers}.")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Plan:
        """Build a Plan from a mapping, rejecting keys it does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LLMLocalError(f"Unknown plan option(s) {', '.join(unknown)}: valid ones are {', '.join(sorted(known))}.")
        return cls(**values)

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)
