"""A request cut to the first characters of its prompt, as the fingerprint saw it.

The pre-warmer copies the prefix a busy worker holds onto another worker (:mod:`gateway.prewarm`).
The part of the request past that prefix (a RAG question, one session's history) is of use to
that request alone: copied too, it only takes the other worker's cache blocks and prefill time.
:func:`cut_body` cuts a forwarded body so that the prompt it carries is the first ``chars``
characters of the text the fingerprint was taken from (the body's texts are normalized
already, so that text is the body's own rendering):

* completions: a string prompt (or the first of several, the one the fingerprint covers) cut at
  ``chars``; token ids, the ids whose rendering ends within ``chars``;
* chat: the messages before the one the cut falls in, and that one with its content cut (a
  string, or its parts up to the cut). A chat template renders a message's content between its
  role's header and its end marker, so the cut message renders as the same text up to the cut.
  A cut that falls in a message's header, in a part that is not text, or anywhere in a message
  with tool calls or a tool call's id (they render after its content) keeps the messages
  before it.

Where no cut applies (a Responses request, a cut at or before the first message, one at or past
the prompt's end), :func:`cut_body` returns None and the caller keeps the whole request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.contracts.engine_paths import CHAT_PATH, COMPLETIONS_PATH
from gateway.normalize import render_messages, render_tools


def cut_body(path: str, body: Mapping[str, Any], chars: int) -> dict[str, Any] | None:
    """``body`` with its prompt cut to the first ``chars`` characters of its fingerprint
    text (module docstring), or None where it cannot be cut to less than it is."""
    if chars <= 0:
        return None
    if path == COMPLETIONS_PATH:
        prompt = _cut_prompt(body.get("prompt"), chars)
        return None if prompt is None else {**body, "prompt": prompt}
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        cut = _cut_messages(messages, body.get("tools"), chars)
        return None if cut is None else {**body, "messages": cut}
    return None


def _cut_prompt(prompt: Any, chars: int) -> str | list[int] | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # several prompts: the fingerprint is the first one's
    if isinstance(prompt, str):
        return prompt[:chars] if chars < len(prompt) else None
    if isinstance(prompt, list):  # token ids, rendered as "1 2 3"
        end = -1
        for kept, token in enumerate(prompt):
            end += 1 + len(str(token))
            if end > chars:
                return list(prompt[:kept]) if kept else None
    return None


def _cut_messages(messages: list[Any], tools: Any, chars: int) -> list[Any] | None:
    pos = len(render_tools(tools if isinstance(tools, list) else None))
    if chars <= pos:
        return None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return None
        end = pos + len(render_messages([message]))
        if end <= chars:
            pos = end
            continue
        # The cut falls in this message: past its header, in its content?
        header = {k: message[k] for k in ("role", "name") if k in message}
        offset = chars - pos - len(render_messages([header]))
        # Tool calls and a tool call's id render after the content: not cut through.
        whole = message.get("tool_calls") or message.get("tool_call_id")
        content = (_cut_content(message.get("content"), offset)
                   if offset > 0 and not whole else None)
        if content is None:
            return messages[:i] or None
        return [*messages[:i], {**message, "content": content}]
    return None  # the cut is at or past the prompt's end


def _cut_content(content: Any, offset: int) -> str | list[Any] | None:
    """The first ``offset`` rendered characters of a message's content, where that is text."""
    if isinstance(content, str):
        return content[:offset] if offset < len(content) else None
    if not isinstance(content, list):
        return None
    kept: list[Any] = []
    for part in content:
        is_text = isinstance(part, dict) and part.get("type") == "text"
        text = str(part.get("text", "")) if is_text else ""
        # A part that is not text renders as its canonical JSON (after the empty header).
        length = len(text) if is_text else len(render_messages([{"content": [part]}])) - 2
        if offset < length:
            if is_text and offset > 0:
                kept.append({**part, "text": text[:offset]})
            return kept or None
        kept.append(part)
        offset -= length
    return None  # the cut is past the content
