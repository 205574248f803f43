"""`ChatSettings`: a chat's system prompt, sampling parameters and reply format, and their
stored form.

The store keeps sampling parameters as a JSON object of `SamplingParams` fields; keys this
version does not know (written by a newer llmlocal) are ignored rather than refused, so an
old chat always opens. The reply format rides in the same object under ``reply_format``
(absent: plain text), so exports carry it and an older llmlocal simply ignores it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from llmlocal.engine.types import Grammar, SamplingParams
from llmlocal.models.errors import LLMLocalError

from ..history import Chat

# What the settings panel edits, in the order it shows them.
EDITABLE = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "seed")
FORMAT_KEY = "reply_format"  # the reply format's key in the stored sampling object
NOT_SAMPLING = ("grammar",)  # SamplingParams fields a chat does not store (the reply format makes the grammar)

FormatKind = Literal["text", "json", "json_schema"]
FORMAT_NAMES: dict[str, str] = {"text": "text", "json": "JSON object", "json_schema": "JSON schema"}
FORMAT_LABELS: dict[str, str] = {"json": "JSON", "json_schema": "JSON schema"}


@dataclass(frozen=True)
class ReplyFormat:
    """What every reply of a chat must be: free ``text``, a ``json`` object, or JSON valid
    against a ``json_schema``. ``schema`` is the schema's JSON text, or the path of a file
    holding it (read again for every reply, so an edit to the file applies to the next one)."""

    kind: FormatKind = "text"
    schema: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FORMAT_NAMES:
            raise LLMLocalError(f"Unknown reply format '{self.kind}': use text, json or json_schema.")

    @property
    def is_file(self) -> bool:
        return self.kind == "json_schema" and not self.schema.lstrip().startswith("{")

    @property
    def label(self) -> str | None:
        """What the engine panel shows for a constrained chat; None for plain text."""
        return FORMAT_LABELS.get(self.kind)

    def grammar(self, fix: str = "change this chat's reply format with F3") -> Grammar | None:
        """The grammar every reply is generated under, checked to compile; `LLMLocalError` (one
        sentence) if the schema cannot be read or does not compile."""
        from llmlocal.engine.prompt.grammar import check_grammar

        from ..options import read_json_schema_file

        if self.kind == "text":
            return None
        if self.kind == "json":
            return Grammar.json_object()
        if not self.schema.strip():
            raise LLMLocalError("The JSON schema is missing: give the path of a schema file, or paste the schema's JSON.")
        if not self.is_file:
            grammar = Grammar.json_schema(self.schema)
            check_grammar(grammar)
            return grammar
        text = read_json_schema_file(self.schema, fix)
        try:
            grammar = Grammar.json_schema(text)
            check_grammar(grammar)
        except LLMLocalError as e:  # name the file: the user may not remember which one it is
            raise LLMLocalError(f"{self.schema}: {e}") from None
        return grammar

    def to_dict(self) -> dict[str, Any] | None:
        """The stored form; None for plain text (what an absent key means)."""
        if self.kind == "text":
            return None
        if self.kind == "json":
            return {"type": "json"}
        return {"type": "json_schema", "file" if self.is_file else "schema": self.schema}

    @classmethod
    def from_dict(cls, value: Any) -> ReplyFormat:
        if value is None:
            return cls()
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise LLMLocalError("The stored reply format is not an object with a type.")
        kind = value["type"]
        schema = value.get("file", value.get("schema", ""))
        if not isinstance(schema, str):
            raise LLMLocalError("The stored JSON schema is not text.")
        return cls(kind, schema if kind == "json_schema" else "")  # type: ignore[arg-type]

    @classmethod
    def typed(cls, kind: FormatKind, schema: str) -> ReplyFormat:
        """A format as entered (the settings panel, `chat --json-schema`): a relative schema
        path is made absolute, so the chat finds its file from any directory."""
        schema = schema.strip()
        fmt = cls(kind, schema if kind == "json_schema" else "")
        if fmt.is_file and fmt.schema:
            fmt = cls(kind, os.path.abspath(os.path.expanduser(fmt.schema)))
        return fmt


@dataclass(frozen=True)
class ChatSettings:
    system_prompt: str | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    reply_format: ReplyFormat = dataclasses.field(default_factory=ReplyFormat)

    @classmethod
    def from_chat(cls, chat: Chat, defaults: ChatSettings | None = None) -> ChatSettings:
        """The chat's stored settings; parameters it does not store come from ``defaults``.
        A chat that stores no reply format (any chat from before there was one) is plain text."""
        base = sampling_to_dict(defaults.sampling) if defaults is not None else {}
        try:
            reply_format = ReplyFormat.from_dict(chat.sampling.get(FORMAT_KEY))
        except LLMLocalError:  # a value this version cannot read: the chat still opens, as text
            reply_format = ReplyFormat()
        return cls(chat.system_prompt, sampling_from_dict(base | chat.sampling), reply_format)

    def sampling_dict(self) -> dict[str, Any]:
        """The stored form: the sampling parameters, and the reply format unless it is text."""
        values = sampling_to_dict(self.sampling)
        stored = self.reply_format.to_dict()
        return values | {FORMAT_KEY: stored} if stored is not None else values

    def system_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []


def sampling_to_dict(sampling: SamplingParams) -> dict[str, Any]:
    values = dataclasses.asdict(sampling)
    values["stop"] = list(sampling.stop)
    for name in NOT_SAMPLING:
        values.pop(name, None)
    return values


def sampling_from_dict(values: dict[str, Any]) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)} - set(NOT_SAMPLING)
    kept = {k: v for k, v in values.items() if k in known}
    if "stop" in kept:
        kept["stop"] = tuple(kept["stop"])
    return SamplingParams(**kept)
