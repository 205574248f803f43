"""The values that cross the engine boundary: requests in, events out."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping, Sequence, Union

from llmlocal.models.errors import LLMLocalError

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "context", "cancelled"]
# stop      the model ended its reply (end-of-generation token) or a stop string matched
# length    max_tokens were generated
# context   the context window is full; the reply was cut there
# cancelled Engine.cancel() or the consumer closed the stream


@dataclass(frozen=True)
class ToolCall:
    """A function the model calls: its name and its arguments as JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(frozen=True)
class Message:
    """One turn of a chat. An assistant turn may call tools (``tool_calls``); a ``tool`` turn
    is the result of the call ``tool_call_id``."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ("system", "user", "assistant", "tool"):
            raise LLMLocalError(f"Unknown chat role '{self.role}': use system, user, assistant or tool.")
        if self.tool_calls and self.role != "assistant":
            raise LLMLocalError(f"A {self.role} message cannot carry tool calls: only the assistant's can.")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    @classmethod
    def coerce(cls, value: Message | Mapping[str, Any]) -> Message:
        if isinstance(value, Message):
            return value
        calls = tuple(c if isinstance(c, ToolCall) else ToolCall(**c) for c in value.get("tool_calls") or ())
        return cls(role=value["role"], content=value.get("content") or "", tool_calls=calls,  # type: ignore[arg-type]
                   tool_call_id=value.get("tool_call_id"))


MAX_TOP_LOGPROBS = 20  # alternatives a token may report (OpenAI's limit)
GrammarKind = Literal["json", "json_schema", "regex", "choice", "lark"]


@dataclass(frozen=True)
class Grammar:
    """What a reply must match, enforced token by token (`llmlocal.engine.prompt.grammar`).

    ``json``: any JSON object; ``json_schema``: a JSON document valid against the schema in
    ``spec`` (JSON text); ``regex``: a string the whole of which matches ``spec``; ``choice``:
    one of the strings in ``spec`` (a JSON array); ``lark``: a Lark grammar (llguidance's
    dialect). Build one with the class methods; `SamplingParams.grammar` carries it."""

    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_schema", "regex", "choice", "lark"):
            raise LLMLocalError(f"Unknown grammar kind '{self.kind}': use json, json_schema, regex, choice or lark.")

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise LLMLocalError(f"The JSON schema is not valid JSON ({e.msg} at line {e.lineno}): fix the schema.") from None
        if not isinstance(schema, Mapping):
            raise LLMLocalError("A JSON schema must be a JSON object, such as {\"type\": \"object\"}.")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise LLMLocalError("A choice needs at least one non-empty string to choose from.")
        return cls("choice", json.dumps(options))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy decoding.

    Defaults follow llama.cpp's. ``max_tokens=None`` generates until the model stops or the
    context is full.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1  # parallel samples of one prompt (the paged engine shares the prompt's KV blocks)
    ignore_eos: bool = False  # go on past the model's end-of-generation token (benchmarks)
    grammar: Grammar | None = None  # constrained decoding: every token keeps the reply matching it
    logprobs: int | None = None  # report each token's log-probability and this many likeliest alternatives

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 64:
            raise LLMLocalError(f"n (parallel samples) must be between 1 and 64, got {self.n}.")
        if self.temperature < 0:
            raise LLMLocalError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.top_k < 0:
            raise LLMLocalError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise LLMLocalError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p < 1:
            raise LLMLocalError(f"min_p must be in [0, 1), got {self.min_p}.")
        if self.repeat_penalty <= 0:
            raise LLMLocalError(f"repeat_penalty must be > 0 (1 disables it), got {self.repeat_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise LLMLocalError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if any(not s for s in self.stop):
            raise LLMLocalError("Stop strings must not be empty.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise LLMLocalError(f"logprobs asks for 0 to {MAX_TOP_LOGPROBS} alternatives a token, got {self.logprobs}.")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One completion: chat ``messages`` rendered with the model's template, or a raw ``prompt``."""

    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        msgs = tuple(Message.coerce(m) for m in self.messages)
        object.__setattr__(self, "messages", msgs)
        if (self.prompt is None) == (not msgs):
            raise LLMLocalError("A request needs either chat messages or a raw prompt, not both.")

    @classmethod
    def chat(
        cls, messages: Sequence[Message | Mapping[str, str]], sampling: SamplingParams | None = None, **kw: Any
    ) -> Request:
        return cls(messages=tuple(Message.coerce(m) for m in messages), sampling=sampling or SamplingParams(), **kw)


@dataclass
class Stats:
    """Figures of one request, shared by every backend. ``None`` means 'not reported'."""

    backend: str
    device: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = None
    n_ctx: int | None = None
    ttft_s: float | None = None  # request start -> first token
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None  # tokens after the first / time after the first
    itl_ms_p50: float | None = None  # inter-token latency
    itl_ms_p95: float | None = None
    total_s: float | None = None
    drafted_tokens: int | None = None  # speculative decoding: draft tokens verified,
    accepted_tokens: int | None = None  # how many of them the target kept,
    target_steps: int | None = None  # and the target's forward passes that produced tokens
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    achieved_sparsity: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """Share of draft tokens the target kept."""
        if not self.drafted_tokens:
            return None
        return (self.accepted_tokens or 0) / self.drafted_tokens

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens produced per target forward pass (1.0 without speculation)."""
        if not self.target_steps:
            return None
        return self.completion_tokens / self.target_steps

    def to_dict(self) -> dict[str, Any]:
        """Reported fields only (and, when speculating, the acceptance rate and tokens per step)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.acceptance_rate is not None:
            out["acceptance_rate"] = self.acceptance_rate
        if self.tokens_per_step is not None:
            out["tokens_per_step"] = self.tokens_per_step
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the softmax of its logits, before
    temperature, filters and grammar), and the likeliest tokens at its place, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """Text of one or more new tokens (text may be empty while a UTF-8 character or a
    possible stop string is incomplete)."""

    text: str
    token_ids: tuple[int, ...]
    index: int = 0  # which of the request's n samples
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them


@dataclass(frozen=True)
class DoneEvent:
    """The end of one sample; a stream ends with one per sample (n of them, n = 1 by default)."""

    text: str  # the whole reply, stop string excluded
    finish_reason: FinishReason
    stats: Stats
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # every token's, when the request asked for them


Event = Union[TokenEvent, DoneEvent]
