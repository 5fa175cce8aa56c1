"""The worker's hottest prompts and how the gateway keys what a peer exports."""

from __future__ import annotations

from gateway.contracts.engine_paths import CHAT_PATH
from gateway.fingerprint import FingerprintOptions, Namespace, fingerprint
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import parse_chat
from gateway.warmup_sources import Namespaces, peer_prompt
from worker.hotprompts import HotPrompts


def chat(system: str, question: str) -> dict[str, object]:
    return {"model": "m", "max_tokens": 50, "stream": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}


def observe(hot: HotPrompts, system: int, question: str, now: float, ns: str = "ns-a") -> None:
    tokens = [system] * 80 + [hash(question) % 1000] * 5  # the system prompt leads
    hot.observe(CHAT_PATH, chat(f"system {system}", question), ns, ns, tokens, 100, now)


def test_one_entry_per_shared_prefix_most_used_first_without_generation_settings() -> None:
    hot = HotPrompts(8, prefix_tokens=64)
    for i in range(5):
        observe(hot, 1, f"q{i}", now=0.0)
    observe(hot, 2, "other", now=0.0)
    observe(hot, 1, "q0", now=0.0, ns="ns-b")  # another tenant: another prefix
    top = hot.hottest(10, now=0.0)
    assert len(top) == 3
    assert top[0]["uses"] == 5.0
    assert top[0]["namespace"] == "ns-a"
    assert top[0]["body"]["messages"][1]["content"] == "q4"  # the latest one
    assert "max_tokens" not in top[0]["body"]
    assert "stream" not in top[0]["body"]
    assert len(hot.hottest(1, now=0.0)) == 1


def test_bounded_uses_decay_and_off() -> None:
    hot = HotPrompts(2, half_life_s=10.0)
    for _ in range(4):
        observe(hot, 1, "q", now=0.0)
    observe(hot, 2, "q", now=0.0)
    observe(hot, 3, "q", now=0.0)  # full: a first sighting does not push out a used prefix
    assert len(hot) == 2
    assert hot.hottest(1, now=10.0)[0]["uses"] == 2.0
    off = HotPrompts(0)
    observe(off, 1, "q", now=0.0)
    assert len(off) == 0
    # A prompt shorter than one cache block leaves nothing to warm: not kept.
    short = HotPrompts(2, min_tokens=16)
    short.observe(CHAT_PATH, chat("s", "q"), "ns-a", "ns-a", [1] * 15, 10, 0.0)
    assert len(short) == 0
    short.observe(CHAT_PATH, chat("s", "q"), "ns-a", "ns-a", [1] * 16, 10, 0.0)
    assert len(short) == 1


def test_peer_prompt_is_keyed_like_the_request_it_came_from_or_dropped() -> None:
    namespaces = Namespaces(capacity=2)
    body = chat("You are a careful assistant. " * 10, "hello")
    entry = {"path": CHAT_PATH, "body": body, "namespace": "ns-a", "uses": 3.0}
    norm, fp = NormalizeOptions(), FingerprintOptions()
    assert peer_prompt(entry, namespaces, normalize=norm, fingerprint_options=fp) is None
    namespaces.seen("ns-a", "tenant-a")
    prompt = peer_prompt(entry, namespaces, normalize=norm, fingerprint_options=fp)
    assert prompt is not None
    parsed = parse_chat(body, norm)
    assert prompt.key == fingerprint(parsed.fingerprint_text,
                                     Namespace(tenant="tenant-a", model="m"), fp)
    assert prompt.namespace == "ns-a"
    assert prompt.uses == 3.0
    bad = {**entry, "path": "/admin/flush"}
    assert peer_prompt(bad, namespaces, normalize=norm, fingerprint_options=fp) is None
    namespaces.seen("ns-b", "b")
    namespaces.seen("ns-c", "c")  # bounded: the oldest goes
    assert namespaces.tenant_of("ns-a") is None
