from __future__ import annotations

import pytest

from llmlocal.engine.chat_template import ChatTemplate, TemplateError
from llmlocal.engine.types import Message


def test_starter_template_renders_chatml_with_generation_prompt(engine) -> None:
    text = engine.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_templates_cannot_reach_python_internals() -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match="unsafe|failed"):
        evil.render([Message("user", "x")])


def test_templates_cannot_mutate_the_conversation() -> None:
    t = ChatTemplate("{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages|length }}")
    with pytest.raises(TemplateError):
        t.render([Message("user", "x")])


def test_raise_exception_becomes_a_user_error() -> None:
    t = ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok")
    assert t.render([Message("user", "x")]) == "ok"
    with pytest.raises(TemplateError, match="System role not supported"):
        t.render([Message("system", "x")])


def test_bad_role_is_rejected() -> None:
    from llmlocal.models.errors import LLMLocalError

    with pytest.raises(LLMLocalError, match="Unknown chat role"):
        Message.coerce({"role": "wizard", "content": "x"})
