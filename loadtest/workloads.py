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

The *live* workloads (:func:`user_requests`, :class:`LiveSpec`; used by
``loadtest/locustfile.py``) are generated per simulated user instead of as one sequence:
``chat`` (multi-turn, growing history), ``tenants`` (many system prompts, one API key each),
``rag`` (document prefix + question) and ``fewshot`` (templates + new input), all streaming;
``mooncake`` trace replay lives in :mod:`loadtest.textgen`.
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


# -- live workloads (per simulated user; for locust) -----------------------------------------------
#
# A live load test runs many concurrent users, each a closed loop: send, wait for the answer,
# think, send again. So a live workload is a function of (workload, spec, user index) that yields
# that user's requests, one after another, forever (the caller bounds it): deterministic by
# ``LiveSpec.seed`` and the user index, independent of timing and of the other users.

# Trace replays: each request a chain of block ids turned into text (loadtest.textgen), the
# trace read from a Mooncake file or generated (loadtest.trace_workloads).
REPLAYED_WORKLOADS = ("mooncake", "shared-prompts", "agent-sessions")
WORKLOADS = ("chat", "tenants", "rag", "fewshot", *REPLAYED_WORKLOADS)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One request of a live workload: where to POST it, the body, and the tenant's API key
    (sent as ``Authorization: Bearer``; the gateway derives the tenant's cache namespace from
    it). ``label`` groups requests in locust's statistics."""

    path: str
    body: dict[str, Any]
    api_key: str = ""
    label: str = ""


@dataclass(frozen=True, slots=True)
class LiveSpec:
    """Parameters of the live workloads (all deterministic given ``seed``).

    * ``tenants``: ``tenants`` system prompts (``system_chars`` long) with Zipf-like popularity
      (``skew``); every request is a fresh question under one tenant's prompt and API key.
    * ``chat``: each user belongs to one tenant and holds one conversation: every request repeats
      the whole history (system prompt, questions, synthetic answers) plus a new question; after
      2..``max_turns`` turns the user starts a new conversation.
    * ``rag``: ``documents`` documents (``document_chars`` long, popularity Zipf-like); a request
      is a short shared instruction, one document, then a question about it.
    * ``fewshot``: ``templates`` few-shot templates, each an instruction plus ``shots`` worked
      examples; a request is one template followed by a new input.
    * ``mooncake``, ``shared-prompts``, ``agent-sessions``: trace replay
      (:func:`loadtest.textgen.trace_request`; the last two generated by
      :mod:`loadtest.trace_workloads`), not generated here.
    """

    seed: int = 2024
    model: str = "sim-model"
    max_tokens: int = 4
    stream: bool = True
    tenants: int = 16
    system_chars: tuple[int, int] = (1500, 3000)
    question_words: tuple[int, int] = (10, 40)
    answer_words: tuple[int, int] = (30, 90)
    max_turns: int = 8
    documents: int = 48
    document_chars: tuple[int, int] = (2000, 4000)
    templates: int = 8
    shots: int = 6
    skew: float = 0.8

    def __post_init__(self) -> None:
        if min(self.tenants, self.documents, self.templates, self.shots, self.max_tokens) < 1:
            raise ValueError("tenants, documents, templates, shots and max_tokens must be >= 1")
        if self.max_turns < 2:
            raise ValueError("max_turns must be >= 2")
        for lo, hi in (self.system_chars, self.question_words, self.answer_words,
                       self.document_chars):
            if not 0 < lo <= hi:
                raise ValueError("ranges must satisfy 0 < low <= high")


def zipf_weights(count: int, skew: float) -> tuple[float, ...]:
    """Item ``i`` has weight ``1 / (i + 1) ** skew``."""
    return tuple(1.0 / (i + 1) ** skew for i in range(count))


def _text(rng: random.Random, chars: tuple[int, int], opener: str) -> str:
    target = rng.randint(*chars)
    parts = [opener]
    length = len(opener)
    while length < target:
        sentence = words(rng, rng.randint(8, 20)).capitalize() + "."
        parts.append(sentence)
        length += len(sentence) + 1
    return " ".join(parts)[:target]


def document(seed: int, index: int, chars: tuple[int, int]) -> str:
    """Document ``index`` of the RAG corpus."""
    return _text(random.Random(f"{seed}:document:{index}"), chars, f"Document {index}.")


def fewshot_template(seed: int, index: int, shots: int,
                     spec: LiveSpec) -> list[dict[str, str]]:
    """Template ``index``: an instruction (system) plus ``shots`` worked user/assistant pairs."""
    rng = random.Random(f"{seed}:fewshot:{index}")
    messages = [{
        "role": "system",
        "content": f"Task {index}: classify the request and answer in one line. "
        + words(rng, 40).capitalize() + ".",
    }]
    for _ in range(shots):
        messages.append({"role": "user", "content": _live_question(rng, spec)})
        messages.append({"role": "assistant", "content": _live_answer(rng, spec)})
    return messages


def _live_question(rng: random.Random, spec: LiveSpec) -> str:
    return f"{rng.choice(QUESTION_OPENERS)} {words(rng, rng.randint(*spec.question_words))}?"


def _live_answer(rng: random.Random, spec: LiveSpec) -> str:
    return words(rng, rng.randint(*spec.answer_words)).capitalize() + "."


def live_body(spec: LiveSpec, messages: list[dict[str, str]], user: str) -> dict[str, Any]:
    """A chat-completions body; streaming (with a final usage chunk) when ``spec.stream``."""
    body: dict[str, Any] = {
        "model": spec.model,
        "messages": [dict(m) for m in messages],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "user": user,
    }
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


RESPONSES_PATH = "/v1/responses"


def as_responses(req: LiveRequest) -> LiveRequest:
    """The same request for OpenAI's Responses API: a chat's leading system messages as
    ``instructions`` and the rest as input messages, a completions prompt as the input;
    ``max_output_tokens`` for the decode budget; streamed when the original was. Its label
    says so, in locust's statistics and the samples."""
    body = req.body
    out: dict[str, Any] = {"model": body["model"], "temperature": body.get("temperature", 0)}
    messages = body.get("messages")
    if isinstance(messages, list):
        lead = 0
        while lead < len(messages) and messages[lead].get("role") == "system":
            lead += 1
        if lead:
            out["instructions"] = "\n".join(str(m["content"]) for m in messages[:lead])
        rest = messages[lead:] or [{"role": "user", "content": ""}]
        out["input"] = input_items(rest)
    else:
        out["input"] = body["prompt"]
    out["max_output_tokens"] = body.get("max_tokens", 16)
    if body.get("stream"):
        out["stream"] = True
    label = f"{req.label} (responses)" if req.label else "responses"
    return LiveRequest(RESPONSES_PATH, out, req.api_key, label)


def input_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses API input items: tool calls as ``function_call`` items,
    tool results as ``function_call_output`` items, the rest as messages."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in m["tool_calls"]]
        elif m.get("role") == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def stored_turn(body: dict[str, Any],
                last: tuple[list[Any], str] | None) -> dict[str, Any]:
    """A Responses body (:func:`as_responses`) sent as a stored conversation's next turn.
    ``last``: the input the last turn sent whole and the id of its answer. When this input is
    that one, one assistant message (the workload's stand-in for the answer, which the server
    stored as it really was) and new items, only the new items go, after
    ``previous_response_id``; otherwise the body goes whole (a conversation begins)."""
    items = body.get("input")
    if last is None or not isinstance(items, list):
        return body
    before, response_id = last
    n = len(before)
    if (len(items) <= n + 1 or items[:n] != before
            or not isinstance(items[n], dict) or items[n].get("role") != "assistant"):
        return body
    return {**body, "input": items[n + 1:], "previous_response_id": response_id}


def tenant_key(tenant: int) -> str:
    return f"sk-tenant-{tenant}"


def user_requests(workload: str, spec: LiveSpec, user: int) -> Iterator[LiveRequest]:
    """User ``user``'s requests under ``workload`` (not ``mooncake``), an endless generator."""
    rng = random.Random(f"{spec.seed}:{workload}:user:{user}")
    name = f"u{user}"
    if workload == "tenants":
        weights = zipf_weights(spec.tenants, spec.skew)
        while True:
            t = rng.choices(range(spec.tenants), weights)[0]
            messages = [
                {"role": "system", "content": system_prompt(spec.seed, t, spec.system_chars)},
                {"role": "user", "content": _live_question(rng, spec)},
            ]
            yield LiveRequest(CHAT_PATH, live_body(spec, messages, name), tenant_key(t), workload)
    elif workload == "chat":
        t = user % spec.tenants
        system = {"role": "system", "content": system_prompt(spec.seed, t, spec.system_chars)}
        while True:
            history = [system]
            for turn in range(rng.randint(2, spec.max_turns)):
                if turn:
                    history.append({"role": "assistant", "content": _live_answer(rng, spec)})
                history.append({"role": "user", "content": _live_question(rng, spec)})
                yield LiveRequest(CHAT_PATH, live_body(spec, history, name), tenant_key(t),
                                  workload)
    elif workload == "rag":
        weights = zipf_weights(spec.documents, spec.skew)
        instruction = {"role": "system",
                       "content": "Answer the question using only the document provided."}
        while True:
            d = rng.choices(range(spec.documents), weights)[0]
            content = (f"{document(spec.seed, d, spec.document_chars)}\n\n"
                       f"Question: {_live_question(rng, spec)}")
            messages = [instruction, {"role": "user", "content": content}]
            yield LiveRequest(CHAT_PATH, live_body(spec, messages, name), "", workload)
    elif workload == "fewshot":
        weights = zipf_weights(spec.templates, spec.skew)
        while True:
            k = rng.choices(range(spec.templates), weights)[0]
            messages = fewshot_template(spec.seed, k, spec.shots, spec)
            messages.append({"role": "user", "content": _live_question(rng, spec)})
            yield LiveRequest(CHAT_PATH, live_body(spec, messages, name), "", workload)
    else:
        raise ValueError(f"unknown live workload {workload!r}; choose from "
                         f"{', '.join(w for w in WORKLOADS if w not in REPLAYED_WORKLOADS)}")


def trace_prompt_blocks(blocks: tuple[int, ...], max_blocks: int) -> tuple[int, ...]:
    """The blocks a live replay sends: the first ``max_blocks`` (a prefix stays a prefix)."""
    return blocks[:max_blocks] if max_blocks > 0 else blocks


def trace_body(spec: LiveSpec, prompt: str, output_tokens: int) -> dict[str, Any]:
    """A completions body for a replayed trace request (decode capped at ``spec.max_tokens``)."""
    body: dict[str, Any] = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": max(1, min(output_tokens, spec.max_tokens)),
        "temperature": 0,
    }
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body
