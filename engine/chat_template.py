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

from .tool_calls import plain_messages, template_messages
from .types import Message

# Used when a model carries no template: ChatML, the most common instruct format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Chat templates by name, for `--chat-template NAME` (a model without one falls back to ChatML).
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}


class TemplateError(LLMLocalError):
    """The model's chat template could not render the conversation."""


def template_source(choice: str | None, model_template: str | None) -> tuple[str, str]:
    """(Jinja source, where it came from) for ``--chat-template`` ``choice`` (a name of
    `BUILTIN_TEMPLATES` or a file), else the model's own, else ChatML."""
    if choice is None:
        if model_template:
            return model_template, "the model's"
        return CHATML_TEMPLATE, "chatml (the model carries no chat template; choose one with --chat-template)"
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
