"""Live workloads and trace text: deterministic by seed, and shaped so prefixes are shared."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from loadtest.textgen import DEFAULT_BLOCK_CHARS, TextSynth, block_text, trace_request
from loadtest.traces import read_mooncake
from loadtest.workloads import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    LiveSpec,
    WorkloadSpec,
    chat_requests,
    system_prompt,
    tenant_key,
    user_requests,
)
from worker.tokenizer import HashTokenizer

SYNTHETIC = ("chat", "tenants", "rag", "fewshot")
SPEC = LiveSpec(seed=7, tenants=4, documents=6, templates=3, shots=2, max_turns=4)


def take(workload: str, user: int, n: int, spec: LiveSpec = SPEC) -> list[dict[str, object]]:
    return [r.body for r in itertools.islice(user_requests(workload, spec, user), n)]


@pytest.mark.parametrize("workload", SYNTHETIC)
def test_same_seed_and_user_give_the_same_requests(workload: str) -> None:
    assert take(workload, 3, 12) == take(workload, 3, 12)


@pytest.mark.parametrize("workload", SYNTHETIC)
def test_other_users_and_seeds_give_other_requests(workload: str) -> None:
    assert take(workload, 3, 12) != take(workload, 4, 12)
    other = LiveSpec(seed=8, tenants=4, documents=6, templates=3, shots=2, max_turns=4)
    assert take(workload, 3, 12) != take(workload, 3, 12, other)


@pytest.mark.parametrize("workload", SYNTHETIC)
def test_requests_are_streaming_chat_bodies(workload: str) -> None:
    for req in itertools.islice(user_requests(workload, SPEC, 0), 8):
        assert req.path == CHAT_PATH
        assert req.label == workload
        body = req.body
        assert body["model"] == SPEC.model
        assert body["max_tokens"] == SPEC.max_tokens
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        messages = body["messages"]
        assert isinstance(messages, list)
        assert messages[-1]["role"] == "user"
        assert all(m["content"] for m in messages)
    unstreamed = LiveSpec(stream=False)
    body = next(user_requests(workload, unstreamed, 0)).body
    assert "stream" not in body
    assert "stream_options" not in body


def test_chat_conversations_grow_then_restart() -> None:
    reqs = list(itertools.islice(user_requests("chat", SPEC, 5), 40))
    system = system_prompt(SPEC.seed, 5 % SPEC.tenants, SPEC.system_chars)
    restarts = 0
    for prev, cur in itertools.pairwise(reqs):
        before, after = prev.body["messages"], cur.body["messages"]
        assert after[0] == {"role": "system", "content": system}
        assert cur.api_key == tenant_key(5 % SPEC.tenants)
        if len(after) == 2:  # a new conversation: system + first question
            restarts += 1
            continue
        # a follow-up repeats the whole conversation, then one answer and one question
        assert after[: len(before)] == before
        assert [m["role"] for m in after[len(before):]] == ["assistant", "user"]
        assert (len(after) - 1) // 2 <= SPEC.max_turns
    assert restarts >= 3  # 40 requests of at most 4 turns each


def test_tenants_use_their_own_system_prompt_and_key() -> None:
    reqs = list(itertools.islice(user_requests("tenants", SPEC, 0), 60))
    seen = set()
    for req in reqs:
        tenant = int(req.api_key.rsplit("-", 1)[1])
        seen.add(tenant)
        assert req.body["messages"][0]["content"] == system_prompt(
            SPEC.seed, tenant, SPEC.system_chars)
        assert len(req.body["messages"]) == 2
    assert len(seen) >= 3  # a Zipf mix over 4 tenants, not one


def test_rag_puts_a_shared_document_before_the_question() -> None:
    docs = []
    for user in range(4):
        for req in itertools.islice(user_requests("rag", SPEC, user), 10):
            content = req.body["messages"][1]["content"]
            head, _, question = content.partition("\n\nQuestion: ")
            assert head.startswith("Document ")
            assert question.endswith("?")
            docs.append(head)
    assert len(set(docs)) < len(docs)  # popular documents recur across users: shared prefixes
    assert len(set(docs)) > 1


def test_fewshot_requests_share_their_template_prefix() -> None:
    by_template: dict[str, list[list[dict[str, str]]]] = {}
    for req in itertools.islice(user_requests("fewshot", SPEC, 2), 20):
        messages = req.body["messages"]
        assert len(messages) == 1 + 2 * SPEC.shots + 1
        by_template.setdefault(messages[0]["content"], []).append(messages)
    assert 1 < len(by_template) <= SPEC.templates
    for group in by_template.values():
        assert all(m[:-1] == group[0][:-1] for m in group)


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown live workload"):
        next(user_requests("mooncake", SPEC, 0))
    with pytest.raises(ValueError, match="max_turns"):
        LiveSpec(max_turns=1)


def test_the_existing_chat_workload_is_unchanged_and_deterministic() -> None:
    spec = WorkloadSpec(seed=11)
    first = list(chat_requests(spec, 30))
    assert first == list(chat_requests(spec, 30))
    assert all(b["messages"][0]["role"] == "system" for b in first)


# -- trace text ----------------------------------------------------------------------------------


def test_same_ids_give_the_same_text_and_different_ids_differ() -> None:
    a, b = TextSynth(chars=256, seed=1), TextSynth(chars=256, seed=1)
    assert a.block(42) == b.block(42) == block_text(42, 256, 1)
    texts = {a.block(i) for i in range(300)}
    assert len(texts) == 300
    assert block_text(42, 256, 1) != block_text(42, 256, 2)  # the seed matters too
    assert len(block_text(7)) == DEFAULT_BLOCK_CHARS
    for i in (0, 1, 2**62 + 5):
        text = a.block(i)
        assert len(text) == 256
        assert text[0] == " "
        assert not text[-1].isspace()
    with pytest.raises(ValueError, match="chars"):
        TextSynth(chars=8)


@pytest.mark.parametrize("lines", [False, True])
def test_shared_ids_are_shared_text_and_token_prefixes(lines: bool) -> None:
    synth = TextSynth(chars=128, seed=3, lines=lines)
    tokenizer = HashTokenizer()
    first, second = [1, 2, 3, 4], [1, 2, 3, 9, 10]
    p1, p2 = synth.prompt(first), synth.prompt(second)
    shared = synth.prompt(first[:3])
    assert p1.startswith(shared)
    assert p2.startswith(shared)
    assert p1[len(shared):] != p2[len(shared):len(p1)]
    # chunks cut where the worker's tokenizer cuts too: the shared part has the same tokens
    ids_shared = tokenizer.encode(shared)
    assert tokenizer.encode(p1)[: len(ids_shared)] == ids_shared
    assert tokenizer.encode(p2)[: len(ids_shared)] == ids_shared
    assert tokenizer.encode(p1) == ids_shared + tokenizer.encode(synth.block(4))


def test_trace_requests_replay_as_completions_with_shared_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 5, "input_length": 2000, "output_length": 2, "hash_ids": [0, 1, 7, 8]}\n',
        encoding="utf-8",
    )
    first, second = read_mooncake(path)
    synth = TextSynth(chars=64)
    spec = LiveSpec(max_tokens=8)
    r1, r2 = trace_request(first, synth, spec), trace_request(second, synth, spec)
    assert r1.path == r2.path == COMPLETIONS_PATH
    assert r1.label == "mooncake"
    assert r1.body["max_tokens"] == 8
    assert r2.body["max_tokens"] == 2
    assert r1.body["stream"] is True
    p1, p2 = r1.body["prompt"], r2.body["prompt"]
    assert len(p1) == 3 * 64
    assert len(p2) == 4 * 64
    assert p1[:128] == p2[:128]
    assert p1[128:] != p2[128:192]
    assert trace_request(second, synth, spec, max_blocks=2).body["prompt"] == p2[:128]
    assert trace_request(first, synth, spec) == r1  # deterministic


def test_a_request_for_the_responses_api() -> None:
    from loadtest.workloads import LiveRequest, as_responses

    chat = LiveRequest("/v1/chat/completions", {
        "model": "m", "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u1",
        "messages": [{"role": "system", "content": "rules"},
                     {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "more"}]}, "sk-1", "chat")
    asked = as_responses(chat)
    assert asked.path == "/v1/responses"
    assert asked.api_key == "sk-1"
    assert asked.label == "chat (responses)"
    assert asked.body == {
        "model": "m", "temperature": 0, "instructions": "rules", "max_output_tokens": 8,
        "stream": True, "input": [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "hello"},
                                  {"role": "user", "content": "more"}]}
    plain = as_responses(LiveRequest("/v1/completions", {"model": "m", "prompt": "p",
                                                         "max_tokens": 2}))
    assert plain.body == {"model": "m", "temperature": 0, "input": "p", "max_output_tokens": 2}
    assert plain.label == "responses"


def test_a_stored_conversations_next_turn_sends_only_its_new_items() -> None:
    from loadtest.samples import StreamScan
    from loadtest.workloads import stored_turn

    first: dict[str, Any] = {"model": "m", "instructions": "rules",
                             "input": [{"role": "user", "content": "hi"}]}
    assert stored_turn(first, None) is first  # a conversation begins: whole
    second: dict[str, Any] = {"model": "m", "instructions": "rules",
                              "input": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "stand-in answer"},
                                        {"role": "user", "content": "more"}]}
    assert stored_turn(second, (first["input"], "resp_1")) == {
        "model": "m", "instructions": "rules", "previous_response_id": "resp_1",
        "input": [{"role": "user", "content": "more"}]}
    other: dict[str, Any] = {"model": "m", "input": [{"role": "user", "content": "another chat"}]}
    assert stored_turn(other, (first["input"], "resp_1")) is other  # not a next turn
    assert stored_turn({"model": "m", "input": "text"}, (first["input"], "resp_1"))["input"] == (
        "text")
    # The answer's id, from a stream's created event or from a whole answer.
    scan = StreamScan()
    scan.feed('event: response.created\ndata: {"type": "response.created", '
              '"response": {"id": "resp_2", "object": "response"}}\n\n')
    assert scan.response_id == "resp_2"
    whole = StreamScan()
    whole.feed('{"id": "resp_3", "object": "response", "output": []}')
    whole.close()
    assert whole.response_id == "resp_3"


def test_an_agents_tool_calls_become_function_call_items() -> None:
    from loadtest.workloads import LiveRequest, as_responses

    chat = LiveRequest("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": "agent"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]})
    assert as_responses(chat).body["input"] == [
        {"type": "function_call", "call_id": "c1", "name": "read",
         "arguments": '{"path": "a.py"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "print(1)"}]
