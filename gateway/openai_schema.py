"""Validation of OpenAI-compatible request bodies (pure functions, no HTTP).

Each parser checks the fields the gateway relies on, raises :class:`InvalidRequest` naming the
offending ``param``, normalizes the prompt text in place of the client's, and returns a
:class:`ParsedRequest`: the body to forward, and the canonical text to fingerprint. Fields the
gateway does not interpret are forwarded untouched, so worker-specific extensions keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.contracts.chat import ROLES, ChatFormatError
from gateway.contracts.responses import as_chat_body, previous_response
from gateway.errors import InvalidRequest
from gateway.normal_texts import TextScope
from gateway.normalize import (
    NormalizeOptions,
    NormalPrefix,
    normalize_after,
    normalize_content,
    normalize_messages,
    normalize_text,
    render_messages,
    render_tools,
)
from gateway.values import value

MAX_TOKENS_LIMIT = 2**31 - 1  # larger values are no budget any server can honour
MAX_N = 128
CHAT_ROLES = ROLES  # what the reference worker renders (gateway.contracts.chat)


@dataclass(frozen=True, slots=True)
class KnownHistory:
    """The leading messages of a chat as the parser left them: what a later turn of the same
    chat, which sends them again, need not check, normalize or render again
    (:class:`gateway.chat_histories.ChatHistories` finds them by the bytes that carried them)."""

    normalized: tuple[dict[str, Any], ...]
    text: str  # their rendering (gateway.normalize.render_messages)
    unchanged: bool  # normalization left every one of them as it was sent
    # Where normalization changed one: their JSON as a worker gets it, comma-separated (the
    # inside of the array), so that a later turn's body is not encoded again whole.
    encoded: bytes | None = None
    # Leading messages that are not in the body's array: a Responses request's instructions.
    lead: int = 0


# Chats whose messages render to fewer characters are checked again rather than remembered.
HISTORY_MIN_CHARS = 16_384


@value
class ParsedRequest:
    model: str
    body: dict[str, Any]
    fingerprint_text: str
    stream: bool
    max_tokens: int | None
    cache_salt: str
    # Normalization changed nothing: ``body`` equals what the client sent, so the client's own
    # bytes can be forwarded instead of encoding ``body`` again.
    unchanged: bool = False
    prompt_chars: int = 0
    """Characters of every text prompt (all prompts of a batch; a chat as rendered)."""
    prompt_token_ids: int = 0
    """Token ids given directly as prompts, summed over the batch."""
    sequences: int = 1
    """Outputs the worker generates: prompts x ``n``."""
    history: KnownHistory | None = None
    """A long chat's messages but its last, as checked, where the parser was asked to keep
    them (None for other requests)."""
    normal: NormalPrefix | None = None
    """What normalization made of a completions prompt that is one text, where the parser was
    asked to keep it and knows it (None for other requests)."""


# The deepest nesting orjson encodes (it refuses 255 levels): a body the gateway may encode
# again for a worker must encode, so a deeper one is refused as it arrives.
MAX_JSON_DEPTH = 254
# A body's depth check looks for more brackets than the walk's budget in a body up to this
# long, and walks at most this many containers of a longer one, or of one with more brackets,
# before it searches for brackets one by one (:func:`too_deep`).
_WALK_FROM_BYTES = 64 << 10
_WALK_BUDGET = 16


def _opens_more_than(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` holds more than ``limit`` opening brackets (an upper bound on its depth):
    at most ``limit + 1`` searches at memory speed, where counting them all would read a long
    body twice more."""
    seen = 0
    for opener in (b"{", b"["):
        at = raw.find(opener)
        while at >= 0:
            seen += 1
            if seen > limit:
                return True
            at = raw.find(opener, at + 1)
    return False


def _encodes(value: Any) -> bool:
    """Whether orjson encodes ``value`` (as orjson decoded it: only its depth can stop it).
    Encoding is the check itself, in C: on an agent transcript of thousands of messages a
    sixth of the time of walking the containers level by level in Python."""
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


def _nests_deeper(value: Any, limit: int, budget: int) -> bool | None:
    """Whether ``value`` nests more than ``limit`` levels of containers (``value`` itself the
    first), found by walking its containers (strings and numbers are not looked into); None
    once more than ``budget`` containers were visited (undecided)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    visited = 0
    while stack:
        node, depth = stack.pop()
        visited += 1
        if visited > budget:
            return None
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def too_deep(raw: bytes, value: Any) -> bool:
    """Whether ``value``, decoded from ``raw``, nests deeper than :data:`MAX_JSON_DEPTH`.

    Each step is exact, the cheapest first. A short body (up to :data:`_WALK_FROM_BYTES`)
    with at most :data:`_WALK_BUDGET` brackets (searched for at memory speed) nests no
    deeper than that. Else the containers are walked, which reads none of the text and
    decides a body of few of them: a completions request, whose prompt is one string
    however many brackets a prompt of code holds (one search per bracket cost such a
    20,000-byte agent prompt 50 us, the walk 4 us; a 640,000-character one 15 us against
    0.86). Else a long body's brackets are searched for up to ``MAX_JSON_DEPTH + 1``,
    which spares encoding a long transcript of plain text; else the body is encoded (for
    a short body, cheaper than a search per bracket)."""
    short = len(raw) <= _WALK_FROM_BYTES
    if short and not _opens_more_than(raw, _WALK_BUDGET):
        return False
    deeper = _nests_deeper(value, MAX_JSON_DEPTH, _WALK_BUDGET)
    if deeper is not None:
        return deeper
    if not short and not _opens_more_than(raw, MAX_JSON_DEPTH):
        return False
    return not _encodes(value)


class ClientJSON(dict[str, Any]):
    """A request body exactly as the client sent it: the decoded object, and in ``raw`` its
    bytes, which a backend forwards instead of encoding the object again. Nothing mutates a
    forwarded body (a backend that changes one builds a plain dict), so ``raw`` stays true."""

    __slots__ = ("raw",)

    def __init__(self, body: Mapping[str, Any], raw: bytes) -> None:
        super().__init__(body)
        self.raw = raw


def forwarded_body(parsed: ParsedRequest, raw: bytes) -> dict[str, Any]:
    """The body to send upstream: the client's own bytes where normalization changed nothing."""
    return ClientJSON(parsed.body, raw) if parsed.unchanged else parsed.body


def with_fields(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``fields`` set (a new object; ``body`` is not changed). A client's body
    that has none of them keeps its bytes: the fields are written in front of its own keys,
    so a long body is not encoded again for one field (vLLM's ``cache_salt``). Where it has
    one already, the whole body is encoded again: a key sent twice would leave the winner to
    the worker's parser."""
    if isinstance(body, ClientJSON) and not any(key in body for key in fields):
        raw = body.raw
        start = len(raw) - len(raw.lstrip())
        if raw[start:start + 1] == b"{" and body:  # an object with keys: one comma after ours
            head = orjson.dumps(dict(fields))[:-1] + b","
            return ClientJSON({**fields, **body}, raw[:start] + head + raw[start + 1:])
    return {**body, **fields}


_MESSAGES_MARK = "\x00messages"


def _encoded(body: Mapping[str, Any], history: bytes, last: Any) -> bytes:
    """The JSON of a chat ``body`` whose messages but the last are encoded as ``history``
    (comma-separated), as ``orjson.dumps(body)`` writes it: the rest of the body is encoded
    around a mark that stands for the messages."""
    around = orjson.dumps({**body, "messages": _MESSAGES_MARK})
    mark = orjson.dumps(_MESSAGES_MARK)
    if around.count(mark) != 1:  # the mark's text in another field too
        return orjson.dumps(body)
    before, after = around.split(mark)
    return b"".join((before, b"[", history, b",", orjson.dumps(last), b"]", after))


def encode_body(body: Mapping[str, Any]) -> bytes:
    """JSON bytes of an upstream body: the client's own for a :class:`ClientJSON`."""
    if isinstance(body, ClientJSON):
        return body.raw
    return orjson.dumps(body)


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or :class:`InvalidRequest` for anything else: bad
    UTF-8 or JSON (orjson refuses unpaired surrogate escapes, NaN and numbers beyond a double),
    nesting deeper than :data:`MAX_JSON_DEPTH` (a body re-encoded for a worker must encode)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(value, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    if too_deep(raw, value):
        raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                             code="invalid_json")
    return value


def _invalid(message: str, param: str) -> InvalidRequest:
    """An invalid field (checked inline by the callers: once per field and request)."""
    return InvalidRequest(message, param=param, code="invalid_type")


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and n >= 1 else 1


_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
_NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def _common(body: Mapping[str, Any]) -> tuple[str, bool, int | None, str]:
    get = body.get
    model = get("model")
    if model is None:
        raise InvalidRequest("missing required parameter 'model'", param="model",
                             code="missing_required_parameter")
    if not (isinstance(model, str) and model != ""):
        raise _invalid("'model' must be a non-empty string", "model")
    stream = get("stream", False)
    if not (stream is None or isinstance(stream, bool)):
        raise _invalid("'stream' must be a boolean", "stream")
    max_tokens: Any = None
    for name in _TOKEN_FIELDS:
        value = get(name)
        if value is not None:
            if not (isinstance(value, int) and not isinstance(value, bool)
                    and 1 <= value <= MAX_TOKENS_LIMIT):
                raise _invalid(f"'{name}' must be an integer from 1 to {MAX_TOKENS_LIMIT}", name)
            max_tokens = value
    for name in _NUMBER_FIELDS:
        value = get(name)
        if not (value is None or (isinstance(value, int | float)
                                  and not isinstance(value, bool))):
            raise _invalid(f"'{name}' must be a number", name)
    n = get("n")
    if not (n is None or (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N)):
        raise _invalid(f"'n' must be an integer from 1 to {MAX_N}", "n")
    salt = get("cache_salt", "")
    if not (salt is None or isinstance(salt, str)):
        raise _invalid("'cache_salt' must be a string", "cache_salt")
    options = get("stream_options")
    if not (options is None or isinstance(options, dict)):
        raise _invalid("'stream_options' must be an object", "stream_options")
    return str(model), bool(stream), max_tokens, salt or ""


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def parse_completion(
    body: dict[str, Any], opts: NormalizeOptions, seen: TextScope | None = None,
    known: KnownHistory | NormalPrefix | None = None, keep_history: bool = False,
) -> ParsedRequest:
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids or lists of ids.

    ``known`` (a :class:`NormalPrefix`): the prompt is a string that begins with the text an
    earlier request's prompt was, as this parser normalized it then; the rules run past it
    only. ``keep_history``: a prompt that is one string keeps what normalization made of it
    (``ParsedRequest.normal``) for a later turn, where the parser knows it."""
    model, stream, max_tokens, salt = _common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("missing required parameter 'prompt'", param="prompt",
                             code="missing_required_parameter")
    prompt = body["prompt"]
    forwarded = dict(body)
    chars = ids = 0
    count = 1
    normal = None
    if isinstance(prompt, str):
        if isinstance(known, NormalPrefix) and known.chars <= len(prompt):
            text, normal = normalize_after(prompt, opts, known)
        else:
            text = normalize_text(prompt, opts, seen)
            if keep_history and text is prompt:  # the rules left it as it was
                normal = NormalPrefix(len(prompt), None)
        forwarded["prompt"] = text
        chars = len(text)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        forwarded["prompt"] = normalized = [normalize_text(p, opts, seen) for p in prompt]
        text = normalized[0]
        chars, count = sum(map(len, normalized)), len(normalized)
    elif isinstance(prompt, list) and prompt and _is_token_list(prompt):
        text = " ".join(map(str, prompt))
        ids = len(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_list(p) and p for p in prompt):
        text = " ".join(map(str, prompt[0]))
        ids, count = sum(map(len, prompt)), len(prompt)
    else:
        raise InvalidRequest(
            "'prompt' must be a string, a non-empty list of strings, a list of token ids "
            "or a list of token-id lists", param="prompt", code="invalid_type")
    unchanged = forwarded["prompt"] == prompt
    return ParsedRequest(model, forwarded, text, stream, max_tokens, salt, unchanged,
                         prompt_chars=chars, prompt_token_ids=ids,
                         sequences=count * _choices(body),
                         normal=normal if keep_history else None)


_ROLE_LIST = ", ".join(sorted(CHAT_ROLES))


def _check_message(i: int, message: Any) -> None:
    if not isinstance(message, dict):
        raise _invalid(f"'messages[{i}]' must be an object", f"messages[{i}]")
    role = message.get("role")
    if not (isinstance(role, str) and role in CHAT_ROLES):
        raise _invalid(f"'messages[{i}].role' must be one of {_ROLE_LIST}", f"messages[{i}].role")
    content = message.get("content")
    if isinstance(content, str):
        pass
    elif content is None:
        if not (role == "assistant" and message.get("tool_calls")):
            raise _invalid(f"'messages[{i}].content' is required", f"messages[{i}].content")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                param = f"messages[{i}].content[{j}]"
                raise _invalid(f"'{param}' must be an object with a 'type'", param)
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                param = f"messages[{i}].content[{j}].text"
                raise _invalid(f"'{param}' must be a string", param)
    else:
        raise _invalid(f"'messages[{i}].content' must be a string or a list of parts",
                       f"messages[{i}].content")
    name = message.get("name")
    if not (name is None or isinstance(name, str)):
        raise _invalid(f"'messages[{i}].name' must be a string", f"messages[{i}].name")


def parse_chat(
    body: dict[str, Any], opts: NormalizeOptions, seen: TextScope | None = None,
    known: KnownHistory | NormalPrefix | None = None, keep_history: bool = False,
) -> ParsedRequest:
    """``POST /v1/chat/completions``: ``messages`` is a non-empty list of role/content objects.

    ``known``: the first ``len(known.normalized)`` messages are those an earlier request
    carried in the same bytes, as this parser left them then; only the rest are checked,
    normalized and rendered. ``keep_history``: a long chat's messages but its last are kept
    (``ParsedRequest.history``) for a later turn."""
    model, stream, max_tokens, salt = _common(body)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("missing required parameter 'messages'", param="messages",
                             code="missing_required_parameter")
    if not (isinstance(messages, list) and len(messages) > 0):
        raise _invalid("'messages' must be a non-empty list", "messages")
    if not isinstance(known, KnownHistory):  # a completions prompt's: not a chat's
        known = None
    done = len(known.normalized) if known is not None else 0
    if done >= len(messages):  # a known history is a strict prefix of the messages
        known, done = None, 0
    rest = messages[done:] if done else messages
    for i, message in enumerate(rest, done):
        _check_message(i, message)
    tools = body.get("tools")
    if not (tools is None or isinstance(tools, list)):
        raise _invalid("'tools' must be a list", "tools")
    fresh = normalize_messages(rest, opts, seen)
    unchanged = fresh == rest and (known is None or known.unchanged)
    normalized = [*known.normalized, *fresh] if known is not None else fresh
    if unchanged:
        forwarded = body
    else:
        forwarded = dict(body)
        forwarded["messages"] = normalized
    tools_text = render_tools(tools)
    earlier = ""
    if known is None:
        text = render_messages(fresh, tools_text)
        if keep_history and len(text) - len(tools_text) >= HISTORY_MIN_CHARS:
            earlier = text[len(tools_text):len(text) - len(render_messages(fresh[-1:]))]
    else:  # the history's text, then the whole text: a long text is copied twice, not thrice
        earlier = render_messages(fresh[:-1], known.text)
        text = "".join((tools_text, earlier, render_messages(fresh[-1:])))
    history = None
    if keep_history and len(earlier) >= HISTORY_MIN_CHARS:  # a long chat: its history is kept
        same = unchanged or ((known is None or known.unchanged) and fresh[:-1] == rest[:-1])
        encoded = None
        if not same:  # the worker gets the history as normalized: keep it encoded
            if known is not None and known.encoded is not None:
                encoded = (known.encoded + b"," + orjson.dumps(fresh[:-1])[1:-1]
                           if len(fresh) > 1 else known.encoded)
            else:
                encoded = orjson.dumps(normalized[:-1])[1:-1]
            forwarded = ClientJSON(forwarded, _encoded(forwarded, encoded, normalized[-1]))
        # Unchanged messages are kept as they were decoded, not as normalization's copies.
        history = KnownHistory(tuple((messages if same else normalized)[:-1]), earlier, same,
                               encoded)
    return ParsedRequest(model, forwarded, text, stream, max_tokens, salt, unchanged,
                         prompt_chars=len(text), sequences=_choices(body), history=history)


# A Responses request's chat is rendered as the worker will: from the body it is sent, whose
# texts are normalized already (items that are not messages as they came).
_AS_SENT = NormalizeOptions(enabled=False)


def parse_responses(
    body: dict[str, Any], opts: NormalizeOptions, seen: TextScope | None = None,
    known: KnownHistory | NormalPrefix | None = None, keep_history: bool = False,
) -> ParsedRequest:
    """``POST /v1/responses``: routed as the chat it amounts to (:mod:`gateway.contracts.
    responses`); the body forwarded with its texts normalized (the client's bytes where that
    changes nothing), so that the worker runs the chat the fingerprint saw.

    ``known``: the chat's leading messages (the instructions', then one per input item) as an
    earlier request that carried the same bytes left them, when normalization changed none of
    its items (:class:`gateway.chat_histories.ChatHistories` over ``input``); only the items
    after them are converted, checked, normalized and rendered. ``keep_history``: a long
    chat's history is kept (``ParsedRequest.history``) when normalization changed no item (it
    may change the instructions: a system prompt that ends in a newline)."""
    if isinstance(known, KnownHistory):
        found = _continued_responses(body, opts, seen, known, keep_history)
        if found is not None:
            return found
    normalized = _normalized_responses(body, opts, seen)
    try:
        chat = as_chat_body(normalized)
        previous_response(body)
    except ChatFormatError as exc:
        raise _invalid(str(exc), exc.param) from None
    # A history is kept only of items sent as normal: a later body is forwarded as it came
    # (but for its instructions, when normalization changes them: a field of their own).
    items_as_sent = normalized.get("input") is body.get("input")
    parsed = parse_chat(chat, _AS_SENT, seen, None, keep_history and items_as_sent)
    return ParsedRequest(parsed.model, normalized, parsed.fingerprint_text, parsed.stream,
                         parsed.max_tokens, parsed.cache_salt, unchanged=normalized is body,
                         prompt_chars=parsed.prompt_chars, sequences=parsed.sequences,
                         history=_led(parsed.history, int(body.get("instructions") is not None)))


def _continued_responses(
    body: dict[str, Any], opts: NormalizeOptions, seen: TextScope | None,
    known: KnownHistory, keep_history: bool,
) -> ParsedRequest | None:
    """:func:`parse_responses` of a body whose leading chat messages are ``known``, when
    normalization changes none of its items (None otherwise, or for anything to report: the
    whole body is parsed again, which reports it)."""
    instructions = body.get("instructions")
    lead = 0 if instructions is None else 1
    items = body.get("input")
    if not (known.unchanged and known.lead == lead and isinstance(items, list)
            and lead <= len(known.normalized) < len(items) + lead):
        return None
    normal = instructions
    if lead:
        if not isinstance(instructions, str):
            return None
        normal = normalize_text(instructions, opts, seen)
        # The instructions may follow the input in the body, where the bytes that found the
        # history do not cover them: they must be those it was parsed with.
        if known.normalized[0] != {"role": "system", "content": normal}:
            return None
    rest = items[len(known.normalized) - lead:]
    if _normalized_responses({"input": rest}, opts, seen)["input"] is not rest:
        return None
    try:
        chat = as_chat_body({**body, "input": rest, "instructions": None})
        previous_response(body)
    except ChatFormatError:
        return None
    chat["messages"] = [*known.normalized, *chat["messages"]]
    parsed = parse_chat(chat, _AS_SENT, seen, known, keep_history)
    if not parsed.unchanged:
        return None
    forwarded = body if normal == instructions else {**body, "instructions": normal}
    return ParsedRequest(parsed.model, forwarded, parsed.fingerprint_text, parsed.stream,
                         parsed.max_tokens, parsed.cache_salt, unchanged=forwarded is body,
                         prompt_chars=parsed.prompt_chars, sequences=parsed.sequences,
                         history=_led(parsed.history, lead))


def _led(history: KnownHistory | None, lead: int) -> KnownHistory | None:
    return dataclasses.replace(history, lead=lead) if history is not None and lead else history


def _normalized_responses(body: dict[str, Any], opts: NormalizeOptions,
                          seen: TextScope | None) -> dict[str, Any]:
    """A Responses body with its texts normalized as a chat's are (the instructions, a string
    input, the contents of message items; the worker gets this body, so what it caches is
    what the fingerprint saw), or ``body`` itself when that changes nothing."""
    changed: dict[str, Any] = {}
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        text = normalize_text(instructions, opts, seen)
        if text != instructions:
            changed["instructions"] = text
    items = body.get("input")
    if isinstance(items, str):
        text = normalize_text(items, opts, seen)
        if text != items:
            changed["input"] = text
    elif isinstance(items, list):
        fresh = [{**item, "content": normalize_content(item["content"], opts, seen)}
                 if isinstance(item, dict) and item.get("type", "message") == "message"
                 and "content" in item else item for item in items]
        if fresh != items:
            changed["input"] = fresh
    return {**body, **changed} if changed else body
