"""OpenAI's Responses API (``POST /v1/responses``), read as the chat it amounts to.

A Responses request carries ``instructions`` (a system prompt) and ``input``: a string (one user
message) or a list of items. Each item becomes one chat message:

* a message (``type`` ``message`` or none; ``role`` user, assistant, system or developer) keeps
  its role; its ``content`` is a string, or parts whose ``input_text`` / ``output_text`` /
  ``text`` parts give their text and whose other parts (``input_image``, ``input_file``, ...)
  their canonical JSON, joined;
* any other item of an agent's loop (``function_call``, ``reasoning``, ...) is the assistant's,
  and an ``..._output`` item (``function_call_output``) the tool's, as its canonical JSON.

The gateway routes a Responses request by the rendering of this chat (the next turn of an agent's
loop adds items, so its rendering extends the last one's and finds the worker that holds it), and
the reference worker runs it as this chat. ``max_output_tokens`` is the chat's ``max_tokens``;
``model``, ``stream``, ``tools``, ``tool_choice``, sampling and ``cache_salt`` carry over.

*Stored responses.* Unless a request says ``"store": false`` its answer may be stored by the
server that made it (OpenAI's default; vLLM with its response store on), and a later request
refers to it by id: ``previous_response_id`` (a next turn that sends only its new input, the
stored conversation before it) or the paths under ``/v1/responses/{id}``. Such a request must
reach the server that stored the response (:mod:`gateway.response_pins`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.contracts.chat import ChatFormatError, canonical_json

RESPONSES_PATH = "/v1/responses"
# The paths about one stored response: it, its input items, its cancellation (``{id}``).
STORED_RESPONSE_PATHS = ("/v1/responses/{response_id}",
                         "/v1/responses/{response_id}/input_items",
                         "/v1/responses/{response_id}/cancel")
_MAX_ID_CHARS = 256
# A response object whose first key is its id (of plain characters, as engines make them).
_ID_FIRST = re.compile(rb'\{\s*"id"\s*:\s*"([A-Za-z0-9_.:-]{1,256})"\s*[,}]')
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_CARRIED = ("model", "stream", "temperature", "top_p", "tools", "tool_choice", "cache_salt")


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses request; raises :class:`ChatFormatError` (with the
    Responses parameter at fault) for what is not one."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ChatFormatError("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise ChatFormatError("missing required parameter 'input'", "input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not (isinstance(items, list) and items):
        raise ChatFormatError("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise ChatFormatError(f"'{param}' must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise ChatFormatError(
                    f"'{param}.role' must be one of {', '.join(_MESSAGE_ROLES)}", f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"),
                                                            f"{param}.content")})
        elif isinstance(kind, str):
            role = "tool" if kind.endswith("_output") else "assistant"
            messages.append({"role": role, "content": canonical_json(item)})
        else:
            raise ChatFormatError(f"'{param}.type' must be a string", f"{param}.type")
    return messages


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"'{param}' must be a string or a list of parts", param)
    pieces: list[str] = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
            raise ChatFormatError(f"'{param}[{j}]' must be an object with a 'type'",
                                  f"{param}[{j}]")
        if part["type"] in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatFormatError(f"'{param}[{j}].text' must be a string",
                                      f"{param}[{j}].text")
            pieces.append(text)
        else:
            pieces.append(canonical_json(part))
    return "".join(pieces)


def as_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses request amounts to (module docstring)."""
    chat: dict[str, Any] = {"messages": chat_messages(body)}
    for name in _CARRIED:
        if body.get(name) is not None:
            chat[name] = body[name]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
            raise ChatFormatError("'max_output_tokens' must be a positive integer",
                                  "max_output_tokens")
        chat["max_tokens"] = limit
    return chat


def previous_response(body: Mapping[str, Any]) -> str | None:
    """The stored response a request continues (``previous_response_id``), if any; raises
    :class:`ChatFormatError` for what cannot be one."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None
    if not (isinstance(previous, str) and 0 < len(previous) <= _MAX_ID_CHARS):
        raise ChatFormatError(
            f"'previous_response_id' must be a response id (a string of 1 to {_MAX_ID_CHARS} "
            "characters)", "previous_response_id")
    return previous


def stores(body: Mapping[str, Any]) -> bool:
    """Whether the answer to a request may be stored (unless ``"store": false``)."""
    return body.get("store") is not False


def response_id_in(payload: bytes) -> str | None:
    """The id of the response in a Responses answer: a whole response object, or a stream
    whose ``response.created`` event (its first) is among ``payload``'s complete lines."""
    stripped = payload.lstrip()
    if stripped.startswith(b"{"):
        head = _ID_FIRST.match(stripped)  # engines write the id first: nothing else to read
        if head is not None:
            return head.group(1).decode()
        try:
            found = json.loads(stripped)
        except ValueError:
            return None
        return _id_of(found)
    for line in payload.split(b"\n")[:-1]:  # the last line may not be complete yet
        if not line.startswith(b"data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("response"), dict):
            return _id_of(event["response"])
    return None


def _id_of(response: Any) -> str | None:
    if not isinstance(response, dict) or response.get("object", "response") != "response":
        return None
    found = response.get("id")
    return found if isinstance(found, str) and 0 < len(found) <= _MAX_ID_CHARS else None
