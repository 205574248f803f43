"""`ChatSettings`: a chat's system prompt and sampling parameters, and their stored form.

The store keeps sampling parameters as a JSON object of `SamplingParams` fields; keys this
version does not know (written by a newer llmlocal) are ignored rather than refused, so an
old chat always opens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmlocal.engine.types import SamplingParams

from ..history import Chat

# What the settings panel edits, in the order it shows them.
EDITABLE = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "seed")


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)

    @classmethod
    def from_chat(cls, chat: Chat, defaults: ChatSettings | None = None) -> ChatSettings:
        """The chat's stored settings; parameters it does not store come from ``defaults``."""
        base = sampling_to_dict(defaults.sampling) if defaults is not None else {}
        return cls(chat.system_prompt, sampling_from_dict(base | chat.sampling))

    def sampling_dict(self) -> dict[str, Any]:
        return sampling_to_dict(self.sampling)

    def system_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []


def sampling_to_dict(sampling: SamplingParams) -> dict[str, Any]:
    values = dataclasses.asdict(sampling)
    values["stop"] = list(sampling.stop)
    return values


def sampling_from_dict(values: dict[str, Any]) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    kept = {k: v for k, v in values.items() if k in known}
    if "stop" in kept:
        kept["stop"] = tuple(kept["stop"])
    return SamplingParams(**kept)
