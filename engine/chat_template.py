"""Chat messages -> prompt text, with the model's own Jinja chat template.

Templates come from the model file, so they are untrusted code: they run in Jinja's
immutable sandbox (no attribute access to Python internals, no mutation of the passed
objects). The environment mirrors what Hugging Face `apply_chat_template` offers templates
(`raise_exception`, `strftime_now`, `tojson`, trim_blocks/lstrip_blocks), which is what
template authors test against.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

from llmlocal.models.errors import LLMLocalError

from .types import Message

# Used when a model carries no template: ChatML, the most common instruct format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(LLMLocalError):
    """The model's chat template could not render the conversation."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"The model's chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @cached_property
    def _template(self) -> Any:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"The model's chat template does not parse ({e.message}, line {e.lineno}): "
                "use a raw prompt or fix the model's tokenizer.chat_template."
            ) from None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"The model's chat template tried an unsafe operation ({e}): it was stopped.") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"The model's chat template failed ({e}): use a raw prompt instead.") from None
