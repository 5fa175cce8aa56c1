"""Validation of OpenAI request bodies into frozen values (pure; raises :class:`ApiError`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.contracts.chat import ChatFormatError
from gateway.contracts.chat_template import ChatTemplate, ReferenceTemplate
from worker.errors import ApiError
from worker.kvcache import Priority

DEFAULT_MAX_TOKENS = 16
MAX_TOKEN_ID = 2**32 - 1
MAX_N = 128  # samples per prompt, as OpenAI's API allows
MAX_STOPS = 16  # stop sequences per request

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class CommonParams:
    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str
    cache_priority: Priority = Priority.CONVERSATION
    """Extension field ``cache_priority``: eviction class of the prompt's cached blocks."""
    priority: int = 0
    """vLLM's ``priority``: with ``--scheduling-policy priority``, lower values run first."""
    n: int = 1
    """Samples per prompt: each prompt runs once per sample, sharing its cached blocks."""
    stop: tuple[str, ...] = ()
    """Stop sequences: an output ends before the first of them (:mod:`worker.stops`)."""
    data_parallel_rank: int | None = None
    """SGLang's body field naming the engine rank to run on (range checked at dispatch)."""


@dataclass(frozen=True)
class CompletionParams:
    common: CommonParams
    prompts: tuple[Prompt, ...]
    special_tokens: bool = True
    """Text prompts get the tokenizer's special tokens (BOS), as vLLM's completions do."""


@dataclass(frozen=True)
class ChatParams:
    common: CommonParams
    prompt: str
    system_prefix: str = ""
    """The leading system messages (and tools) as rendered: a string prefix of ``prompt``."""
    special_tokens: bool = False
    """Add special tokens on top of the template's (vLLM's ``add_special_tokens``)."""


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object", code="invalid_json")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_error(param: str, expected: str) -> ApiError:
    return ApiError(f"'{param}' must be {expected}", param=param, code="invalid_type")


def _optional_positive_int(body: Mapping[str, Any], param: str) -> int | None:
    value = body.get(param)
    if value is None:
        return None
    if not _is_int(value):
        raise _type_error(param, "an integer")
    if value < 1:
        raise ApiError(f"'{param}' must be >= 1, got {value}", param=param, code="invalid_value")
    return int(value)


def _absent(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


# Parameters this worker does not implement, and the values that ask for nothing (so clients
# that send the defaults explicitly are served). Anything else is a 400, not silently ignored.
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    # name: (what is missing, predicate "this value asks for nothing")
    # ``tools`` is not listed: tools are rendered into the prompt (and cached with it) as
    # context; the simulated model answers in text, which tool_choice "auto" allows and "none"
    # asks for. A choice that requires a call ("required", a named function) is refused.
    "tool_choice": (
        'a required tool call (tool_choice "auto" and "none" take the tools as context and '
        "are answered in text)",
        lambda v: v is None or v in ("none", "auto"),
    ),
    "functions": ("function calling", _absent),
    "function_call": ("function calling", lambda v: v is None or v == "none"),
    "response_format": (
        "structured output", lambda v: v is None or (isinstance(v, dict) and v == {"type": "text"})
    ),
    "logprobs": ("log probabilities", lambda v: v is None or v is False),
    "top_logprobs": ("log probabilities", _absent),
    "best_of": ("best_of sampling", lambda v: v is None or v == 1),
    "echo": ("echoing the prompt", lambda v: v is None or v is False),
    "suffix": ("suffix insertion", _absent),
    "logit_bias": ("logit bias", _absent),
    "prediction": ("predicted outputs", _absent),
    "audio": ("audio output", _absent),
    "modalities": ("non-text output", lambda v: v is None or v == ["text"]),
}


def reject_unsupported(body: Mapping[str, Any]) -> None:
    """A 400 for any parameter this worker would otherwise ignore while the client relies on
    it (tool calls, structured output, log probabilities, several choices, ...)."""
    for param, (feature, asks_nothing) in _UNSUPPORTED.items():
        if param not in body:
            continue
        value = body[param]
        if asks_nothing(value):
            continue
        raise ApiError(
            f"'{param}' is not supported by this worker ({feature} is not implemented)",
            param=param, code="unsupported_parameter",
        )


def parse_common(
    body: Mapping[str, Any], served_model: str, *, max_tokens_params: tuple[str, ...]
) -> CommonParams:
    if body.get("model") is None:
        raise ApiError(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    check_model(body, served_model)
    model = served_model
    max_tokens = DEFAULT_MAX_TOKENS
    for param in max_tokens_params:
        value = _optional_positive_int(body, param)
        if value is not None:
            max_tokens = value
            break
    n = _optional_positive_int(body, "n") or 1
    if n > MAX_N:
        raise ApiError(f"'n' must be at most {MAX_N}, got {n}", param="n", code="invalid_value")
    reject_unsupported(body)
    stop = _stops(body.get("stop"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object")
        flag = options.get("include_usage")
        if flag is not None and not isinstance(flag, bool):
            raise _type_error("stream_options.include_usage", "a boolean")
        include_usage = bool(flag)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _type_error("cache_salt", "a string")
    priority = Priority.CONVERSATION
    raw_priority = body.get("cache_priority")
    if raw_priority is not None:
        if not isinstance(raw_priority, str):
            raise _type_error("cache_priority", "a string")
        try:
            priority = Priority.parse(raw_priority)
        except ValueError as exc:
            raise ApiError(str(exc), param="cache_priority", code="invalid_value") from exc
    order = body.get("priority", 0)
    if not isinstance(order, int) or isinstance(order, bool):
        raise _type_error("priority", "an integer")
    rank = body.get("data_parallel_rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise _type_error("data_parallel_rank", "a non-negative integer")
    return CommonParams(
        model=model,
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=include_usage,
        cache_salt=salt or "",
        cache_priority=priority,
        priority=order,
        n=n,
        stop=stop,
        data_parallel_rank=rank,
    )


def _stops(value: Any) -> tuple[str, ...]:
    """The ``stop`` parameter: a string, or a list of up to :data:`MAX_STOPS` strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if (not isinstance(value, list) or len(value) > MAX_STOPS
            or not all(isinstance(s, str) for s in value)):
        raise _type_error("stop", f"a string or a list of at most {MAX_STOPS} strings")
    return tuple(value)


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    for tok in value:
        if not _is_int(tok) or not 0 <= tok <= MAX_TOKEN_ID:
            raise ApiError(
                f"'{param}' token ids must be integers in [0, {MAX_TOKEN_ID}]",
                param=param, code="invalid_type",
            )
    return tuple(value)


def parse_prompts(value: Any, param: str = "prompt") -> tuple[Prompt, ...]:
    """``prompt`` (or the embeddings' ``input``, ``param``) as str, list[str], list[int] or
    list[list[int]] -> one entry per choice (per embedding)."""
    if value is None:
        raise ApiError(
            f"you must provide {'a prompt' if param == 'prompt' else f'an {param}'}",
            param=param, code="missing_required_parameter")
    if isinstance(value, str):
        return (value,)
    expected = "a string, a list of strings, a list of token ids or a list of token id lists"
    if not isinstance(value, list):
        raise _type_error(param, expected)
    if not value:
        raise ApiError(f"'{param}' must not be an empty list", param=param,
                       code="invalid_value")
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(_is_int(p) for p in value):
        return (_token_ids(value, param),)
    if all(isinstance(p, list) for p in value):
        return tuple(_token_ids(p, f"{param}[{i}]") for i, p in enumerate(value))
    raise _type_error(param, expected)


def check_model(body: Mapping[str, Any], served_model: str) -> None:
    """``model`` may be left out (the served one, as vLLM's pooling and tokenizer endpoints
    take it); given, it must name the served model."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    if model != served_model:
        raise ApiError(
            f"The model '{model}' does not exist; this worker serves '{served_model}'",
            status=404, param="model", code="model_not_found",
        )


@dataclass(frozen=True)
class EmbeddingParams:
    inputs: tuple[Prompt, ...]
    dimensions: int
    base64: bool  # ``encoding_format: "base64"`` (little-endian float32), else float lists


def parse_embedding(body: Mapping[str, Any], served_model: str,
                    default_dimensions: int, max_dimensions: int) -> EmbeddingParams:
    """An OpenAI embeddings request (``input``, ``encoding_format``, ``dimensions``)."""
    check_model(body, served_model)
    inputs = parse_prompts(body.get("input"), "input")
    if any(p == "" or p == () for p in inputs):
        raise ApiError("'input' must not contain an empty string or token list",
                       param="input", code="invalid_value")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise ApiError("'encoding_format' must be \"float\" or \"base64\"",
                       param="encoding_format", code="invalid_value")
    dimensions = _optional_positive_int(body, "dimensions") or default_dimensions
    if dimensions > max_dimensions:
        raise ApiError(f"'dimensions' must be at most {max_dimensions}, got {dimensions}",
                       param="dimensions", code="invalid_value")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _type_error("cache_salt", "a string")
    return EmbeddingParams(inputs, dimensions, fmt == "base64")


def parse_completion(body: Mapping[str, Any], served_model: str) -> CompletionParams:
    common = parse_common(body, served_model, max_tokens_params=("max_tokens",))
    return CompletionParams(
        common=common, prompts=parse_prompts(body.get("prompt")),
        special_tokens=body.get("add_special_tokens") is not False,
    )


def parse_chat(
    body: Mapping[str, Any], served_model: str, template: ChatTemplate | None = None
) -> ChatParams:
    """``template``: the chat template (the reference one by default); the request's
    ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` apply."""
    template = template if template is not None else ReferenceTemplate()
    common = parse_common(
        body, served_model, max_tokens_params=("max_completion_tokens", "max_tokens")
    )
    messages = body.get("messages")
    if messages is None:
        raise ApiError(
            "you must provide messages", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of messages")
    if not messages:
        raise ApiError("'messages' must not be empty", param="messages", code="invalid_value")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _type_error("tools", "a list")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _type_error("chat_template_kwargs", "an object")
    try:
        prompt = template.render(
            messages, tools,
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=body.get("continue_final_message") is True,
            extra=kwargs,
        )
        system_prefix = template.render_system_prefix(messages, tools)
    except ChatFormatError as exc:
        raise ApiError(str(exc), param=exc.param, code="invalid_value") from exc
    return ChatParams(
        common=common, prompt=prompt, system_prefix=system_prefix,
        special_tokens=body.get("add_special_tokens") is True,
    )
