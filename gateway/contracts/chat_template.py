"""Chat templates: OpenAI chat messages -> the prompt string an engine tokenizes.

Two kinds, one interface (:class:`ChatTemplate`):

* ``reference``: the reference worker's own format (:mod:`gateway.contracts.chat`);
* a model's HuggingFace Jinja template, loaded from a local file: a ``tokenizer_config.json``
  (its ``chat_template``, a string or a list of named templates of which ``default`` is used,
  and its ``bos_token``/``eos_token``) or a bare Jinja file (as ``vllm serve --chat-template``
  takes). It is rendered the way vLLM renders it through ``transformers``: a sandboxed Jinja
  environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
  ``tojson`` filter that keeps non-ASCII text, and the ``raise_exception`` and
  ``strftime_now`` globals; messages in vLLM's default "string" content format (text parts
  joined by newlines) with tool-call arguments parsed from JSON text into objects.

The gateway renders with the same template as the engine behind it so that its token-exact
prompt keys match the engine's KV blocks; the reference worker takes the same option so that a
test can run the whole path without a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.contracts.chat import (
    SYSTEM_ROLES,
    ChatFormatError,
    render_chat,
    render_system_prefix,
)

REFERENCE = "reference"


class ChatTemplateError(ValueError):
    """A chat template file cannot be loaded."""


class ChatTemplate(Protocol):
    @property
    def name(self) -> str: ...

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt; raises :class:`ChatFormatError` for messages it cannot render."""
        ...

    def render_system_prefix(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None
    ) -> str:
        """The rendering of the leading system messages alone (a best-effort prefix)."""
        ...


class ReferenceTemplate:
    """The reference worker's format (:mod:`gateway.contracts.chat`)."""

    @property
    def name(self) -> str:
        return REFERENCE

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        prompt = add_generation_prompt and not continue_final_message
        text = render_chat(messages, tools, add_generation_prompt=prompt)
        if continue_final_message and text.endswith("<|end|>\n"):
            text = text[: -len("<|end|>\n")]
        return text

    def render_system_prefix(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None
    ) -> str:
        return render_system_prefix(messages, tools)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _text_content(content: Any, param: str) -> Any:
    """vLLM's "string" content format: a list of text parts becomes their texts joined by
    newlines; other part types cannot be keyed here."""
    if not isinstance(content, list):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ChatFormatError("only text content parts are supported", f"{param}[{j}]")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatFormatError("content part 'text' must be a string", f"{param}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(calls: Any) -> Any:
    """Tool-call ``arguments`` given as JSON text become objects, as templates expect."""
    if not isinstance(calls, list):
        return calls
    out: list[Any] = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def _messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatFormatError("each message must be an object with a role", f"messages[{i}]")
        item = dict(message)
        item["content"] = _text_content(message.get("content"), f"messages[{i}].content")
        if "tool_calls" in item:
            item["tool_calls"] = _tool_calls(item["tool_calls"])
        out.append(item)
    return out


@dataclass(frozen=True, slots=True)
class JinjaTemplate:
    """A model's HuggingFace chat template."""

    source: str
    template: jinja2.Template
    bos_token: str = ""
    eos_token: str = ""

    @property
    def name(self) -> str:
        return f"jinja:{self.source}"

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        variables: dict[str, Any] = dict(extra or {})
        variables.update(
            messages=_messages(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            text = self.template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ChatFormatError(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from exc
        if continue_final_message and messages:
            last = variables["messages"][-1].get("content")
            if isinstance(last, str) and last.strip() and last.strip() in text:
                # as transformers does: cut after the final message's text
                text = text[: text.rindex(last.strip()) + len(last.strip())]
        return text

    def render_system_prefix(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None
    ) -> str:
        leading = []
        for message in messages:
            if not isinstance(message, Mapping) or message.get("role") not in SYSTEM_ROLES:
                break
            leading.append(message)
        if not leading:
            return ""
        try:
            return self.render(leading, tools, add_generation_prompt=False)
        except ChatFormatError:
            return ""


def _token_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _compile(text: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template {source!r} does not compile: {exc}") from exc


def _from_config(config: Mapping[str, Any], source: str) -> JinjaTemplate:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {
            t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)
        }
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(f"{source!r} has no chat_template")
    return JinjaTemplate(
        source, _compile(template, source),
        _token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
    )


def load_chat_template(spec: str) -> ChatTemplate:
    """``reference``, or the path of a ``tokenizer_config.json`` or a Jinja template file."""
    if spec == REFERENCE:
        return ReferenceTemplate()
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read chat template {spec!r}: {exc}") from exc
    if path.suffix == ".json":
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise ChatTemplateError(f"{spec!r} is not JSON: {exc}") from exc
        if not isinstance(config, Mapping):
            raise ChatTemplateError(f"{spec!r} is not a JSON object")
        return _from_config(config, spec)
    tokens: Mapping[str, Any] = {}
    sibling = path.with_name("tokenizer_config.json")
    if sibling.is_file():  # BOS/EOS text for a bare template, when the model's config is there
        try:
            loaded = json.loads(sibling.read_text(encoding="utf-8"))
            tokens = loaded if isinstance(loaded, Mapping) else {}
        except (OSError, ValueError):
            tokens = {}
    return JinjaTemplate(
        spec, _compile(text, spec),
        _token_text(tokens.get("bos_token")), _token_text(tokens.get("eos_token")),
    )
