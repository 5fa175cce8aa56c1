"""Event-stream framing against botocore's own decoder; line re-splitting; SageMaker pure parts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import botocore.session
import pytest
from botocore.eventstream import EventStream, EventStreamBuffer, ParserError
from botocore.exceptions import EventStreamError
from botocore.parsers import EventStreamJSONParser

from gateway.backends.eventstream import (
    LineBuffer,
    encode_message,
    payload_part,
    stream_exception,
)
from gateway.backends.registry import kind_of_url
from gateway.backends.sagemaker import SessionTable
from gateway.backends.sagemaker_body import OpenAIStream, TGIStream, tgi_reply, tgi_request
from gateway.backends.sagemaker_target import SageMakerTarget, parse_target
from gateway.pool import worker_id_for


def _decode(wire: bytes, cut: int | None = None) -> list[Any]:
    buffer = EventStreamBuffer()
    out = []
    pieces = [wire] if cut is None else [wire[:cut], wire[cut:]]
    for piece in pieces:
        buffer.add_data(piece)
        out.extend(buffer)
    return out


def test_encoded_message_decodes_with_botocore_at_every_cut() -> None:
    wire = encode_message({":message-type": "event", "x": "ü"}, b"payload \xe2\x82\xac")
    for cut in range(len(wire) + 1):
        (message,) = _decode(wire, cut)
        assert message.headers == {":message-type": "event", "x": "ü"}
        assert message.payload == b"payload \xe2\x82\xac"


@pytest.mark.parametrize("offset", [0, 5, 9, 13, -2], ids=["length", "hdr-len", "prelude-crc",
                                                          "header", "message-crc"])
def test_corrupted_frames_are_rejected_by_the_crc(offset: int) -> None:
    wire = bytearray(payload_part(b"hello"))
    wire[offset] ^= 0x01
    with pytest.raises(ParserError):
        _decode(bytes(wire))


class _Raw:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    def stream(self) -> Iterator[bytes]:
        yield from self._chunks

    def close(self) -> None:
        return None


def _sagemaker_stream(wire: bytes, chunk: int) -> EventStream:
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    op = model.operation_model("InvokeEndpointWithResponseStream")
    shape = op.output_shape.members["Body"]
    chunks = [wire[i:i + chunk] for i in range(0, len(wire), chunk)]
    return EventStream(_Raw(chunks), shape, EventStreamJSONParser(), op.name)


def test_sagemaker_service_model_parses_payload_parts_and_stream_errors() -> None:
    wire = payload_part(b"data: {\"a\"") + payload_part(b": 1}\n\n") + stream_exception(
        "ModelStreamError", "model stopped", "ModelInvocationTimeExceeded")
    events: list[Any] = []
    with pytest.raises(EventStreamError) as info:
        events.extend(_sagemaker_stream(wire, 3))
    assert b"".join(e["PayloadPart"]["Bytes"] for e in events) == b"data: {\"a\": 1}\n\n"
    assert info.value.response["Error"]["Code"] == "ModelStreamError"
    assert info.value.response["Error"]["Message"] == "model stopped"


def test_internal_stream_failure_is_an_event_stream_error() -> None:
    with pytest.raises(EventStreamError) as info:
        list(_sagemaker_stream(stream_exception("InternalStreamFailure", "boom"), 1000))
    assert info.value.response["Error"]["Code"] == "InternalStreamFailure"


def test_line_buffer_reassembles_lines_cut_anywhere_even_inside_utf8() -> None:
    text = "data: héllo €\r\n\ndata: [DONE]\n\nno newline at end"
    raw = text.encode()
    for size in (1, 2, 3, 7, len(raw)):
        buffer = LineBuffer()
        lines: list[str] = []
        for i in range(0, len(raw), size):
            lines.extend(buffer.feed(raw[i:i + size]))
        lines.extend(buffer.flush())
        assert lines == ["data: héllo €", "", "data: [DONE]", "", "no newline at end"]


def test_line_buffer_bounds_a_line_without_newline() -> None:
    buffer = LineBuffer(max_line=10)
    with pytest.raises(ValueError, match="exceeded"):
        list(buffer.feed(b"x" * 11))


def test_openai_stream_reframes_sse_and_json_lines_and_closes_with_done() -> None:
    stream = OpenAIStream()
    out = stream.lines(['data:{"a":1}', "", ": keep-alive", '{"b":2}', "event: x"])
    out += stream.finish()
    assert out == b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    done = OpenAIStream()
    assert done.lines(["data: [DONE]"]) == b"data: [DONE]\n\n"
    assert done.finish() == b""


def _events(raw: bytes) -> list[Any]:
    return [json.loads(e[6:]) if e[6:] != "[DONE]" else "[DONE]"
            for e in raw.decode().split("\n\n") if e]


def test_tgi_stream_becomes_openai_chat_chunks_with_usage() -> None:
    stream = TGIStream("/v1/chat/completions", {"model": "m", "stream_options":
                                                {"include_usage": True}})
    lines = [
        'data:{"token": {"id": 1, "text": "Hel", "special": false}}',
        'data:{"token": {"id": 2, "text": "</s>", "special": true}}',
        '{"token": {"id": 3, "text": "lo", "special": false}, "generated_text": "Hello", '
        '"details": {"finish_reason": "eos_token", "generated_tokens": 2}}',
    ]
    events = _events(stream.lines(lines) + stream.finish())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert events[1]["choices"][0]["delta"] == {"content": "lo"}
    assert events[2]["choices"][0]["finish_reason"] == "stop"
    assert events[3]["usage"] == {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}
    assert events[4] == "[DONE]"
    assert {e["object"] for e in events[:4]} == {"chat.completion.chunk"}


def test_tgi_stream_error_line_becomes_an_error_event() -> None:
    stream = TGIStream("/v1/completions", {"model": "m"})
    events = _events(stream.lines(['data:{"error": "CUDA OOM", "error_type": "generation"}']))
    assert events[0]["error"]["code"] == "generation"
    assert "CUDA OOM" in events[0]["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "inputs", "params"),
    [
        pytest.param("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "temperature": 0},
                     "Hi", {"max_new_tokens": 5, "do_sample": False}, id="greedy"),
        pytest.param("/v1/completions", {"prompt": ["Hi"], "temperature": 0.7, "top_p": 0.9,
                                         "stop": "\n", "seed": 3},
                     "Hi", {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"],
                            "seed": 3}, id="sampling"),
        pytest.param("/v1/chat/completions", {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
                     "system: Be brief.\nuser: Hello\nassistant:", {}, id="chat"),
    ],
)
def test_tgi_request_mapping(path: str, body: dict[str, Any], inputs: str,
                             params: dict[str, Any]) -> None:
    request = tgi_request(path, body)
    assert request["inputs"] == inputs
    assert request["parameters"] == {"details": True, "return_full_text": False, **params}


def test_tgi_reply_becomes_an_openai_completion() -> None:
    raw = json.dumps([{"generated_text": " world", "details": {
        "finish_reason": "length", "generated_tokens": 3, "prefill": [{}, {}]}}]).encode()
    chat = json.loads(tgi_reply("/v1/chat/completions", {"model": "m"}, raw))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": " world"}
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    text = json.loads(tgi_reply("/v1/completions", {"model": "m"},
                                b'{"generated_text": "x"}'))
    assert text["choices"][0]["text"] == "x"
    assert "usage" not in text


def test_session_table_expires_bounds_and_closes() -> None:
    now = [1_000_000.0]
    table = SessionTable(capacity=2, clock=lambda: now[0], margin_s=5)
    table.opened(("t", "a"), "s1; Expires=1970-01-12T13:50:00Z")  # 1_000_200 s
    assert table.get(("t", "a")) == "s1"
    now[0] = 1_000_196.0
    assert table.get(("t", "a")) is None  # within the safety margin of its expiry
    table.opened(("t", "a"), "s1")
    table.opened(("t", "b"), "s2")
    table.opened(("t", "c"), "s3")
    assert len(table) == 2
    assert table.get(("t", "a")) is None  # least recently used went first
    table.closed("t", "s2")
    assert table.get(("t", "b")) is None
    assert table.get(("t", "c")) == "s3"
    assert [table.seen(("t", "x")) for _ in range(3)] == [1, 2, 3]


@pytest.mark.parametrize(
    ("url", "expected", "wid"),
    [
        pytest.param("sagemaker://ep?variant=A&region=us-east-1", SageMakerTarget(
            "ep", variant="A", region="us-east-1"), "sm:us-east-1/ep/A", id="variant"),
        pytest.param("sagemaker://ep?component=ic-1&body=tgi&model=a,b&session=auto"
                     "&session_after=3&prefix_aware=off&probe=none"
                     "&endpoint_url=http://127.0.0.1:9",
                     SageMakerTarget("ep", component="ic-1", body="tgi", models=("a", "b"),
                                     sessions=True, session_after=3, prefix_aware=False,
                                     probe=False, endpoint_url="http://127.0.0.1:9"),
                     "sm:ep/ic/ic-1", id="component"),
    ],
)
def test_target_urls_parse_and_round_trip(url: str, expected: SageMakerTarget, wid: str) -> None:
    target = parse_target(url)
    assert target == expected
    assert target.id == wid == worker_id_for(url)
    assert kind_of_url(url).name == "sagemaker"
    assert parse_target(target.url()) == target


@pytest.mark.parametrize(
    ("url", "message"),
    [
        pytest.param("sagemaker://?variant=A", "looks like", id="no-endpoint"),
        pytest.param("sagemaker://ep?variant=A&component=B", "not both", id="both"),
        pytest.param("sagemaker://ep?body=xml", "body must be", id="body"),
        pytest.param("sagemaker://ep?varaint=A", "unknown parameter", id="typo"),
        pytest.param("sagemaker://ep?session=on", "session must be", id="session"),
        pytest.param("sagemaker://ep?endpoint_url=ftp://x", "http", id="endpoint-url"),
    ],
)
def test_bad_target_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(url)


def test_advertised_models_default_to_the_component_or_endpoint() -> None:
    assert parse_target("sagemaker://ep?variant=A").advertised_models() == {"ep"}
    assert parse_target("sagemaker://ep?component=ic").advertised_models() == {"ic"}
    assert kind_of_url("http://127.0.0.1:8001").name == "openai"
