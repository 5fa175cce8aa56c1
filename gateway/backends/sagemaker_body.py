"""Request and response bodies of SageMaker targets, per body shape (pure functions).

``openai``: the container speaks the OpenAI schema on ``/invocations`` (LMI >= 0.29 and TGI >= 2
dispatch on the payload: ``messages`` -> chat, ``prompt`` -> completions). The request goes as is;
the reply comes back as is; streamed lines are re-framed as SSE (``data: ...`` plus a blank line)
whether the container sent SSE or JSON lines, and ``data: [DONE]`` closes the stream.

``tgi``: the ``{"inputs", "parameters"}`` schema of TGI / LMI's rolling-batch handlers. Chat
messages are rendered with a plain, model-agnostic template (use ``openai`` where the model's own
chat template matters); the reply (``generated_text`` + ``details``, or streamed ``token`` lines)
is mapped back to an OpenAI ``chat.completion`` / ``text_completion`` and its chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.contracts.errors import openai_error

TGI_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop", "stop": "stop"}


class BodyError(ValueError):
    """The request cannot be expressed in the target's body shape (a 400 for the client)."""


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def error_event(code: str, message: str, kind: str = "upstream_error") -> bytes:
    """An SSE event the openai client raises as ``APIError`` (it looks for ``error``)."""
    return _sse(openai_error(message, kind, code=code))


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


# -- tgi: request --------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def render_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """A plain chat rendering for models without a template on this path."""
    lines = [f"{m.get('role', 'user')}: {_content_text(m.get('content'))}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def tgi_request(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    if is_chat(path):
        inputs = render_prompt(body.get("messages") or [])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BodyError("this SageMaker target (body=tgi) takes one text prompt per request")
        inputs = prompt
    params: dict[str, Any] = {"details": True, "return_full_text": False}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        # TGI rejects temperature 0: greedy decoding is "do_sample: false".
        params["do_sample"] = temperature > 0
        if temperature > 0:
            params["temperature"] = temperature
    top_p = body.get("top_p")
    if top_p is not None and 0 < top_p < 1:
        params["top_p"] = top_p
    stop = body.get("stop")
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("seed") is not None:
        params["seed"] = body["seed"]
    return {"inputs": inputs, "parameters": params, "stream": bool(body.get("stream"))}


def encode_request(shape: str, path: str, body: Mapping[str, Any]) -> bytes:
    payload = tgi_request(path, body) if shape == "tgi" else body
    return json.dumps(payload, ensure_ascii=False).encode("utf-8")


# -- tgi: response -------------------------------------------------------------------------------


def _new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(details: Mapping[str, Any] | None) -> dict[str, int] | None:
    if not details:
        return None
    completion = details.get("generated_tokens")
    if not isinstance(completion, int):
        return None
    prefill = details.get("prefill")
    prompt = len(prefill) if isinstance(prefill, list) else 0
    if not prompt and isinstance(details.get("inputs_tokens"), int):
        prompt = details["inputs_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finish(details: Mapping[str, Any] | None, default: str = "stop") -> str:
    reason = (details or {}).get("finish_reason")
    return TGI_FINISH.get(str(reason), default) if reason else default


def tgi_reply(path: str, request: Mapping[str, Any], raw: bytes) -> bytes:
    """``[{"generated_text", "details"}]`` or ``{"generated_text", ...}`` -> an OpenAI reply."""
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BodyError(f"the container's reply is not JSON: {exc}") from exc
    if isinstance(parsed, list) and parsed:
        parsed = parsed[0]
    if not isinstance(parsed, dict) or not isinstance(parsed.get("generated_text"), str):
        raise BodyError("the container's reply has no generated_text")
    text: str = parsed["generated_text"]
    details = parsed.get("details") if isinstance(parsed.get("details"), dict) else None
    chat = is_chat(path)
    model = str(request.get("model", ""))
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(details), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    out: dict[str, Any] = {
        "id": _new_id(chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    usage = _usage(details)
    if usage is not None:
        out["usage"] = usage
    return json.dumps(out, ensure_ascii=False).encode("utf-8")


# -- streams -------------------------------------------------------------------------------------


class OpenAIStream:
    """Lines of SSE or JSON lines from the container -> SSE events for the client."""

    def __init__(self) -> None:
        self.done = False

    def lines(self, lines: Sequence[str]) -> bytes:
        out = bytearray()
        for line in lines:
            if not line or line.startswith(":") or line.startswith(("event:", "id:", "retry:")):
                continue
            data = line[5:].lstrip() if line.startswith("data:") else line
            if data == "[DONE]":
                self.done = True
            out += _sse(data)
        return bytes(out)

    def finish(self) -> bytes:
        return b"" if self.done else _sse("[DONE]")


class TGIStream:
    """TGI / LMI streamed ``token`` lines -> OpenAI chunks (``chat.completion.chunk``...)."""

    def __init__(self, path: str, request: Mapping[str, Any]) -> None:
        self._chat = is_chat(path)
        self._id = _new_id(self._chat)
        self._model = str(request.get("model", ""))
        self._created = int(time.time())
        options = request.get("stream_options")
        self._include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self._started = False
        self._finished = False
        self.done = False

    def _chunk(self, text: str | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self._chat:
            delta: dict[str, Any] = {}
            if not self._started:
                delta["role"] = "assistant"
                self._started = True
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {
            "id": self._id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
        }

    def _final(self, details: Mapping[str, Any] | None) -> bytes:
        self._finished = True
        out = _sse(self._chunk(None, _finish(details)))
        usage = _usage(details)
        if self._include_usage and usage is not None:
            tail = self._chunk(None, None)
            tail["choices"] = []
            tail["usage"] = usage
            out += _sse(tail)
        return out

    def lines(self, lines: Sequence[str]) -> bytes:
        out = bytearray()
        for line in lines:
            data = line[5:].strip() if line.startswith("data:") else line.strip()
            if not data or self._finished:
                continue
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                continue  # not an event line (a comment, keep-alive)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                self._finished = True
                out += error_event(str(event.get("error_type") or "model_error"),
                                   str(event["error"]))
                continue
            token = event.get("token")
            if isinstance(token, dict) and not token.get("special"):
                text = token.get("text")
                if isinstance(text, str) and text:
                    out += _sse(self._chunk(text, None))
            details = event.get("details")
            if isinstance(details, dict) or isinstance(event.get("generated_text"), str):
                out += self._final(details if isinstance(details, dict) else None)
        return bytes(out)

    def finish(self) -> bytes:
        out = b"" if self._finished else self._final(None)
        self.done = True
        return out + _sse("[DONE]")
