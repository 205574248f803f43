"""Backend `remote`: any OpenAI-compatible server (llama.cpp's server, vLLM, llama-cpp-python's
server, `llmlocal serve`), for models that outgrow this machine.

The server owns the model, its chat template and its tokenizer, so this backend differs from
the local ones in what it answers to the `Engine` (`base.Backend`; ``renders_prompts = True``):

* Prompts: chat messages go to ``/v1/chat/completions`` as messages and the server applies
  its template; raw prompts go to ``/v1/completions``. `render` asks the server for the text
  where it can (``/apply-template``: llama.cpp, `llmlocal serve`), else renders ChatML (or
  the template the server reported) here, as an approximation.
* Token counts: `prompt` asks the server's tokenizer (llama.cpp ``/tokenize`` after
  ``/apply-template``, vLLM-style ``/tokenize`` with messages: exact). llama-cpp-python's
  server tokenizes text but not chats, and plain OpenAI servers do neither: counts are then
  estimates (``exact=False``; a ChatML rendering tokenized by the server, or 4 characters a
  token). Grammars, logprobs and tools are refused by name (`check`, `render`): they
  need a local engine. The context window comes from ``/props`` (llama.cpp), ``max_model_len`` (vLLM,
  `llmlocal serve`) or ``--ctx``; otherwise it is unknown (``n_ctx = None``).
* Cancel: the stream's socket is shut down, which the server sees as the client leaving.

Stats are measured here, on the client: TTFT from sending the request to the first text,
decode speed and inter-token latency from the arrival of streamed chunks (one token per
chunk on the servers above). Token totals come from the server's ``usage`` when it sends one
(``stream_options.include_usage``), else from its tokenizer, else from the chunk count.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmlocal.models import ResolvedModel
from llmlocal.models.errors import LLMLocalError
from llmlocal.models.spec import ModelSpec, SpecialTokens

from ..core.stats import StatsRecorder
from ..plan import Plan
from ..prompt.chat_template import CHATML_TEMPLATE, ChatTemplate
from ..types import (
    DoneEvent,
    Event,
    FinishReason,
    Message,
    Request,
    SamplingParams,
    Stats,
    TokenEvent,
)
from .base import Prompt
from .remote_http import Endpoint, RemoteContextError, RemoteError, SSEStream

API_KEY_ENV = ("LLMLOCAL_API_KEY", "OPENAI_API_KEY")
CONNECT_PROBE_S = 30.0  # probing an endpoint the server may not have
# Stats fields a llmlocal server reports about itself (the rest is measured here).
_SERVER_STATS = ("cached_prompt_tokens", "kv_blocks_used", "kv_blocks_total", "drafted_tokens", "accepted_tokens", "achieved_sparsity")


@dataclass
class _Server:
    """What probing found: the flavour of API beyond the OpenAI core, and the model's facts."""

    flavor: str  # "llama.cpp", "vllm" (also `llmlocal serve`), "llama-cpp-python", "openai"
    model_id: str
    n_ctx: int | None
    chat_template: str | None = None
    bos: str | None = None
    eos: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


class RemoteBackend:
    name = "remote"
    renders_prompts = True  # the server's template, not the Engine's

    def __init__(self, endpoint: Endpoint, server: _Server) -> None:
        self.endpoint = endpoint
        self.server = server
        self.device = endpoint.netloc
        self.n_ctx: int | None = server.n_ctx
        self.exact_token_counts = server.flavor in ("llama.cpp", "vllm")
        self.model = ResolvedModel(name=server.model_id, path=endpoint.url, spec=_remote_spec(endpoint, server))
        self._template = ChatTemplate(server.chat_template or CHATML_TEMPLATE, bos_token=server.bos or "", eos_token=server.eos or "")
        self._specials: int | None = None  # tokens the tokenizer endpoint adds to any text

    # ---- connecting ----------------------------------------------------------------------
    @classmethod
    def connect(cls, plan: Plan) -> RemoteBackend:
        """Reach the server, pick the model (``plan.model``, default the first it lists) and
        learn what it offers. Loads nothing locally."""
        if plan.endpoint is None:
            raise LLMLocalError("The remote backend talks to a server: pass its URL with --endpoint.")
        if plan.backend not in ("auto", "remote"):
            raise LLMLocalError(f"--endpoint runs the model on the server, so --backend {plan.backend} does not apply: drop it.")
        key = plan.api_key or next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)
        endpoint = Endpoint.parse(plan.endpoint, key)
        return cls(endpoint, _probe(endpoint, plan))

    def close(self) -> None:
        pass  # every request has its own connection, closed when it ends

    # ---- prompts and tokens --------------------------------------------------------------
    def check(self, request: Request) -> None:
        if request.sampling.grammar is not None:
            raise LLMLocalError("A grammar is enforced by a local engine and --endpoint runs the model elsewhere: "
                                "drop --endpoint, or ask the server for JSON through its own API.")
        if request.sampling.logprobs is not None:
            raise LLMLocalError("Logprobs come from a local engine and --endpoint runs the model elsewhere: drop --endpoint.")

    def render(self, template: ChatTemplate, messages: Sequence[Message],
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text the server builds from ``messages`` (approximate on servers that do
        not say: ChatML, or the template the server reported); ``template`` (the engine's) is
        not the server's, and goes unused."""
        if tools:
            raise LLMLocalError("Tools are rendered by a local engine and --endpoint runs the model elsewhere: drop --endpoint.")
        return self._render(messages)

    def _render(self, messages: Sequence[Message]) -> str:
        flavor, msgs = self.server.flavor, _messages(messages)
        if flavor == "llama.cpp":
            return str(self.endpoint.call("POST", "/apply-template", {"messages": msgs})["prompt"])
        if flavor == "vllm":  # `llmlocal serve` has llama.cpp's /apply-template too
            status, out = self.endpoint.try_call("POST", "/apply-template", {"messages": msgs})
            if status == 200 and isinstance(out, dict) and isinstance(out.get("prompt"), str):
                return out["prompt"]
        return self._template.render(list(messages))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        flavor, call = self.server.flavor, self.endpoint.call
        if flavor == "llama.cpp":
            out = call("POST", "/tokenize", {"content": text, "add_special": add_special, "parse_special": True})
        elif flavor == "vllm":
            out = call("POST", "/tokenize", {"model": self.server.model_id, "prompt": text, "add_special_tokens": add_special})
        elif flavor == "llama-cpp-python":
            out = call("POST", "/extras/tokenize", {"input": text, "model": self.server.model_id})
        else:
            raise LLMLocalError(f"The server at {self.endpoint.url} has no tokenizer endpoint: token ids are not available from it.")
        return [t["id"] if isinstance(t, dict) else int(t) for t in out["tokens"]]

    def detokenize(self, token_ids: list[int]) -> str:
        flavor, call, ids = self.server.flavor, self.endpoint.call, list(token_ids)
        if flavor == "llama.cpp":
            return str(call("POST", "/detokenize", {"tokens": ids})["content"])
        if flavor == "vllm":
            return str(call("POST", "/detokenize", {"model": self.server.model_id, "tokens": ids})["prompt"])
        if flavor == "llama-cpp-python":
            return str(call("POST", "/extras/detokenize", {"tokens": ids, "model": self.server.model_id})["text"])
        raise LLMLocalError(f"The server at {self.endpoint.url} has no tokenizer endpoint: token ids are not available from it.")

    def _tokenize_chat(self, msgs: list[dict[str, str]]) -> list[int]:
        out = self.endpoint.call(
            "POST", "/tokenize", {"model": self.server.model_id, "messages": msgs, "add_generation_prompt": True}
        )
        return [int(t) for t in out["tokens"]]

    def prompt_ids(self, request: Request) -> list[int]:
        """The prompt's token ids as the server sees them, where the server can say."""
        if request.prompt is not None:
            return self.tokenize(request.prompt)
        if self.server.flavor == "vllm":
            return self._tokenize_chat(_messages(request.messages))
        if self.server.flavor == "llama.cpp":
            return self.tokenize(self._render(request.messages))
        raise LLMLocalError(
            f"The server at {self.endpoint.url} applies its chat template without showing it: exact prompt tokens are not available."
        )

    def prompt(self, request: Request, template: ChatTemplate | None = None, bos: str | None = None) -> Prompt:
        """The request's prompt as the server will see it: its token ids and exact length where
        the server can tokenize it, else an estimate of the length (no ids)."""
        flavor = self.server.flavor
        if (request.prompt is not None and flavor != "openai") or (request.prompt is None and flavor in ("vllm", "llama.cpp")):
            ids = self.prompt_ids(request)
            return Prompt(ids, len(ids))
        text = request.prompt if request.prompt is not None else self._template.render(list(request.messages))
        if flavor == "llama-cpp-python":
            return Prompt([], len(self.tokenize(text)), exact=False)
        return Prompt([], math.ceil(len(text) / 4), exact=False)  # about 4 characters a token in English

    # ---- generation ----------------------------------------------------------------------
    def prefill(self, request: Request, prompt: Prompt, cancel: threading.Event) -> int:
        """A server keeps its prompts' caches itself: nothing to compute ahead here."""
        return 0

    def generate(self, request: Request, prompt: Prompt, cancel: threading.Event) -> Iterator[Event]:
        """Stream the server's reply (the server tokenizes: ``prompt``'s count stands in when
        it reports no usage)."""
        p = request.sampling
        for index in range(p.n):  # n samples one after another, seeds seed, seed + 1, ...
            yield from self._one(request, index, cancel, prompt)
            if cancel.is_set():
                for rest in range(index + 1, p.n):
                    yield DoneEvent("", "cancelled", Stats(self.name, self.device, n_ctx=self.n_ctx), rest)
                return

    def _one(self, request: Request, index: int, cancel: threading.Event, prompt_tokens: Prompt | None) -> Iterator[Event]:
        chat = request.prompt is None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = self._body(request, index, prompt_tokens)
        recorder = StatsRecorder(self.name, self.device)
        if cancel.is_set():
            yield DoneEvent("", "cancelled", recorder.finish(prompt_tokens.tokens if prompt_tokens else 0, n_ctx=self.n_ctx), index)
            return
        try:
            stream = self.endpoint.stream(path, body)
        except RemoteContextError as e:
            self._learn_n_ctx(str(e))
            raise
        watcher = threading.Thread(target=_abort_on_cancel, args=(stream, cancel), daemon=True)
        watcher.start()
        parts: list[str] = []
        finish: str | None = None
        usage: dict[str, Any] = {}
        server_stats: dict[str, Any] = {}
        try:
            for chunk in stream:
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                if isinstance(chunk.get("llmlocal"), dict):
                    server_stats = chunk["llmlocal"]
                if isinstance(chunk.get("timings"), dict) and "cache_n" in chunk["timings"]:  # llama.cpp's server
                    server_stats.setdefault("cached_prompt_tokens", chunk["timings"]["cache_n"])
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        parts.append(piece)
                        recorder.token()
                        yield TokenEvent(piece, (), index)
                    finish = choice.get("finish_reason") or finish
                if cancel.is_set():
                    break
        except RemoteContextError as e:
            self._learn_n_ctx(str(e))
            raise
        finally:
            stream.abort()
            stream.close()
            watcher.join()
        text = "".join(parts)
        if cancel.is_set():
            reason: FinishReason = "cancelled"
        elif not stream.finished and finish is None:
            self._diagnose_early_end(path, body, produced=bool(parts))
        elif server_stats.get("finish_reason") in ("stop", "length", "context"):
            reason = server_stats["finish_reason"]  # a llmlocal server says which it was
        else:
            reason = self._finish_reason(finish, request.sampling, usage, len(recorder.token_times))
        yield DoneEvent(text, reason, self._stats(recorder, usage, server_stats, prompt_tokens, text), index)

    def _body(self, request: Request, index: int, prompt_tokens: Prompt | None) -> dict[str, Any]:
        p = request.sampling
        body: dict[str, Any] = {
            "model": self.server.model_id,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": p.temperature,
            "top_p": p.top_p,
        }
        if request.prompt is None:
            body["messages"] = _messages(request.messages)
        else:
            body["prompt"] = request.prompt
        if p.max_tokens is not None:
            body["max_tokens"] = p.max_tokens
        elif request.prompt is not None:
            # /v1/completions defaults to 16 tokens; "until the model stops" is the room left.
            room = self.n_ctx - prompt_tokens.tokens if self.n_ctx and prompt_tokens and prompt_tokens.exact else None
            body["max_tokens"] = room if room and room > 0 else None
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed + index
        if self.server.flavor != "openai":  # samplers beyond OpenAI's, under each server's names
            body.update(top_k=p.top_k, min_p=p.min_p)
            body["repetition_penalty" if self.server.flavor == "vllm" else "repeat_penalty"] = p.repeat_penalty
        return body

    def _finish_reason(self, finish: str | None, p: SamplingParams, usage: Mapping[str, Any], chunks: int) -> FinishReason:
        if finish == "length":
            produced = int(usage.get("completion_tokens") or chunks)
            # The server says "length" both for max_tokens and for a full context window.
            return "length" if p.max_tokens is not None and produced >= p.max_tokens else "context"
        return "stop"

    def _stats(
        self, recorder: StatsRecorder, usage: Mapping[str, Any], server: Mapping[str, Any], prompt: Prompt | None, text: str
    ) -> Stats:
        chunks = len(recorder.token_times)
        if usage.get("prompt_tokens") is not None:
            prompt = Prompt([], int(usage["prompt_tokens"]))
        stats = recorder.finish(prompt.tokens if prompt else 0, n_ctx=self.n_ctx)
        if prompt is None or not prompt.exact:
            stats.prefill_tok_s = None  # from an estimated prompt length it would mislead
        completion = usage.get("completion_tokens")
        if completion is None and text and self.server.flavor != "openai":
            completion = self._count_text(text)  # the server's tokenizer, after the fact
        if completion is not None and int(completion) != chunks:
            stats.completion_tokens = int(completion)
            times = recorder.token_times
            if len(times) >= 2 and times[-1] > times[0] and stats.completion_tokens > 1:
                stats.decode_tok_s = (stats.completion_tokens - 1) / (times[-1] - times[0])
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            stats.cached_prompt_tokens = int(details["cached_tokens"])
        for key in _SERVER_STATS:
            if server.get(key) is not None:
                setattr(stats, key, server[key])
        return stats

    def _diagnose_early_end(self, path: str, body: dict[str, Any], produced: bool) -> None:
        """The stream stopped without a finish: llama-cpp-python's server does that when the
        prompt overflows its window (the error goes to its log). Asking again without streaming
        and for one token gets the reason in the answer, and with it the window's size."""
        if not produced:
            probe = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            status, data = self.endpoint.try_call("POST", path, {**probe, "stream": False, "max_tokens": 1})
            if status != 200:
                error = self.endpoint.refused(status, data, path)
                if isinstance(error, RemoteContextError):
                    self._learn_n_ctx(str(error))
                raise error
        raise RemoteError(f"The server at {self.endpoint.url} ended the reply early: check the server's log.")

    def _count_text(self, text: str) -> int:
        """Tokens of a reply, without the BOS some tokenizer endpoints always add."""
        if self._specials is None:
            self._specials = len(self.tokenize("", add_special=False))
        return max(len(self.tokenize(text, add_special=False)) - self._specials, 0)

    def _learn_n_ctx(self, message: str) -> None:
        """The window a context error named (`Endpoint.refused` words it), if the server did not
        report one."""
        m = re.search(r"(\d+)-token context window", message)
        if m and self.n_ctx is None:
            self.n_ctx = int(m.group(1))

    # ---- scoring -------------------------------------------------------------------------
    def log_probs(self, token_ids: list[int]) -> Any:
        raise LLMLocalError("Scoring needs the model's logits, which an OpenAI-compatible server does not return: use a local model.")

    def score(self, token_ids: list[int]) -> list[float]:
        raise LLMLocalError("Scoring needs the model's logits, which an OpenAI-compatible server does not return: use a local model.")


def _abort_on_cancel(stream: SSEStream, cancel: threading.Event) -> None:
    # Poll rather than block: the stream may end on its own, and this thread must end with it.
    while not stream.aborted:
        if cancel.wait(0.05):
            stream.abort()
            return


def _messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def _probe(endpoint: Endpoint, plan: Plan) -> _Server:
    """Ask the server what it serves and which extensions of the OpenAI API it has."""
    listing = endpoint.call("GET", "/v1/models")
    entries = [m for m in (listing or {}).get("data", []) if isinstance(m, dict) and "id" in m]
    if not entries:
        raise RemoteError(f"The server at {endpoint.url} lists no models at /v1/models: load one in the server first.")
    ids = [str(m["id"]) for m in entries]
    if plan.model is not None and plan.model not in ids:
        raise RemoteError(f"The server at {endpoint.url} does not serve '{plan.model}': pick one of {', '.join(ids)} with --model.")
    model_id = plan.model or ids[0]
    entry = entries[ids.index(model_id)]
    n_ctx = entry.get("max_model_len") if isinstance(entry.get("max_model_len"), int) else None
    server = _Server("openai", model_id, n_ctx, info=entry)

    status, props = endpoint.try_call("GET", "/props", timeout=CONNECT_PROBE_S, probe=True)
    if status == 200 and isinstance(props, dict) and "default_generation_settings" in props:
        server.flavor = "llama.cpp"
        settings = props["default_generation_settings"]
        server.n_ctx = props.get("n_ctx") or (settings.get("n_ctx") if isinstance(settings, dict) else None) or server.n_ctx
        server.chat_template = props.get("chat_template") or None
        server.bos, server.eos = props.get("bos_token") or None, props.get("eos_token") or None
    else:
        status, out = endpoint.try_call("POST", "/tokenize", {"model": model_id, "prompt": "a"}, timeout=CONNECT_PROBE_S, probe=True)
        if status == 200 and isinstance(out, dict) and "tokens" in out:
            server.flavor = "vllm"
            server.n_ctx = server.n_ctx or out.get("max_model_len")
        else:
            status, out = endpoint.try_call("POST", "/extras/tokenize", {"input": "a", "model": model_id}, timeout=CONNECT_PROBE_S, probe=True)
            if status == 200 and isinstance(out, dict) and "tokens" in out:
                server.flavor = "llama-cpp-python"
    if plan.n_ctx is not None:  # --ctx: the user knows the server's window (or wants less)
        server.n_ctx = min(server.n_ctx, plan.n_ctx) if server.n_ctx else plan.n_ctx
    return server


def _remote_spec(endpoint: Endpoint, server: _Server) -> ModelSpec:
    """A `ModelSpec` with what the server says; shapes it does not tell are 0."""
    return ModelSpec(
        path=endpoint.url,
        format="remote",
        name=server.model_id,
        architecture=str(server.info.get("architecture") or "unknown"),
        n_layers=0,
        d_model=0,
        n_heads=0,
        n_kv_heads=0,
        head_dim=0,
        d_ffn=0,
        vocab_size=0,
        context_length=server.n_ctx or 0,
        rope_freq_base=None,
        norm_eps=None,
        file_type=None,
        tensors=(),
        chat_template=server.chat_template,
        special=SpecialTokens(bos=server.bos, eos=server.eos),
        tokenizer_model=None,
        metadata={"endpoint": endpoint.url, "flavor": server.flavor},
    )
