"""Deterministic synthetic shared-prefix chat workloads (pure functions: no I/O, no clock).

The shape mimics a multi-tenant chat service:

* ``tenants`` groups, each with one long system prompt (``system_chars`` characters of seeded
  words), shared by every user of that group;
* ``users_per_tenant`` users per group; a request picks a tenant (mildly skewed popularity,
  ``tenant_skew``) and then one of its users;
* most requests are a fresh question: ``[system prompt, user question]``;
* a share of them (``conversation_share``) continue the user's open conversation instead: the
  previous turns (questions and synthetic assistant answers) are repeated and a new question is
  appended, so the prompt grows and its earlier part is a prefix the cache may already hold.

Everything derives from ``WorkloadSpec.seed``: the same spec yields the same bodies, in the same
order, on every machine. The bodies are plain OpenAI chat-completions request dicts, usable by
any client (aiohttp, the ``openai`` SDK, locust).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# A fixed vocabulary; the seed decides which words appear where.
VOCABULARY = (
    "account", "address", "agent", "answer", "archive", "balance", "billing", "branch", "budget",
    "cache", "calendar", "case", "catalog", "channel", "claim", "client", "cluster", "code",
    "compliance", "contract", "customer", "dashboard", "data", "deadline", "delivery", "deposit",
    "device", "document", "draft", "email", "error", "estimate", "event", "export", "feature",
    "file", "filter", "forecast", "form", "group", "guide", "history", "import", "incident",
    "invoice", "issue", "item", "journal", "key", "ledger", "license", "limit", "log", "manager",
    "message", "meeting", "metric", "model", "module", "network", "note", "notice", "order",
    "owner", "package", "page", "partner", "payment", "permission", "plan", "policy", "portal",
    "price", "priority", "product", "profile", "project", "query", "queue", "quote", "rate",
    "record", "refund", "region", "release", "report", "request", "resource", "review", "risk",
    "role", "rule", "schedule", "schema", "score", "service", "session", "setting", "shipment",
    "status", "storage", "supplier", "support", "survey", "task", "team", "template", "ticket",
    "timeline", "token", "transfer", "update", "upload", "user", "vendor", "version", "warranty",
    "always", "carefully", "clearly", "never", "only", "politely", "promptly", "briefly",
    "check", "confirm", "explain", "follow", "handle", "include", "list", "mention", "verify",
    "the", "a", "of", "and", "to", "in", "for", "with", "on", "by", "from", "when", "if", "or",
)
QUESTION_OPENERS = (
    "How do I", "Can you", "Why does my", "What is the best way to", "Please help me",
    "Is it possible to", "Could you explain how to", "What happens if I",
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Parameters of a synthetic shared-prefix workload (all deterministic given ``seed``)."""

    seed: int = 2024
    tenants: int = 8
    users_per_tenant: int = 16
    system_chars: tuple[int, int] = (1500, 3000)
    question_words: tuple[int, int] = (10, 40)
    answer_words: tuple[int, int] = (30, 90)
    conversation_share: float = 0.3
    max_turns: int = 6
    tenant_skew: float = 0.5
    model: str = "sim-model"
    max_tokens: int = 4

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.users_per_tenant < 1 or self.max_turns < 1:
            raise ValueError("tenants, users_per_tenant and max_turns must be >= 1")
        if not 0.0 <= self.conversation_share <= 1.0:
            raise ValueError("conversation_share must be in [0, 1]")
        for lo, hi in (self.system_chars, self.question_words, self.answer_words):
            if not 0 < lo <= hi:
                raise ValueError("ranges must satisfy 0 < low <= high")


def words(rng: random.Random, count: int) -> str:
    """``count`` words from :data:`VOCABULARY`, space-separated."""
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def system_prompt(seed: int, tenant: int, chars: tuple[int, int]) -> str:
    """The system prompt of ``tenant``: sentences of seeded words, about ``chars`` long."""
    rng = random.Random(f"{seed}:system:{tenant}")
    target = rng.randint(*chars)
    parts = [f"You are the assistant of tenant {tenant}. Follow these instructions."]
    length = len(parts[0])
    while length < target:
        sentence = words(rng, rng.randint(8, 20)).capitalize() + "."
        parts.append(sentence)
        length += len(sentence) + 1
    return " ".join(parts)[:target]


def system_prompts(spec: WorkloadSpec) -> tuple[str, ...]:
    return tuple(system_prompt(spec.seed, t, spec.system_chars) for t in range(spec.tenants))


def question(rng: random.Random, spec: WorkloadSpec) -> str:
    return f"{rng.choice(QUESTION_OPENERS)} {words(rng, rng.randint(*spec.question_words))}?"


def answer(rng: random.Random, spec: WorkloadSpec) -> str:
    return words(rng, rng.randint(*spec.answer_words)).capitalize() + "."


def tenant_weights(spec: WorkloadSpec) -> tuple[float, ...]:
    """Zipf-like popularity: tenant ``t`` has weight ``1 / (t + 1) ** tenant_skew``."""
    return tuple(1.0 / (t + 1) ** spec.tenant_skew for t in range(spec.tenants))


def chat_body(spec: WorkloadSpec, messages: list[dict[str, str]], user: str) -> dict[str, Any]:
    return {
        "model": spec.model,
        "messages": [dict(m) for m in messages],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "user": user,
    }


def chat_requests(spec: WorkloadSpec, count: int) -> Iterator[dict[str, Any]]:
    """``count`` chat-completions bodies; the same ``spec`` always yields the same sequence."""
    rng = random.Random(f"{spec.seed}:requests")
    prompts = system_prompts(spec)
    weights = tenant_weights(spec)
    tenants = range(spec.tenants)
    conversations: dict[str, list[dict[str, str]]] = {}  # user -> messages so far
    for _ in range(count):
        tenant = rng.choices(tenants, weights)[0]
        user = f"t{tenant}-u{rng.randrange(spec.users_per_tenant)}"
        history = conversations.get(user)
        turns = sum(1 for m in history if m["role"] == "user") if history else 0
        if history and turns < spec.max_turns and rng.random() < spec.conversation_share:
            history.append({"role": "assistant", "content": answer(rng, spec)})
        else:
            history = [{"role": "system", "content": prompts[tenant]}]
            conversations[user] = history
        history.append({"role": "user", "content": question(rng, spec)})
        yield chat_body(spec, history, user)


def describe(spec: WorkloadSpec, count: int) -> dict[str, float]:
    """Summary numbers of a workload (for reports): request mix and prompt sizes in characters."""
    bodies = list(chat_requests(spec, count))
    follow_ups = sum(1 for b in bodies if len(b["messages"]) > 2)
    chars = [sum(len(m["content"]) for m in b["messages"]) for b in bodies]
    return {
        "requests": float(count),
        "tenants": float(spec.tenants),
        "users": float(spec.tenants * spec.users_per_tenant),
        "follow_up_share": follow_ups / count if count else 0.0,
        "system_prompt_chars": float(sum(len(p) for p in system_prompts(spec))),
        "mean_prompt_chars": sum(chars) / count if count else 0.0,
        "max_prompt_chars": float(max(chars, default=0)),
    }
