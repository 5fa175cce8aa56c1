"""Builds the gateway's aiohttp application: routes, the error middleware, and the resources it
owns (each opened and closed by its own cleanup context: :mod:`gateway.resources`)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import Histogram

from gateway import engine_api, explain, normalize, resources, stored_responses, ui
from gateway.api import LEAN_ROUTES, STATE, add_routes
from gateway.auth import AUTH_KEY, Auth, KeyStore, TenantHasher, read_secret, tenant_secret
from gateway.backends.base import Backend
from gateway.backends.kinds import BackendOptions
from gateway.backends.registry import build_backends
from gateway.breaker import BreakerOptions, Breakers
from gateway.chat_histories import RESPONSES_BEFORE_INPUT, ChatHistories
from gateway.contracts.httpserver import ConnectionCap, name_server
from gateway.contracts.lean_http import LEAN_ROUTES_KEY, LeanRoutes, lean_connection_of
from gateway.contracts.registry_signing import load_secret
from gateway.contracts.tracing import Tracing
from gateway.cors import Cors
from gateway.credentials import worker_keys
from gateway.discovery import DiscoveryCollector, PodDiscovery
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from gateway.fingerprint_memo import FingerprintMemo
from gateway.guard import ConnectionSlots, UpstreamGuard
from gateway.health import HealthChecker
from gateway.kvevents.source import ExactSource
from gateway.kvevents.tokenize import PromptTokenizer
from gateway.lifecycle import CacheLifecycle
from gateway.limits import LIMITS_KEY, Limits
from gateway.normal_texts import NormalTexts
from gateway.parse_pool import ParsePool
from gateway.pool import WorkerPool
from gateway.prewarm import PreWarmer, PrewarmOptions
from gateway.procs import peer_dir
from gateway.prompt_histories import PromptHistories
from gateway.rebalance import RebalanceOptions, Rebalancer
from gateway.resources import (
    BACKENDS_KEY,
    DISCOVERY_KEY,
    EXACT_KEY,
    HEALTH_KEY,
    LIFECYCLE_KEY,
    POOL_KEY,
    PREWARMER_KEY,
    REBALANCER_KEY,
    STORE_KEY,
    SYNC_KEY,
    WARMUP_KEY,
)
from gateway.response_pins import ResponsePins
from gateway.routing.policies import build_engine
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Worker
from gateway.session import RoutingSession
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.store.base import MetadataStore
from gateway.store.hub import SCHEME as HUB_SCHEME
from gateway.store.hub import HubStore
from gateway.store.memory import MemoryStore
from gateway.store.redis import RedisStore, is_redis_url
from gateway.sync import StoreSync
from gateway.telemetry import GatewayMetrics
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import (
    BodyBudgetCollector,
    ConnectionCollector,
    MemoCollector,
    TokenizerCollector,
)
from gateway.telemetry.middleware import TELEMETRY_KEY, add_request_id, begin, sent_bytes
from gateway.telemetry.record import RequestRecord, Telemetry
from gateway.tls import ServerTLS, server_tls, worker_context
from gateway.warmup import WarmupManager, WarmupOptions
from gateway.warmup_sources import PromptSample, WarmPrompt, load_warmup_file

log = logging.getLogger(__name__)

# The client port's TLS (None: plain HTTP); the server that listens reads it.
TLS_KEY = web.AppKey[ServerTLS | None]("tls")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(error: GatewayError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def _from_http_exception(exc: web.HTTPException) -> GatewayError:
    match exc.status:
        case 404:
            return NotFound(f"no route for this path: {exc.reason}")
        case 405:
            return MethodNotAllowed("method not allowed on this path")
        case 413:
            return PayloadTooLarge(f"request body too large: {exc.text or exc.reason}")
        case 415:
            return UnsupportedMediaType(exc.text or exc.reason)
    error = GatewayError(exc.text or exc.reason)
    error.status = exc.status
    error.type = "invalid_request_error" if 400 <= exc.status < 500 else "server_error"
    return error


def _as_gateway_error(exc: Exception, request: web.Request) -> GatewayError:
    """What the client is told about an exception a handler raised."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, web.HTTPException):
        return _from_http_exception(exc)
    log.exception("unexpected error serving %s %s", request.method, request.path)
    return GatewayError("internal error in the gateway")


async def _send(
    request: web.Request, response: web.StreamResponse, record: RequestRecord
) -> None:
    """Write ``response`` out now (a streamed one already was): aiohttp would write it only
    after the middleware returns, so the request's telemetry would run first, on the
    client's time, and its latency would leave out the write. What the proxy left until the
    answer is sent (:meth:`RequestRecord.after_sent`) runs right after the write
    (:meth:`RequestRecord.sending`)."""
    if not response.prepared:
        record.sending()
        lean = lean_connection_of(request)
        if lean is not None:  # the lean path writes the whole answer itself
            await lean.respond(request, response)
        else:
            await response.prepare(request)
            await response.write_eof()
        record.sent()


def gateway_middleware(telemetry: Telemetry, auth: Auth, cors: Cors) -> Middleware:
    """The one middleware around every handler: the request's telemetry record (begun before
    anything else, finished once the response went out: the middleware writes it), CORS
    preflights (answered before access rules: browsers send no key on them), access rules,
    and the one place where exceptions become OpenAI-shaped error responses."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        record = begin(telemetry, request)
        status, sent = 500, 0
        try:
            try:
                preflight = (cors.preflight(request)
                             if cors.enabled and request.method == "OPTIONS" else None)
                if preflight is not None:
                    response = preflight
                else:
                    auth.admit(request)
                    response = await handler(request)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                error = _as_gateway_error(exc, request)
            except Exception as exc:
                error = _as_gateway_error(exc, request)
            else:
                await _send(request, response, record)
                status, sent = response.status, sent_bytes(response)
                return response
            record.error_code = error.code or error.type
            response = _error_response(error)
            # This frame holds the error, whose traceback holds this frame: a cycle that only
            # the collector's rare full passes free, keeping the request's decoded body alive
            # (over 100 MB for an 8 MiB body of tiny items) long after the error was answered.
            error.__traceback__ = None
            await _send(request, response, record)
            status, sent = response.status, sent_bytes(response)
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away
            raise
        finally:
            telemetry.finish(record, status, sent)

    return middleware


def response_hook(
    auth: Auth, cors: Cors
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """``on_response_prepare``: the request id on every response; routing headers only for
    callers that may see them; CORS headers for the pages of allowed origins."""

    async def prepare(request: web.Request, response: web.StreamResponse) -> None:
        add_request_id(request, response)
        auth.hide_route_headers(request, response)
        if cors.enabled:
            cors.decorate(request, response)

    return prepare


def _reload_keys(auth: Auth) -> None:
    try:
        count = auth.keys.reload()
    except ValueError as exc:
        log.error("SIGHUP: keys file not reloaded, the previous keys stay in use: %s", exc)
    else:
        log.info("SIGHUP: keys file reloaded (%d keys)", count)


async def _parse_thread(app: web.Application) -> AsyncIterator[None]:
    """The parse pool's thread (gateway.parse_pool) stops at shutdown."""
    try:
        yield
    finally:
        app[STATE].parse_pool.close()


async def _reloading(app: web.Application) -> AsyncIterator[None]:
    """SIGHUP re-reads ``--api-keys-file`` and the TLS certificate (where the loop can take
    signal handlers)."""
    auth = app[AUTH_KEY]
    tls = app[TLS_KEY]
    keys_file = bool(app[STATE].settings.api_keys_file)
    loop = asyncio.get_running_loop()
    installed = False
    if keys_file or tls is not None:
        def reload() -> None:
            if keys_file:
                _reload_keys(auth)
            if tls is not None:
                tls.reload()

        try:
            loop.add_signal_handler(signal.SIGHUP, reload)
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):
            log.warning("cannot handle SIGHUP here: the keys file and certificate are read "
                        "once")
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGHUP)


def build_auth(settings: GatewaySettings) -> Auth:
    """The access rules from the settings; raises ValueError for unreadable or bad files."""
    keys = KeyStore(settings.api_key, settings.api_keys_file)
    secret = read_secret(settings.tenant_secret, settings.tenant_secret_file, "tenant secret")
    hasher = TenantHasher(tenant_secret(
        secret, keys_configured=keys.configured,
        shared_store=not settings.store.startswith("memory://"),
    ))
    return Auth(
        keys, hasher,
        admin_token=read_secret(settings.admin_token, settings.admin_token_file, "admin token"),
        admin_port=settings.admin_port,
        metrics_auth=settings.metrics_auth,
        route_headers=settings.route_headers,
    )


def build_store(settings: GatewaySettings) -> MetadataStore:
    if settings.store.startswith("memory://"):
        return MemoryStore()
    if settings.store.startswith(HUB_SCHEME):  # the parent of --procs N serves it
        return HubStore(settings.store)
    return RedisStore(settings.store, prefix=settings.store_prefix)


def backend_options(settings: GatewaySettings) -> BackendOptions:
    """What every backend kind is built from; raises ValueError for an unreadable key."""
    return BackendOptions(
        connect_timeout_s=settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        max_connections=settings.max_connections,
        max_connections_per_worker=settings.max_connections_per_worker,
        warm_connections=settings.warm_connections,
        api_keys=worker_keys(settings.worker),
        default_api_key=read_secret(
            settings.worker_api_key, settings.worker_api_key_file, "worker API key"),
        admin_token=settings.worker_admin_token,
        ssl_context=worker_context(settings.worker_ca_file, settings.worker_cert_file,
                                   settings.worker_key_file),
    )


def build_exact_source(settings: GatewaySettings, metrics: GatewayMetrics) -> ExactSource:
    """The KV-event feeds and, with ``--tokenizer-file``, the token-exact keys."""
    tokenizer = None
    opts = settings.tokenizer_options()
    if opts is not None:
        seconds = Histogram(
            "gateway_tokenize_seconds", "time to tokenize and key one prompt",
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
            registry=metrics.registry,
        )
        tokenizer = PromptTokenizer(opts, observe=seconds.observe)
        metrics.registry.register(TokenizerCollector(tokenizer))
    return ExactSource(
        tokenizer, max_blocks=settings.kv_events_max_blocks,
        pending_ttl_s=settings.kv_pending_ttl_s, min_match_blocks=settings.min_match_blocks,
        view=settings.kv_events_view, settle_s=settings.kv_events_settle_s,
        skew_s=settings.kv_events_skew_s,
    )


_HOT_USES = 8.0


def _warmup_prompts(settings: GatewaySettings, hasher: TenantHasher) -> list[WarmPrompt]:
    if not settings.warmup_file:
        return []

    def tenancy(name: str, cache_salt: str) -> tuple[str, str]:
        # As for a request with the tenant's key: its keyed id, and the namespace from it.
        tenant_id = hasher.tenant_id(name)
        return tenant_id, hasher.namespace(tenant_id, cache_salt)

    return load_warmup_file(settings.warmup_file, normalize=settings.normalize_options(),
                            fingerprint_options=settings.fingerprint_options(), tenancy=tenancy)


def create_app(
    settings: GatewaySettings, *, span_exporter: SpanExporter | None = None,
    connections: ConnectionCap | None = None,
) -> web.Application:
    """The gateway. ``span_exporter``: export spans there as they end (tests), whatever
    ``settings.otel_endpoint`` says. ``connections``: the cap its server counts client
    connections with, for the metrics. Raises ``ValueError`` for a bad ``--warmup-file``."""
    index = PrefixIndex(capacity=settings.index_capacity, ttl_s=settings.index_ttl_s)
    # Token-exact keys count the engine's own blocks, the admitted request's included.
    pool = WorkerPool(settings.worker, index,
                      private_blocks=1 if settings.tokenizer_options() is not None else 0)
    metrics = GatewayMetrics(pool)
    exact = build_exact_source(settings, metrics)
    pool.matcher = exact.matcher
    backends = build_backends(backend_options(settings))
    store = build_store(settings)
    origin = settings.replica_id()
    registry_secret = load_secret(settings.registry_secret, settings.registry_secret_file)
    if is_redis_url(settings.store) and not registry_secret:
        log.warning("worker registrations are not signed (no --registry-secret): whoever can "
                    "write to the store can add a worker")
    sync = StoreSync(
        store, pool, index, origin=origin, tokens_per_block=settings.tokens_per_block(),
        shares_state=not isinstance(store, MemoryStore), history_s=settings.index_ttl_s,
        max_weight=settings.max_worker_weight,
        registry_secret=registry_secret,
        # The processes of one gateway send each other their decisions as they are made; with
        # the hub they are all that share it, with Redis other gateways may too.
        peer_dir=peer_dir(), peers_only=isinstance(store, HubStore),
    )
    engine = build_engine(settings.policy, settings.policy_options())
    normalize.prepare(settings.normalize_options())

    def backend_for(worker: Worker) -> Backend:
        found = backends.get(worker.kind)
        if found is None:
            raise LookupError(f"no backend for worker kind {worker.kind!r}")
        return found

    auth = build_auth(settings)
    # A prefix this many recent requests share is hot: every joining worker gets it, and it is
    # pre-warmed on its next holder. The policy's own threshold when its hot rule is on.
    hot = settings.hot_threshold if settings.hot_threshold > 0 else _HOT_USES
    warmup = WarmupManager(
        pool, index, sync, backend_for,
        WarmupOptions(
            enabled=settings.warmup, budget_s=settings.warmup_budget_s,
            ramp_s=settings.warmup_ramp_s, cache_fraction=settings.warmup_cache_fraction,
            concurrency=settings.warmup_concurrency, ring_choices=settings.ring_choices,
            hot_uses=hot, peer_prompts=settings.warmup_peers,
            fingerprint=settings.fingerprint_options(), normalize=settings.normalize_options(),
            copy_priority=settings.copy_priority,
        ),
        sample=PromptSample(tenants=settings.sampled_tenants()),
        file_prompts=_warmup_prompts(settings, auth.hasher),
    )
    warmup.exact = exact
    sync_health = sync.health
    metrics.watch_store(lambda: sync_health.available, lambda: sync_health.outages,
                        lambda: store.unreadable)
    state = GatewayState(
        settings=settings,
        pool=pool,
        index=index,
        session=RoutingSession(engine, index, pool, sync, exact=exact),
        backends=backends,
        metrics=metrics,
        exact=exact,
        guard=UpstreamGuard(
            slots=ConnectionSlots(settings.max_connections, settings.max_connections_per_worker,
                                  settings.queue_timeout_s),
            first_byte_timeout_s=settings.first_byte_timeout_s,
            stream_idle_timeout_s=settings.stream_idle_timeout_s,
            breakers=Breakers(BreakerOptions(settings.breaker_failures,
                                             settings.breaker_cooldown_s)),
        ),
        warmup=warmup,
        pins=ResponsePins(store, auth.hasher, settings.response_pin_ttl_s),
        prewarmer=PreWarmer(
            pool, index, warmup.prewarm, PrewarmOptions(
                enabled=settings.prewarm, hot_threshold=hot,
                fraction=settings.prewarm_fraction, wait_weight=settings.wait_weight,
                block_chars=settings.fingerprint_options().block_chars,
                whole=settings.prewarm_whole, copy_priority=settings.copy_priority,
            ), leading_ids=exact.leading_ids),
        chat_histories=ChatHistories(max_bytes=settings.chat_history_bytes),
        response_histories=ChatHistories(max_bytes=settings.chat_history_bytes, key="input",
                                         before=RESPONSES_BEFORE_INPUT),
        prompt_histories=PromptHistories(max_bytes=settings.chat_history_bytes),
        fingerprints=FingerprintMemo(max_bytes=settings.chat_history_bytes),
        parse_pool=ParsePool(settings.parse_thread_items),
        normal_texts=NormalTexts(rewritten_bytes=settings.normal_text_bytes),
    )
    metrics.registry.register(
        MemoCollector(state.normal_texts, state.chat_histories, state.prompt_histories,
                      state.fingerprints, state.parse_pool, state.response_histories))
    if connections is not None:
        metrics.registry.register(ConnectionCollector(connections))
    lifecycle = CacheLifecycle(pool, backend_for, warmup)
    telemetry = Telemetry(
        metrics=metrics,
        tracing=Tracing.build(settings.tracing_options(), span_exporter),
        access_log=AccessLog(settings.access_log),
    )
    cors = Cors(settings.cors_origin)
    middleware = gateway_middleware(telemetry, auth, cors)
    app = web.Application(middlewares=[middleware], client_max_size=settings.max_body_bytes)
    if settings.lean_http:
        app[LEAN_ROUTES_KEY] = LeanRoutes(
            app, {(method.encode(), path.encode()): (method, path, handler)
                  for (method, path), handler in LEAN_ROUTES.items()},
            middleware)
    app[STATE] = state
    app[TELEMETRY_KEY] = telemetry
    app[BACKENDS_KEY] = backends
    app[STORE_KEY] = store
    app[SYNC_KEY] = sync
    app[POOL_KEY] = pool
    app[HEALTH_KEY] = HealthChecker(state, lifecycle, telemetry.misses)
    telemetry.misses.on_restart = lifecycle.restarted  # by its counters or its start stamp
    sync.gone = app[HEALTH_KEY].probe_soon  # a registry entry gone: is the worker gone too?
    app[EXACT_KEY] = exact
    app[WARMUP_KEY] = warmup
    app[LIFECYCLE_KEY] = lifecycle
    app[PREWARMER_KEY] = state.prewarmer
    k8s = settings.kubernetes_options()
    discovery = app[DISCOVERY_KEY] = PodDiscovery(pool, k8s) if k8s is not None else None
    if discovery is not None:
        metrics.registry.register(DiscoveryCollector(discovery))
        discovery.joined = app[HEALTH_KEY].wake  # a pod that joins is probed at once
    app[REBALANCER_KEY] = Rebalancer(
        store, pool, index, origin, RebalanceOptions(interval_s=settings.rebalance_interval_s))
    app[AUTH_KEY] = auth
    app[TLS_KEY] = server_tls(settings.tls_cert_file, settings.tls_key_file)
    limits = app[LIMITS_KEY] = Limits(settings.limit_options())
    metrics.registry.register(BodyBudgetCollector(limits.bodies))
    app.on_response_prepare.append(response_hook(auth, cors))
    name_server(app, "affinity-gateway")
    resources.install(app)
    app.cleanup_ctx.append(_reloading)
    app.cleanup_ctx.append(_parse_thread)
    add_routes(app)
    engine_api.add_routes(app)
    stored_responses.add_routes(app)
    explain.add_routes(app)
    ui.add_routes(app)
    return app
