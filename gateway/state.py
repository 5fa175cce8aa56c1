"""What the request handlers read: one object per application, built once at start-up.

It refers to the resources a request needs; each resource is opened and closed by its own
cleanup context (:mod:`gateway.resources`), and the ones only background loops and admin
pages use (the store, its sync, the rebalancer, the cache lifecycle) are not here."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.backends.base import Backend
from gateway.chat_histories import RESPONSES_BEFORE_INPUT, ChatHistories
from gateway.fingerprint_memo import FingerprintMemo
from gateway.guard import UpstreamGuard
from gateway.kvevents.source import ExactSource
from gateway.normal_texts import NormalTexts
from gateway.parse_pool import ParsePool
from gateway.pool import WorkerPool
from gateway.prewarm import PreWarmer
from gateway.prompt_histories import PromptHistories
from gateway.response_pins import ResponsePins
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Worker
from gateway.session import RoutingSession
from gateway.settings import GatewaySettings
from gateway.telemetry import GatewayMetrics
from gateway.warmup import WarmupManager


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    pool: WorkerPool
    index: PrefixIndex
    session: RoutingSession  # routes and accounts every attempt (owns index writes per request)
    backends: dict[str, Backend]
    metrics: GatewayMetrics
    exact: ExactSource  # engine-exact cache knowledge: KV-event feeds, tokenizer
    guard: UpstreamGuard
    warmup: WarmupManager
    prewarmer: PreWarmer
    pins: ResponsePins  # the worker each stored Responses answer lives on
    # Long prompt texts already found normal, by keyed hash per tenant (gateway.normal_texts).
    normal_texts: NormalTexts = field(default_factory=NormalTexts)
    # Long chats by the bytes that carried them, per tenant (gateway.chat_histories).
    chat_histories: ChatHistories = field(default_factory=ChatHistories)
    # The same for Responses API requests, by their input items.
    response_histories: ChatHistories = field(default_factory=lambda: ChatHistories(
        key="input", before=RESPONSES_BEFORE_INPUT))
    # Long completions prompts by the bytes that carried them (gateway.prompt_histories).
    prompt_histories: PromptHistories = field(default_factory=PromptHistories)
    # Keys of long prompts per namespace, for their next turns (gateway.fingerprint_memo).
    fingerprints: FingerprintMemo = field(default_factory=FingerprintMemo)
    # The thread that parses bodies of very many items off the event loop (gateway.parse_pool).
    parse_pool: ParsePool = field(default_factory=ParsePool)

    def backend_for(self, worker: Worker) -> Backend:
        backend = self.backends.get(worker.kind)
        if backend is None:
            raise LookupError(f"no backend for worker kind {worker.kind!r}")
        return backend
