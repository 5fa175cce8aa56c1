"""Long Responses API requests decoded and parsed from their new input items on
(gateway.chat_histories over ``input``, gateway.openai_schema.parse_responses with what it
found): the body, the parse and what the worker gets are those of the whole body, turn after
turn of an agent's loop; its instructions may follow the input (checked against the
history's) and be normalized; a body whose items normalization changes is parsed whole."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway import openai_schema
from gateway.chat_histories import RESPONSES_BEFORE_INPUT, ChatHistories, Known
from gateway.contracts.responses import as_chat_body
from gateway.errors import InvalidRequest
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import ParsedRequest, decode_json_object, encode_body, parse_responses

OPTS = NormalizeOptions()
INSTRUCTIONS = "You are a coding agent. Read the files you need, then answer."


def items(count: int, chars: int = 300) -> list[dict[str, Any]]:
    """An agent's loop as Responses input items: a question, then function calls and their
    outputs in turn."""
    out: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for i in range(count):
        if i % 2 == 0:
            out.append({"type": "function_call", "call_id": f"call_{i}", "name": "read",
                        "arguments": json.dumps({"path": f"f{i}.py"})})
        else:
            line = f"line {i} of the file, with words enough to fill it; "
            out.append({"type": "function_call_output", "call_id": f"call_{i - 1}",
                        "output": (line * (chars // len(line) + 1))[:chars]})
    return out


LOOP = items(400)


@pytest.fixture
def converted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many input items each parse converted to chat messages (a joined turn: only those
    after its known history)."""
    sizes: list[int] = []
    real = as_chat_body

    def spy(body: Any) -> dict[str, Any]:
        items = body.get("input")
        sizes.append(len(items) if isinstance(items, list) else 1)
        return real(body)

    monkeypatch.setattr(openai_schema, "as_chat_body", spy)
    return sizes


class Gateway:
    """What the gateway's Responses route does with a body (gateway.api)."""

    def __init__(self) -> None:
        self.histories = ChatHistories(min_bytes=1024, key="input",
                                       before=RESPONSES_BEFORE_INPUT)
        self.seed = self.histories.seed("t", OPTS)

    def send(self, raw: bytes) -> tuple[ParsedRequest, Known | None]:
        body, found = self.histories.decode(raw, self.seed)
        parsed = parse_responses(body, OPTS, None,
                                 found.history if found is not None else None, True)
        if parsed.history is not None:
            self.histories.remember(raw, self.seed, body, parsed.history, found)
        return parsed, found


def check_same(gateway: Gateway, raw: bytes) -> Known | None:
    whole = parse_responses(decode_json_object(raw), OPTS)
    parsed, found = gateway.send(raw)
    assert parsed.fingerprint_text == whole.fingerprint_text
    assert parsed.body == whole.body
    assert encode_body(parsed.body) == orjson.dumps(dict(whole.body))
    assert (parsed.unchanged, parsed.prompt_chars, parsed.model, parsed.max_tokens) == (
        whole.unchanged, whole.prompt_chars, whole.model, whole.max_tokens)
    return found


def body(count: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "instructions": INSTRUCTIONS, "input": LOOP[:count],
            "max_output_tokens": 4, **extra}


@pytest.mark.parametrize("instructions", ["before input", "none"])
def test_each_turn_is_parsed_from_its_new_items_on(instructions: str) -> None:
    gateway = Gateway()
    found_at = []
    for count in range(200, 260, 2):  # each turn a call and its output more
        sent = body(count)
        if instructions == "none":
            del sent["instructions"]
        found = check_same(gateway, orjson.dumps(sent))
        found_at.append(found is not None)
    assert found_at[0] is False
    assert all(found_at[1:])  # every later turn joined to the last
    assert gateway.histories.hits == len(found_at) - 1


def test_instructions_after_the_input_are_checked_against_the_history(
        converted: list[int]) -> None:
    """As the openai SDK sends them (its keys in its own order, ``input`` first): joined while
    they stay the same; a turn with other instructions, or none, is parsed whole."""
    gateway = Gateway()
    found_at = []
    for count, instructions in ((200, INSTRUCTIONS), (202, INSTRUCTIONS),
                                (204, "Other instructions."), (206, None),
                                (208, INSTRUCTIONS), (210, INSTRUCTIONS)):
        sent: dict[str, Any] = {"model": "m", "input": LOOP[:count]}
        if instructions is not None:
            sent["instructions"] = instructions
        found_at.append(check_same(gateway, orjson.dumps(sent)) is not None)
    # Every turn after the first finds the last one's bytes; the parse uses its history only
    # where the instructions are those it was parsed with (202, 210), and check_same shows
    # that each parse is the whole body's: 204, 206 and 208 with the instructions they carry.
    assert found_at == [False, True, True, True, True, True]
    # Each turn parsed once whole (check_same) and once through the gateway: the gateway
    # converted 3 items (the last turn's last and 2 new) where it used the history.
    through_gateway = converted[1::2]
    assert through_gateway == [200, 3, 204, 206, 208, 3]


@pytest.mark.parametrize("where", ["before input", "after input"])
def test_instructions_normalization_changes_still_join_and_reach_the_worker_normal(
        where: str, converted: list[int]) -> None:
    """A system prompt that ends in a newline (the rules trim it): the history is kept and
    joined all the same, and each turn forwards the instructions normalized."""
    gateway = Gateway()
    found_at = []
    for count in range(200, 208, 2):
        sent: dict[str, Any] = {"model": "m", "input": LOOP[:count]}
        if where == "before input":
            sent = {"instructions": INSTRUCTIONS + "\n\n", **sent}
        else:
            sent["instructions"] = INSTRUCTIONS + "\n\n"
        found_at.append(check_same(gateway, orjson.dumps(sent)) is not None)
        parsed, _ = gateway.send(orjson.dumps(sent))
        assert parsed.body["instructions"] == INSTRUCTIONS
        assert parsed.unchanged is False
    assert found_at == [False, True, True, True]
    # Per turn: the whole-body parse, then the gateway's twice (the same body sent again
    # joins its own first sending: 1 item), after the first turn from the history on.
    assert converted[1::3] == [200, 3, 3, 3]


def test_a_history_normalization_changed_is_not_kept_and_the_worker_gets_it_normal() -> None:
    gateway = Gateway()
    loop = [dict(item) for item in LOOP[:240]]
    loop[0] = {"role": "user", "content": "Fix the\u00a0failing test.  "}  # not normal
    for count in range(200, 210, 2):
        raw = orjson.dumps({"model": "m", "instructions": INSTRUCTIONS,
                            "input": loop[:count]})
        assert check_same(gateway, raw) is None
        parsed, _ = gateway.send(raw)
        assert parsed.body["input"][0]["content"] == "Fix the failing test."
    assert len(gateway.histories) == 0


def test_a_normal_history_with_an_abnormal_new_item_is_parsed_whole() -> None:
    gateway = Gateway()
    check_same(gateway, orjson.dumps(body(200)))
    sent = body(202)
    sent["input"] = [*sent["input"][:-1], {"role": "user", "content": "why\u200b?"}]
    check_same(gateway, orjson.dumps(sent))  # the same parse as the whole body's
    parsed, _ = gateway.send(orjson.dumps(sent))
    assert parsed.body["input"][-1]["content"] == "why?"


def test_bad_new_items_get_the_errors_of_the_whole_body() -> None:
    gateway = Gateway()
    check_same(gateway, orjson.dumps(body(200)))
    sent = body(202)
    sent["input"] = [*sent["input"], {"role": "wizard", "content": "hi"}]
    with pytest.raises(InvalidRequest) as raised:
        gateway.send(orjson.dumps(sent))
    assert raised.value.param == "input[202].role"
