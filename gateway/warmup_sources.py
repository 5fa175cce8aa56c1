"""Where warm-up prompts come from, and which of them a joining worker gets.

The gateway never stores prompt text outside its own memory (not in the store, not in logs).
A joining worker is warmed from:

* :class:`PromptSample`: an opt-in, bounded, per-tenant sample of recent requests, one entry per
  ring anchor (the prefix a tenant's requests share: its system prompt), with a decayed use
  count. Off unless the operator names the tenants it may replay (``--warmup-sample``);
* a warm-up file an operator provides (``--warmup-file``): JSON lines, each an OpenAI chat or
  completions body (``messages`` or ``prompt``, ``model``), optionally with a ``tenant`` (its
  name as configured with its API keys; the gateway derives the tenant id and the cache
  namespace from it as it does for the tenant's requests), typically the fleet's system
  prompts;
* prompts a peer exports (``/admin/hot-prefixes`` of the reference worker).

:func:`plan` orders them for one worker: operator prompts first, then hot prefixes (every new
worker becomes one of their holders), then prefixes whose anchor the ring now places on the
worker (the owner first, then the later ring choices), most used first, until the worker's cache
budget is spent.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.contracts.engine_paths import CHAT_PATH, COMPLETIONS_PATH
from gateway.contracts.responses import RESPONSES_PATH
from gateway.errors import GatewayError
from gateway.fingerprint import FingerprintOptions, Namespace, PrefixKey, fingerprint
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import parse_chat, parse_completion
from gateway.routing.ring import Ring

# A tenant's name and a cache_salt -> (its keyed tenant id, the cache namespace workers see).
Tenancy = Callable[[str, str], tuple[str, str]]

# Fields of a sampled body that a prefill-only replay must not carry. Its ``tools`` stay: a
# chat template renders them at the top of the prompt, so a replay without them would warm
# another prefix; a forced ``tool_choice`` or an output format would constrain its one token.
_DROPPED_FIELDS = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs",
                   "max_completion_tokens", "tool_choice", "response_format")


@dataclass(frozen=True, slots=True)
class WarmPrompt:
    """One prompt to replay: the body as real traffic sent it (normalized), its namespace."""

    path: str
    body: Mapping[str, Any]
    tenant: str
    model: str
    key: PrefixKey
    uses: float = 1.0  # recent requests that shared its anchor (decayed)
    pinned: bool = False  # from the operator's warm-up file: always first
    text: str = ""  # the normalized text it was fingerprinted from
    cache_salt: str = ""
    namespace: str = ""  # the cache namespace workers see (derived from tenant and salt)
    # The engine scheduling ``priority`` its replay is sent with (0: the body's own, if any).
    priority: int = 0
    # A session's copy (the volume guard's). At the default priority the index records it
    # when it is sent, as any pre-warm: the engine admits it ahead of the requests routed
    # after it and caches its blocks when it begins them (vLLM), so the session's next turn
    # moved there reuses them. At a background priority (``priority`` > 0) the engine may not
    # have begun it when that turn comes, and the index records it once it answered.
    session_copy: bool = False

    @property
    def recorded_at_answer(self) -> bool:
        """Whether the index records this prompt on its worker only once it answered."""
        return self.session_copy and self.priority > 0

    def rekeyed(self, model_identity: str, opts: FingerprintOptions) -> WarmPrompt:
        """The same prompt keyed as a request for ``model_identity`` (the model and its current
        version, :meth:`gateway.pool.WorkerPool.model_identity`) is keyed now."""
        if not self.text:
            return self
        namespace = Namespace(tenant=self.tenant, model=model_identity, cache_salt=self.cache_salt)
        return dataclasses.replace(self, key=fingerprint(self.text, namespace, opts))

    def replay_body(self) -> dict[str, Any]:
        """The prefill-only request: the same prompt, one output token, no streaming."""
        body = {k: v for k, v in self.body.items() if k not in _DROPPED_FIELDS}
        # A Responses API request names its output limit otherwise (and would ignore this one).
        body["max_output_tokens" if self.path == RESPONSES_PATH else "max_tokens"] = 1
        body["stream"] = False
        body["temperature"] = 0
        if self.priority:
            body["priority"] = self.priority
        return body


@dataclass(slots=True)
class _Entry:
    prompt: WarmPrompt
    uses: float
    at: float


@dataclass(slots=True)
class PromptSample:
    """Recent prompts of opted-in tenants, in this process's memory only.

    ``tenants``: the tenant names (as configured with their API keys; ``""`` for requests
    without a key) that may be sampled (``"*"``: all of them; empty: none). Entries are kept
    under the keyed tenant id, never the name. At
    most ``per_tenant`` anchors per tenant (least recently seen dropped first), ``max_tenants``
    tenants, and bodies up to ``max_chars`` of prompt text.
    """

    tenants: frozenset[str] = frozenset()
    per_tenant: int = 64
    max_tenants: int = 256
    max_chars: int = 200_000
    half_life_s: float = 60.0
    _by_tenant: OrderedDict[str, OrderedDict[int, _Entry]] = field(default_factory=OrderedDict)

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def samples(self, tenant: str) -> bool:
        return "*" in self.tenants or tenant in self.tenants

    def observe(self, prompt: WarmPrompt, now: float, name: str) -> None:
        """A request of tenant ``name`` (kept only if that tenant opted in)."""
        key, tenant = prompt.key, prompt.tenant
        if not self.samples(name) or not key.blocks or key.text_chars > self.max_chars:
            return
        entries = self._by_tenant.get(tenant)
        if entries is None:
            entries = self._by_tenant[tenant] = OrderedDict()
            while len(self._by_tenant) > self.max_tenants:
                self._by_tenant.popitem(last=False)
        else:
            self._by_tenant.move_to_end(tenant)
        old = entries.get(key.anchor)
        uses = 1.0 + (self._decayed(old.uses, old.at, now) if old is not None else 0.0)
        prompt = dataclasses.replace(prompt, body=dict(prompt.body))
        entries[key.anchor] = _Entry(prompt, uses, now)
        entries.move_to_end(key.anchor)
        while len(entries) > self.per_tenant:
            entries.popitem(last=False)

    def _decayed(self, uses: float, at: float, now: float) -> float:
        if self.half_life_s <= 0 or now <= at:
            return uses
        return float(uses * 0.5 ** ((now - at) / self.half_life_s))

    def prompts(self, now: float) -> list[WarmPrompt]:
        out = []
        for entries in self._by_tenant.values():
            for e in entries.values():
                out.append(dataclasses.replace(e.prompt, uses=self._decayed(e.uses, e.at, now)))
        return out

    def __len__(self) -> int:
        return sum(len(e) for e in self._by_tenant.values())


def parse_prompt(
    raw: Mapping[str, Any],
    *,
    default_model: str,
    normalize: NormalizeOptions,
    fingerprint_options: FingerprintOptions,
    tenancy: Tenancy | None = None,
    pinned: bool = False,
) -> WarmPrompt:
    """A warm-up prompt from an OpenAI body (plus an optional ``tenant`` name): parsed,
    normalized and fingerprinted exactly as the gateway treats a client's request of that
    tenant (``tenancy`` turns the name into its keyed id and cache namespace)."""
    body = {k: v for k, v in raw.items() if k != "tenant"}
    name = raw.get("tenant", "")
    if not isinstance(name, str):
        raise ValueError("'tenant' must be a string")
    body.setdefault("model", default_model)
    try:
        if "messages" in body:
            path, parsed = CHAT_PATH, parse_chat(body, normalize)
        else:
            path, parsed = COMPLETIONS_PATH, parse_completion(body, normalize)
    except GatewayError as exc:
        raise ValueError(exc.message) from exc
    tenant, namespace = (tenancy or _plain)(name, parsed.cache_salt)
    key = fingerprint(parsed.fingerprint_text,
                      Namespace(tenant=tenant, model=parsed.model, cache_salt=parsed.cache_salt),
                      fingerprint_options)
    return WarmPrompt(path, parsed.body, tenant, parsed.model, key, pinned=pinned,
                      text=parsed.fingerprint_text, cache_salt=parsed.cache_salt,
                      namespace=namespace)


def _plain(tenant: str, cache_salt: str) -> tuple[str, str]:
    return tenant, tenant


def load_warmup_file(
    path: str, *, normalize: NormalizeOptions, fingerprint_options: FingerprintOptions,
    tenancy: Tenancy | None = None,
) -> list[WarmPrompt]:
    """The operator's warm-up prompts (JSON lines; blank lines and ``#`` comments skipped).
    Raises ``ValueError`` naming the line of a bad entry."""
    out: list[WarmPrompt] = []
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError("each line must be a JSON object")
            out.append(parse_prompt(raw, default_model="", normalize=normalize,
                                    fingerprint_options=fingerprint_options, tenancy=tenancy,
                                    pinned=True))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    return out


class Namespaces:
    """Cache namespace (as workers see it) -> tenant id, for the namespaces recently routed
    (bounded; both are keyed hashes)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._tenants: OrderedDict[str, str] = OrderedDict()

    def seen(self, namespace: str, tenant_id: str) -> None:
        tenants = self._tenants
        if tenants.get(namespace) == tenant_id:
            tenants.move_to_end(namespace)
            return
        tenants[namespace] = tenant_id
        tenants.move_to_end(namespace)
        while len(tenants) > self.capacity:
            tenants.popitem(last=False)

    def tenant_of(self, namespace: str) -> str | None:
        return self._tenants.get(namespace)


def peer_prompt(
    entry: Mapping[str, Any],
    namespaces: Namespaces,
    *,
    normalize: NormalizeOptions,
    fingerprint_options: FingerprintOptions,
) -> WarmPrompt | None:
    """A prompt a worker exported (``path``, ``body``, ``namespace``, ``uses``), keyed as the
    request it came from was; None when it cannot be (a namespace this gateway has not routed,
    a body it would refuse)."""
    path, body, namespace = entry.get("path"), entry.get("body"), entry.get("namespace")
    uses = entry.get("uses", 1.0)
    if path not in (CHAT_PATH, COMPLETIONS_PATH) or not isinstance(body, dict):
        return None
    if not isinstance(namespace, str) or not isinstance(uses, int | float):
        return None
    tenant = namespaces.tenant_of(namespace)
    if tenant is None:
        return None
    try:
        parse = parse_chat if path == CHAT_PATH else parse_completion
        parsed = parse(body, normalize)
    except GatewayError:
        return None
    key = fingerprint(parsed.fingerprint_text,
                      Namespace(tenant=tenant, model=parsed.model, cache_salt=parsed.cache_salt),
                      fingerprint_options)
    return WarmPrompt(path, parsed.body, tenant, parsed.model, key, uses=float(uses),
                      text=parsed.fingerprint_text, cache_salt=parsed.cache_salt,
                      namespace=namespace)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    ring_choices: int = 4  # the worker gets prefixes whose anchor puts it this early on the ring
    hot_uses: float = 8.0  # a prefix this many recent requests share goes to every new worker
    budget_blocks: float = math.inf  # fingerprint blocks the warm-up may fill
    max_prompts: int = 256


def plan(
    worker_id: str,
    prompts: Iterable[WarmPrompt],
    weights: Mapping[str, float],
    models: frozenset[str],
    opts: PlanOptions,
) -> list[WarmPrompt]:
    """The prompts to replay on ``worker_id``, most valuable first, within the budget.

    ``weights`` are the full ring weights with the worker in: where each anchor lands once it
    has joined. ``models`` are the models the worker serves (empty: any).
    """
    ring = Ring(weights)
    scored: list[tuple[float, int, WarmPrompt]] = []
    for i, p in enumerate(prompts):
        if models and p.model not in models:
            continue
        if p.pinned:
            value = math.inf
        elif p.uses >= opts.hot_uses:
            value = p.uses * 2.0
        else:
            position = _position(ring, p.key.anchor, worker_id, opts.ring_choices)
            if position is None:
                continue
            value = p.uses / (position + 1)
        scored.append((value, i, p))
    scored.sort(key=lambda t: (-t[0], t[1]))
    chosen: list[WarmPrompt] = []
    seen: set[tuple[str, int]] = set()
    blocks = 0.0
    for _, _, p in scored:
        ident = (p.tenant, p.key.blocks[-1] if p.key.blocks else p.key.anchor)
        if ident in seen:
            continue
        cost = p.key.total_blocks
        if blocks + cost > opts.budget_blocks and not p.pinned:
            continue
        seen.add(ident)
        blocks += cost
        chosen.append(p)
        if len(chosen) >= opts.max_prompts:
            break
    return chosen


def _position(ring: Ring, anchor: int, worker_id: str, choices: int) -> int | None:
    for i, wid in enumerate(ring.walk(anchor)):
        if i >= max(1, choices):
            return None
        if wid == worker_id:
            return i
    return None


def prompt_blocks(prompts: Sequence[WarmPrompt]) -> int:
    return sum(p.key.total_blocks for p in prompts)
