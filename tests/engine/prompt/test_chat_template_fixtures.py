"""Real chat templates render as Hugging Face's `apply_chat_template` renders them.

The fixtures in ``chat_templates/`` are the public templates of Qwen2.5, Llama 3.1/3.2,
Mistral v0.3, Gemma 3 and Phi-3.5 (sources in its README). Each conversation is rendered by
our `ChatTemplate` (from `Message` objects, as the engine does) and by `transformers` (from the
OpenAI-style dicts a caller would pass it, through a tokenizer built offline with the same
special tokens); the text must be identical, and a conversation one refuses the other refuses.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from llmlocal.engine.prompt import chat_template as chat_template_module
from llmlocal.engine.prompt.chat_template import ChatTemplate, TemplateError
from llmlocal.engine.types import Message, ToolCall

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")

FIXTURES = Path(__file__).parent / "chat_templates"

# name: (bos_token, eos_token, the template reads `tools`), as in each model's tokenizer_config.json.
MODELS = {
    "qwen2.5-instruct": (None, "<|im_end|>", True),
    "llama-3.1-instruct": ("<|begin_of_text|>", "<|eot_id|>", True),
    "llama-3.2-instruct": ("<|begin_of_text|>", "<|eot_id|>", True),
    "mistral-7b-instruct-v0.3": ("<s>", "</s>", True),
    "gemma-3-it": ("<bos>", "<eos>", False),
    "phi-3.5-mini-instruct": ("<s>", "<|endoftext|>", False),
}

# Text that catches HTML escaping (tojson, autoescape) and ASCII escaping.
TRICKY = "Größe of <b>\"Tom & Jerry's\"</b> — 日本語, emoji 🚀 & a tab\tand\nnew line"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather in a city, e.g. <São Paulo> & \"Zürich\"'s.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name (ünïcode ok)"},
                                      "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time now.",
        "parameters": {"type": "object", "properties": {}}}},
]

FROZEN_NOW = datetime.datetime(2026, 3, 7, 9, 30)


class _FrozenDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206
        return FROZEN_NOW


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both renderers see the same ``strftime_now`` (Llama 3.2's "Today Date" line)."""
    import types

    import transformers.utils.chat_template_utils as hf_utils

    monkeypatch.setattr(hf_utils, "datetime", _FrozenDatetime)
    monkeypatch.setattr(chat_template_module, "datetime", types.SimpleNamespace(datetime=_FrozenDatetime))


def _source(name: str) -> str:
    return (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")


def _hf_tokenizer(name: str):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    bos, eos, _ = MODELS[name]
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    vocab = {"<unk>": 0, **{tok: i + 1 for i, tok in enumerate(specials.values())}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=_source(name), **specials)


def _ours(name: str) -> ChatTemplate:
    bos, eos, _ = MODELS[name]
    return ChatTemplate(_source(name), bos_token=bos or "", eos_token=eos or "")


def _as_dicts(messages: list[Message]) -> list[dict]:
    """The OpenAI-style dicts a caller hands `apply_chat_template` (arguments as objects)."""
    import json

    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _hf_render(name: str, messages: list[Message], add_generation_prompt: bool, tools: list | None) -> str:
    return _hf_tokenizer(name).apply_chat_template(_as_dicts(messages), tools=tools or None, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)


SYSTEM_USER = [Message("system", "You are terse."), Message("user", "Hello there.")]
USER_ONLY = [Message("user", "What is 2+2?")]
MULTI_TURN = [Message("system", "  Be kind.  "), Message("user", "Hi!"), Message("assistant", " Hello! How can I help? "),
              Message("user", "Tell me a joke.")]
MULTI_TURN_NO_SYSTEM = [Message("user", "Hi!"), Message("assistant", "Hello!"), Message("user", "Bye."),
                        Message("assistant", "Goodbye.")]
TRICKY_TEXT = [Message("system", TRICKY), Message("user", TRICKY), Message("assistant", TRICKY), Message("user", "Again: " + TRICKY)]
EMPTY_SYSTEM = [Message("system", ""), Message("user", "Hi")]

PLAIN_CONVERSATIONS = {
    "system_user": SYSTEM_USER,
    "user_only": USER_ONLY,
    "multi_turn": MULTI_TURN,
    "multi_turn_no_system": MULTI_TURN_NO_SYSTEM,
    "tricky_text": TRICKY_TEXT,
    "empty_system": EMPTY_SYSTEM,
}

# Mistral wants 9-character alphanumeric tool call ids; every template here accepts them.
CALL = ToolCall("a1B2c3D4e", "get_weather", '{"city": "São Paulo <SP> & \\"co\\"", "unit": "c"}')
CALL_2 = ToolCall("f5G6h7I8j", "get_time", "{}")

TOOL_CONVERSATIONS = {
    "tools_first_turn": [Message("system", "Use tools when useful."), Message("user", "Weather in São Paulo?")],
    "tools_no_system": [Message("user", TRICKY)],
    "tool_call_and_result": [
        Message("system", "Use tools."), Message("user", "Weather in São Paulo?"),
        Message("assistant", "", (CALL,)),
        Message("tool", '{"temp": 31, "sky": "<clear> & \'dry\'"}', tool_call_id=CALL.id),
    ],
    "tool_cycle_then_answer": [
        Message("user", "Weather in São Paulo?"),
        Message("assistant", "", (CALL,)),
        Message("tool", "31 °C, clear", tool_call_id=CALL.id),
        Message("assistant", "It is 31 °C and clear."),
        Message("user", "Thanks! And the time?"),
    ],
}
# Two calls in one turn: Qwen and Mistral write both, Llama 3.x refuses.
TWO_CALLS = [
    Message("user", "Weather and time?"),
    Message("assistant", "Let me check.", (CALL, CALL_2)),
    Message("tool", "31 °C", tool_call_id=CALL.id),
    Message("tool", "09:30", tool_call_id=CALL_2.id),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("conversation", list(PLAIN_CONVERSATIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_plain_conversations_render_as_transformers(name: str, conversation: str, add_generation_prompt: bool) -> None:
    messages = PLAIN_CONVERSATIONS[conversation]
    expected = _hf_render(name, messages, add_generation_prompt, None)
    assert _ours(name).render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("conversation", list(TOOL_CONVERSATIONS))
@pytest.mark.parametrize("name", [n for n, (_, _, knows) in MODELS.items() if knows])
def test_tool_conversations_render_as_transformers(name: str, conversation: str, add_generation_prompt: bool) -> None:
    messages = TOOL_CONVERSATIONS[conversation]
    template = _ours(name)
    assert template.knows_tools
    expected = _hf_render(name, messages, add_generation_prompt, TOOLS)
    assert template.render(messages, add_generation_prompt=add_generation_prompt, tools=TOOLS) == expected
    # The tool schemas went in unescaped: no HTML entities, no \u escapes.
    assert "\\u00" not in expected and "&lt;" not in expected and "\\u003c" not in expected


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "mistral-7b-instruct-v0.3"])
def test_two_tool_calls_in_one_turn_render_as_transformers(name: str) -> None:
    assert _ours(name).render(TWO_CALLS, tools=TOOLS) == _hf_render(name, TWO_CALLS, True, TOOLS)


def test_templates_that_know_no_tools_are_recognised() -> None:
    for name, (_, _, knows) in MODELS.items():
        assert _ours(name).knows_tools is knows, name


def test_llama_dates_match_transformers() -> None:
    """Llama 3.2 stamps today's date with ``strftime_now``; 3.1 writes its fixed default."""
    ours_32 = _ours("llama-3.2-instruct").render(SYSTEM_USER)
    assert "Today Date: 07 Mar 2026\n" in ours_32
    assert ours_32 == _hf_render("llama-3.2-instruct", SYSTEM_USER, True, None)
    assert "Today Date: 26 Jul 2024\n" in _ours("llama-3.1-instruct").render(SYSTEM_USER)


def test_qwen_fixture_is_the_gguf_template_when_the_file_is_here() -> None:
    path = Path.home() / ".cache" / "llmlocal-dev" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if not path.exists():
        pytest.skip("the Qwen2.5-Coder GGUF is not in ~/.cache/llmlocal-dev")
    from llmlocal.models import spec_from_gguf

    assert spec_from_gguf(str(path)).chat_template == _source("qwen2.5-instruct")


# Conversations a template refuses (raise_exception), with the reason it gives.
REFUSED = [
    ("gemma-3-it", [Message("user", "a"), Message("user", "b")], "Conversation roles must alternate"),
    ("gemma-3-it", [Message("system", "s"), Message("assistant", "a")], "Conversation roles must alternate"),
    ("mistral-7b-instruct-v0.3", [Message("user", "a"), Message("user", "b")], "conversation roles must alternate"),
    ("mistral-7b-instruct-v0.3", [Message("assistant", "a"), Message("user", "b")], "conversation roles must alternate"),
    ("mistral-7b-instruct-v0.3", [Message("user", "a"), Message("assistant", "", (ToolCall("call_1", "get_time"),))],
     "Tool call IDs should be alphanumeric strings with length 9!"),
    ("llama-3.1-instruct", TWO_CALLS, "This model only supports single tool-calls at once!"),
    ("llama-3.2-instruct", TWO_CALLS, "This model only supports single tool-calls at once!"),
]


@pytest.mark.parametrize("name,messages,reason", REFUSED, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REFUSED)])
def test_refused_conversations_are_refused_by_both(name: str, messages: list[Message], reason: str) -> None:
    tools = TOOLS if any(m.tool_calls for m in messages) else None
    with pytest.raises(jinja2.TemplateError, match=reason):
        _hf_render(name, messages, True, tools)
    with pytest.raises(TemplateError) as caught:
        _ours(name).render(messages, tools=tools)
    text = str(caught.value)
    # The project's one-sentence error: what happened, and the template's own reason.
    assert text.startswith("The model's chat template refused the conversation: ") and reason in text
    assert "\n" not in text and "Traceback" not in text


def test_llama_tools_without_a_user_message_are_refused_by_both() -> None:
    reason = "Cannot put tools in the first user message when there's no first user message!"
    messages = [Message("system", "s")]
    with pytest.raises(jinja2.TemplateError, match=reason):
        _hf_render("llama-3.1-instruct", messages, True, TOOLS)
    with pytest.raises(TemplateError, match=reason):
        _ours("llama-3.1-instruct").render(messages, tools=TOOLS)


def test_tools_and_documents_are_defined_as_in_transformers() -> None:
    """Hugging Face always passes ``tools`` (None without tools) and ``documents`` (None), so
    ``tools is defined`` holds in its renderer; a template testing that must render alike."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = ("{{ tools is defined }}|{{ tools is none }}|{{ documents is defined }}|{{ documents is none }}|"
              "{% if tools is defined and tools %}{{ tools | tojson }}{% endif %}|{{ messages[0]['content'] }}")
    for tools in (None, TOOLS[:1]):
        ours = ChatTemplate(source).render([Message("user", TRICKY)], tools=tools)
        (theirs,), _ = render_jinja_template([[{"role": "user", "content": TRICKY}]], tools=tools, chat_template=source,
                                             add_generation_prompt=True, bos_token="", eos_token="")
        assert ours == theirs


# The built-in named templates (`--chat-template NAME`) against the models' own, on plain conversations.
NAMED = {"gemma": "gemma-3-it", "llama3": "llama-3.2-instruct", "mistral": "mistral-7b-instruct-v0.3",
         "phi3": "phi-3.5-mini-instruct"}


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("conversation", list(PLAIN_CONVERSATIONS))
@pytest.mark.parametrize("name", list(NAMED))
def test_named_templates_render_plain_conversations_as_the_models_own(
    name: str, conversation: str, add_generation_prompt: bool
) -> None:
    from llmlocal.engine.prompt.chat_template import BUILTIN_TEMPLATES

    model = NAMED[name]
    bos, eos, _ = MODELS[model]
    messages = PLAIN_CONVERSATIONS[conversation]
    ours = ChatTemplate(BUILTIN_TEMPLATES[name], bos_token=bos or "", eos_token=eos or "")
    assert ours.render(messages, add_generation_prompt=add_generation_prompt) == _hf_render(
        model, messages, add_generation_prompt, None)
