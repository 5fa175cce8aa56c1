"""Model chat templates (Jinja, HuggingFace layout) as vLLM renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.contracts.chat import ChatFormatError, render_chat
from gateway.contracts.chat_template import (
    ChatTemplateError,
    ReferenceTemplate,
    load_chat_template,
)

# A ChatML-style template with the features real ones use: BOS, tools through tojson, a
# system-first check with raise_exception, loop controls, generation prompt, a template kwarg.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}"
    "{% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function.name }} {{ call.function.arguments.city }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({
        "chat_template": TEMPLATE,
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
    }))
    return path


def test_renders_like_the_engine(config: Path) -> None:
    template = load_chat_template(str(config))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert template.render(messages) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(messages, add_generation_prompt=False).endswith("b<|im_end|>\n")
    thinking = template.render(messages, extra={"enable_thinking": False})
    assert thinking.endswith("<|im_start|>assistant\n<think></think>")
    tools = [{"type": "function", "function": {"name": "météo"}}]
    assert '# Tools\n[{"type": "function", "function": {"name": "météo"}}]' in template.render(
        messages, tools
    )
    assert template.render_system_prefix(messages) == "<s><|im_start|>system\nBe brief.<|im_end|>\n"
    assert template.name == f"jinja:{config}"


def test_tool_call_arguments_become_objects(config: Path) -> None:
    template = load_chat_template(str(config))
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}}
    text = template.render([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert "<tool_call>weather Oslo</tool_call>" in text


def test_continue_final_message_stops_after_its_text(config: Path) -> None:
    template = load_chat_template(str(config))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    text = template.render(messages, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello th")


def test_template_rejections_are_format_errors(config: Path) -> None:
    template = load_chat_template(str(config))
    misplaced = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatFormatError, match="System message must be first"):
        template.render(misplaced)
    with pytest.raises(ChatFormatError):
        template.render([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatFormatError):
        template.render(["not a message"])


def test_named_templates_and_bare_files(tmp_path: Path) -> None:
    named = tmp_path / "named" / "tokenizer_config.json"
    named.parent.mkdir()
    named.write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]}))
    assert load_chat_template(str(named)).render([]) == "DEFAULT"
    bare = tmp_path / "bare" / "chat.jinja"
    bare.parent.mkdir()
    bare.write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    (bare.parent / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<B>"}))
    assert load_chat_template(str(bare)).render([{"role": "user", "content": "x"}]) == "<B>x"


@pytest.mark.parametrize(("name", "text", "match"), [
    ("missing.json", None, "cannot read"),
    ("bad.json", "{", "not JSON"),
    ("none.json", "{}", "no chat_template"),
    ("broken.jinja", "{% for %}", "does not compile"),
])
def test_bad_template_files(tmp_path: Path, name: str, text: str | None, match: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ChatTemplateError, match=match):
        load_chat_template(str(path))


def test_the_sandbox_holds(tmp_path: Path) -> None:
    path = tmp_path / "evil.jinja"
    path.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatFormatError):
        load_chat_template(str(path)).render([{"role": "user", "content": "x"}])


def test_reference_template_is_the_reference_rendering() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    template = load_chat_template("reference")
    assert isinstance(template, ReferenceTemplate)
    assert template.render(messages) == render_chat(messages)
    assert template.render(messages, continue_final_message=True) == (
        render_chat(messages, add_generation_prompt=False)[: -len("<|end|>\n")]
    )
