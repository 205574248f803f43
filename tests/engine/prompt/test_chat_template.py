from __future__ import annotations

import pytest
from llmlocal.engine.prompt.chat_template import ChatTemplate, TemplateError
from llmlocal.engine.types import Message, ToolCall


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


# A small template that reads tools the Hugging Face way (written for this test).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function | tojson }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% elif m.role == 'tool' %}result of {{ m.tool_call_id }}: {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Now, in <zone>.",
                                           "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]


def test_a_template_that_knows_tools_gets_them_as_hugging_face_passes_them() -> None:
    t = ChatTemplate(TOOL_TEMPLATE)
    assert t.knows_tools and not ChatTemplate("{{ messages[0].content }}").knows_tools
    messages = [Message("user", "Time?"), Message("assistant", "", (ToolCall("call_9", "get_time", '{"zone": "UTC"}'),)),
                Message("tool", "12:00", tool_call_id="call_9")]
    # tojson as Hugging Face's: keys in their order, "<" not escaped; arguments as an object.
    assert t.render(messages, tools=TOOLS) == (
        'TOOLS {"name": "get_time", "description": "Now, in <zone>.", "parameters": {"type": "object", '
        '"properties": {"zone": {"type": "string"}}}};\n'
        'user:Time?\nassistant:call call_9 get_time {"zone": "UTC"}\ntool:result of call_9: 12:00\n'
    )
    assert t.render([Message("user", "Time?")]) == "user:Time?\n"  # no tools: none shown


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    t = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ '\\n' }}{% endfor %}")
    messages = [Message("system", "Be brief."), Message("user", "Time?"),
                Message("assistant", "Checking.", (ToolCall("c1", "get_time", '{"zone": "UTC"}'),)),
                Message("tool", "12:00", tool_call_id="c1"), Message("tool", "13:00", tool_call_id="c2")]
    text = t.render(messages, tools=TOOLS)
    assert text.startswith("[system] Be brief.\n\n# Tools\n") and '"name": "get_time"' in text
    assert '[assistant] Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n' in text
    assert text.endswith("[user] <tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>\n")


def test_only_the_assistant_calls_tools() -> None:
    from llmlocal.models.errors import LLMLocalError

    with pytest.raises(LLMLocalError, match="only the assistant's"):
        Message("user", "x", (ToolCall("c", "f"),))


def test_loop_controls_render_as_in_hugging_face() -> None:
    source = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
              "{{ m['content'] }};{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}")
    messages = [Message("system", "s"), Message("user", "a"), Message("assistant", "b"), Message("user", "c"), Message("user", "d")]
    assert ChatTemplate(source).render(messages, add_generation_prompt=False) == "a;b;"


def test_chat_template_choice_file_name_and_fallback(tmp_path) -> None:
    from llmlocal.engine.prompt.chat_template import CHATML_TEMPLATE, TemplateError, template_source

    assert template_source(None, "{{ x }}") == ("{{ x }}", "the model's")
    assert template_source(None, None)[0] == CHATML_TEMPLATE and "carries no chat template" in template_source(None, None)[1]
    assert template_source("chatml", "{{ x }}") == (CHATML_TEMPLATE, "chatml")
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}!")
    assert template_source(str(tmp_path / "t.jinja"), "{{ x }}")[0] == "{{ messages[0]['content'] }}!"
    with pytest.raises(TemplateError, match="neither a template name"):
        template_source(str(tmp_path / "missing.jinja"), None)
    assert template_source(None, None, "gemma")[1].startswith("gemma (the model carries no chat template")


def test_a_model_without_a_template_gets_the_format_of_its_turn_markers() -> None:
    from llmlocal.engine.prompt.chat_template import fallback_template

    assert fallback_template(["<bos>", "<start_of_turn>", "<end_of_turn>", "a"]) == "gemma"
    assert fallback_template(["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"]) == "llama3"
    assert fallback_template(["<s>", "[INST]", "[/INST]"]) == "mistral"
    assert fallback_template(["<s>", "<|user|>", "<|assistant|>", "<|end|>"]) == "phi3"
    assert fallback_template(["<|im_start|>", "<|im_end|>"]) == "chatml"
    assert fallback_template(["a", "b"]) == "chatml"
