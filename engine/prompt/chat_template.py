"""Chat messages -> prompt text, with the model's own Jinja chat template.

Templates come from the model file, so they are untrusted code: they run in Jinja's
immutable sandbox (no attribute access to Python internals, no mutation of the passed
objects). The environment mirrors what Hugging Face `apply_chat_template` offers templates
(`raise_exception`, `strftime_now`, `tojson`, trim_blocks/lstrip_blocks), which is what
template authors test against.

Tools follow Hugging Face's convention: a template that reads ``tools`` gets OpenAI's tool
list, assistant messages with ``tool_calls`` and ``tool`` messages as they are. A template
that does not (the starter's) gets the tools described in a system message and calls and
results written into the turns as text, in the Hermes format (`tool_calls.plain_messages`).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

from llmlocal.models.errors import LLMLocalError

from ..types import Message
from .tool_calls import plain_messages, template_messages

# Used when a model carries no template: ChatML, the most common instruct format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The turn formats of other families, for a file that carries no template (a base model, a
# conversion that lost it): plain conversations as the models' own templates render them
# (tests/engine/prompt/test_chat_template_fixtures.py checks each against them); tools go into the
# turns as text, as for any template that does not read them.
GEMMA_TEMPLATE = (  # Gemma 2 and 3: the system text opens the first user turn
    "{{- bos_token -}}{%- set ns = namespace(prefix='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.prefix = m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + ns.prefix"
    " + m['content'] | trim + '<end_of_turn>\n' -}}{%- set ns.prefix = '' -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
LLAMA3_TEMPLATE = (  # Llama 3.1 - 3.3: a system turn always, with the knowledge cutoff and today's date
    "{{- bos_token -}}{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] | trim -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: '"
    " + strftime_now('%d %b %Y') + '\n\n' + ns.system + '<|eot_id|>' -}}"
    "{%- for m in messages -%}{%- if not (loop.first and m['role'] == 'system') -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)
MISTRAL_TEMPLATE = (  # Mistral v0.3: [INST] turns, the system text in the last one
    "{{- bos_token -}}{%- set ns = namespace(system=none) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}"
    "{%- elif m['role'] == 'user' -%}"
    "{{- '[INST] ' + (ns.system + '\n\n' if loop.last and ns.system is not none else '') + m['content'] + '[/INST]' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] | trim + eos_token -}}"
    "{%- endif -%}{%- endfor -%}"
)
PHI3_TEMPLATE = (  # Phi-3 and 3.5
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and m['content'] -%}{{- '<|system|>\n' + m['content'] + '<|end|>\n' -}}"
    "{%- elif m['role'] in ('user', 'assistant') -%}{{- '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
)

# Chat templates by name, for `--chat-template NAME` (a model without one falls back to ChatML).
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "gemma": GEMMA_TEMPLATE, "llama3": LLAMA3_TEMPLATE,
                     "mistral": MISTRAL_TEMPLATE, "phi3": PHI3_TEMPLATE}


class TemplateError(LLMLocalError):
    """The model's chat template could not render the conversation."""


# A vocabulary's turn markers -> the named template whose format they belong to (first match).
_MARKERS = (("<start_of_turn>", "gemma"), ("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"),
            ("[INST]", "mistral"), ("<|assistant|>", "phi3"))


def fallback_template(tokens: Sequence[str]) -> str:
    """The named template for a model without one, by the turn markers in its vocabulary
    (as llama.cpp guesses one); ChatML when none is there."""
    vocab = set(tokens)
    return next((name for marker, name in _MARKERS if marker in vocab), "chatml")


def template_source(choice: str | None, model_template: str | None, fallback: str = "chatml") -> tuple[str, str]:
    """(Jinja source, where it came from) for ``--chat-template`` ``choice`` (a name of
    `BUILTIN_TEMPLATES` or a file), else the model's own, else the named ``fallback``."""
    if choice is None:
        if model_template:
            return model_template, "the model's"
        return BUILTIN_TEMPLATES[fallback], f"{fallback} (the model carries no chat template; choose one with --chat-template)"
    if choice in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[choice], choice
    try:
        with open(choice, encoding="utf-8") as f:
            return f.read(), choice
    except OSError as e:
        names = ", ".join(BUILTIN_TEMPLATES)
        raise TemplateError(
            f"--chat-template {choice} is neither a template name ({names}) nor a readable file ({e.strerror}): "
            "pass a name or the path of a Jinja template."
        ) from None


def _raise_exception(message: str) -> None:
    raise TemplateError(f"The model's chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson``: keys in their order, no HTML escaping (Jinja's own sorts and
    escapes ``<``, which would change the tool signatures templates write)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @cached_property
    def _compiled(self) -> tuple[Any, Any]:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                                            extensions=["jinja2.ext.loopcontrols"])  # {% break %}, {% continue %}
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            return env, env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"The model's chat template does not parse ({e.message}, line {e.lineno}): "
                "use a raw prompt or fix the model's tokenizer.chat_template."
            ) from None

    @property
    def _template(self) -> Any:
        return self._compiled[1]

    @cached_property
    def knows_tools(self) -> bool:
        """The template reads ``tools`` (Qwen2.5's, Llama 3.x's): it renders them itself."""
        from jinja2 import meta

        env = self._compiled[0]
        return "tools" in meta.find_undeclared_variables(env.parse(self.source))

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages``; ``tools`` is OpenAI's tool list (None or empty: none)."""
        import jinja2

        tools = list(tools or [])
        uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
        # As Hugging Face's renderer: ``tools`` and ``documents`` are always defined, None when
        # there are none (templates test ``tools is defined`` as well as ``tools is not none``).
        extra: dict[str, Any] = {"tools": None, "documents": None}
        if uses_tools and not self.knows_tools:
            extra["messages"] = plain_messages(messages, tools)
        else:
            extra["messages"] = template_messages(messages)
            if tools:
                extra["tools"] = tools
        try:
            return self._template.render(
                **extra,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"The model's chat template tried an unsafe operation ({e}): it was stopped.") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"The model's chat template failed ({e}): use a raw prompt instead.") from None
