"""The gateway's settings: one frozen object, built once from flags and ``GATEWAY_*`` variables."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from gateway.contracts.config import load_settings
from gateway.contracts.tracing import PROTOCOLS, TracingOptions
from gateway.cors import normal_origin
from gateway.discovery import SERVICE_ACCOUNT, KubernetesOptions
from gateway.fingerprint import FingerprintOptions
from gateway.kvevents.token_prefix import PrefixStoreOptions
from gateway.kvevents.tokenize import TokenizerOptions
from gateway.limits import LimitOptions
from gateway.normalize import NormalizeOptions
from gateway.routing.policies import POLICY_NAMES, PolicyOptions, build_engine
from gateway.telemetry.access_log import ACCESS_LOG_MODES

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _secret(text: str) -> dict[str, object]:
    """Metadata of a field that holds a secret: ``--help`` never prints its value."""
    return {"help": text, "secret": True}


ROUTE_HEADER_MODES = ("all", "admin", "none")
K8S_SCHEMES = ("http", "https", "vllm+http", "vllm+https")

# The policy defaults live in PolicyOptions; the settings of the same name take them from it.
_POLICY = PolicyOptions()


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=8000, metadata=_help("port to listen on"))
    worker: tuple[str, ...] = field(
        default=(),
        metadata=_help("base URL of a worker, e.g. http://127.0.0.1:8001, or a SageMaker "
                       "target sagemaker://ENDPOINT?variant=V&region=R "
                       "(see gateway.backends.sagemaker_target)"),
    )
    policy: str = field(
        default="cache_aware", metadata=_help(f"routing policy: {', '.join(POLICY_NAMES)}")
    )
    load_factor: float = field(
        default=_POLICY.load_factor,
        metadata=_help("bounded-load factor c: no worker above c x mean load"),
    )
    load_floor_requests: float = field(
        default=_POLICY.load_floor_requests,
        metadata=_help("a worker with at most this many requests' worth in flight is never over "
                       "the load bound (keeps affinity when the pool is nearly idle)"),
    )
    prefill_weight: float = field(
        default=_POLICY.prefill_weight,
        metadata=_help("cache_aware: cost of one prompt token to prefill"),
    )
    queue_weight: float = field(
        default=_POLICY.queue_weight,
        metadata=_help("cache_aware: cost of one token already in flight"),
    )
    wait_weight: float = field(
        default=_POLICY.wait_weight,
        metadata=_help("cache_aware: cost of one token of prefill queued on a worker beyond the "
                       "candidates' mean, against the prefill a move adds"),
    )
    evict_weight: float = field(
        default=_POLICY.evict_weight,
        metadata=_help("cache_aware: prefill into a cache costs 1 + this x its fill (evictions)"),
    )
    cache_aware_load_factor: float = field(
        default=_POLICY.cache_aware_load_factor,
        metadata=_help("cache_aware: hard guard, no worker above this x mean load"),
    )
    hot_threshold: float = field(
        default=_POLICY.hot_threshold,
        metadata=_help("cache_aware: a prefix this many recent requests share (halved every "
                       "30 s) is hot and gets hot_load_factor as its bound; 0 (default): off, "
                       "a prefix spreads only when waiting on its holder costs more"),
    )
    hot_load_factor: float = field(
        default=_POLICY.hot_load_factor,
        metadata=_help("cache_aware: load bound for a hot prefix's holders (with hot_threshold)"),
    )
    min_match_blocks: int = field(
        default=_POLICY.min_match_blocks,
        metadata=_help("cache_aware: shorter matches count as cold"),
    )
    ring_choices: int = field(
        default=_POLICY.ring_choices,
        metadata=_help("cache_aware: a cold prefix goes to one of the first k workers on the "
                       "ring from its anchor (see spread_guard, pressure_weight)"),
    )
    spread_guard: float = field(
        default=_POLICY.spread_guard,
        metadata=_help("cache_aware: of those k, skip any with more than this x their mean "
                       "requests in flight"),
    )
    pressure_weight: float = field(
        default=_POLICY.pressure_weight,
        metadata=_help("cache_aware: weight of cache turnover against recent requests when "
                       "placing a cold prefix (0: requests only)"),
    )
    walk_past_queued: bool = field(
        default=_POLICY.walk_past_queued,
        metadata=_help("cache_aware: when each of those k would make a new session off a "
                       "shared trunk wait (a prefill queued there), take a worker further along "
                       "the ring with none"),
    )
    candidate_limit: int = field(
        default=_POLICY.candidate_limit,
        metadata=_help("cache_aware: look at the prefix's holders and the first k workers on "
                       "the ring from its anchor (0: every worker)"),
    )
    branch_guard: float = field(
        default=_POLICY.branch_guard,
        metadata=_help("cache_aware: for a request whose known prefix is a trunk other prompts "
                       "went on from (a shared system or tool prompt) and less than half of it, "
                       "a holder of the trunk with more than this x its share of recent "
                       "requests gets no credit for it; with none left the request is placed "
                       "as a cold prefix from the ring position past the trunk (0: never)"),
    )
    volume_guard: float = field(
        default=_POLICY.volume_guard,
        metadata=_help("cache_aware: a holder whose recent routed prompt blocks (cached or "
                       "not) exceed this x its share of the pool's by more than twice the "
                       "request gets no credit for a session's next turn (a request that "
                       "extends a prompt it holds) when the session routed at least half a "
                       "worker's share recently: evens out routed volume (KV memory), the "
                       "session moving to a copy of it (see volume_copy), made only while at "
                       "most a quarter of the pool has prefill queued. 1.1, the default: agent "
                       "sessions with seconds between turns balanced to 1.3x the mean volume "
                       "at no p99 cost; a saturated pool makes no copies. 0: never"),
    )
    volume_copy: bool = field(
        default=_POLICY.volume_copy,
        metadata=_help("cache_aware, with the volume guard: a session over it moves only to a "
                       "worker that holds a copy of its prompt, which a prefill-only request "
                       "makes while its holder keeps serving it, so no request redoes the "
                       "session's history (false: the session moves at once, its next "
                       "request prefills the history there)"),
    )
    volume_refresh: bool = field(
        default=_POLICY.volume_refresh,
        metadata=_help("cache_aware, with volume_copy: an earlier copy of a session that "
                       "lacks turns its holder has had since is copied again (only those turns "
                       "computed there) before the session moves to it, so the move redoes at "
                       "most the last answer, and a whole copy with room takes the session from "
                       "a holder over the guard within its slack (false: the session moves to "
                       "a copy of three quarters as it is)"),
    )
    quick_first_token_s: float = field(
        default=_POLICY.quick_first_token_s,
        metadata=_help("cache_aware: a worker whose engine reports a mean time to first token "
                       "under this many seconds for its recent requests is exempt from the hard "
                       "load bound (0: never)"),
    )
    store: str = field(
        default="memory://",
        metadata=_help("metadata store: memory:// (embedded, one process) or redis://host:port/db"),
    )
    store_prefix: str = field(
        default="affinity", metadata=_help("prefix of every key in the metadata store")
    )
    gateway_id: str = field(
        default="", metadata=_help("this replica's id in the store (default: host:port:pid)")
    )
    rebalance_interval_s: float = field(
        default=5.0, metadata=_help("seconds between telemetry-driven rebalancing rounds")
    )
    normalize: bool = field(default=True, metadata=_help("normalize prompts before routing"))
    trim_line_whitespace: bool = field(
        default=True,
        metadata=_help("normalize: trim spaces and tabs at the end of every line, so a context "
                       "re-rendered with trailing spaces on inner lines still hits"),
    )
    block_chars: int = field(default=64, metadata=_help("fingerprint block size in characters"))
    max_blocks: int = field(
        default=16_384,
        metadata=_help("fingerprint at most this many blocks of a prompt (character blocks, "
                       "or token blocks with --tokenizer-file: 256k tokens at 16 a block)"),
    )
    anchor_blocks: int = field(
        default=4, metadata=_help("blocks that form the ring anchor of a prefix")
    )
    index_capacity: int = field(
        default=1_000_000, metadata=_help("prefix index size bound, in block entries")
    )
    index_ttl_s: float = field(
        default=600.0, metadata=_help("seconds a recorded prefix counts as held by its worker")
    )
    tokenizer_file: str = field(
        default="",
        metadata=_help("the served model's tokenizer.json (local file, HuggingFace tokenizers): "
                       "prompts are keyed by token blocks, exactly as the engine caches them, "
                       "and workers that publish KV events are routed on what they hold. "
                       "Empty: character fingerprints"),
    )
    chat_template: str = field(
        default="reference",
        metadata=_help("chat template the served model renders messages with before "
                       "tokenizing: reference (the reference worker's), or the path of the "
                       "model's tokenizer_config.json or of a Jinja template file (as given to "
                       "vllm serve --chat-template)"),
    )
    kv_block_size: int = field(
        default=16, metadata=_help("tokens per engine KV block (vLLM --block-size)")
    )
    tokenize_threads: int = field(
        default=2, metadata=_help("threads that tokenize prompts off the event loop")
    )
    tokenize_inline_chars: int = field(
        default=4096,
        metadata=_help("prompts of at most this many characters are tokenized on the event "
                       "loop, without the hop to the tokenizer's threads"),
    )
    tokenize_prefix_segments: int = field(
        default=65_536,
        metadata=_help("token segments of recently tokenized prompts kept per gateway, so that "
                       "a prompt extending one (the next turn of a session) is tokenized only "
                       "past what it shares, per tenant; 0: tokenize every prompt whole"),
    )
    kv_events_max_blocks: int = field(
        default=1 << 20,
        metadata=_help("most blocks remembered per event-fed worker (its engine's blocks)"),
    )
    kv_pending_ttl_s: float = field(
        default=10.0,
        metadata=_help("seconds a prompt sent to an event-fed worker counts as held before "
                       "its events confirm it (events view), or as this gateway's own when "
                       "its blocks' store events arrive (hybrid view)"),
    )
    kv_events_view: str = field(
        default="hybrid",
        metadata=_help("how an event-fed worker's cache is seen: hybrid (the modelled index, "
                       "corrected by the events: blocks they report removed, blocks others "
                       "stored) or events (the events alone, plus what this gateway just "
                       "sent there)"),
    )
    kv_events_skew_s: float = field(
        default=0.005,
        metadata=_help("hybrid view: seconds an engine's event batch may be stamped late "
                       "against this gateway's clock (publisher flush, clock offset between "
                       "hosts); an event stamped up to this long after a request ended may "
                       "still predate it"),
    )
    kv_events_settle_s: float = field(
        default=2.0,
        metadata=_help("hybrid view: a removal published before the end of a request that "
                       "carried the block waits for the store admitting that request made; "
                       "it counts once later events show none came, or after this long"),
    )
    chars_per_token: float = field(
        default=4.0, metadata=_help("characters per token, to estimate request cost in tokens")
    )
    default_max_tokens: int = field(
        default=256, metadata=_help("decode budget counted as load when a request sets none")
    )
    max_body_bytes: int = field(
        default=8 * 1024 * 1024, metadata=_help("largest request body accepted (413 above)")
    )
    chat_history_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata=_help("long chats remembered so that their next turn is decoded from its new "
                       "messages on, long completions prompts so that their next turn is "
                       "decoded from what it adds, and long prompt texts so that their next "
                       "turn is fingerprinted past them: at most this many bytes of bodies, and "
                       "of texts, each, in this process's memory only (0: off); size it for the "
                       "contexts of the sessions in flight at once"),
    )
    parse_thread_items: int = field(
        default=4096,
        metadata=_help("a request of at least this many items (chat messages not known from "
                       "its last turn, content parts, tools, batch prompts) is parsed on a "
                       "thread, so that the event loop serves other requests meanwhile "
                       "(0: always on the event loop)"),
    )
    normal_text_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata=_help("long prompt texts the normalization rules rewrote (lines ending in "
                       "spaces, CRLF, ...) remembered with what they made of them, so that a "
                       "text re-sent or extended is rewritten once: at most this many bytes, "
                       "in this process's memory only (0: off)"),
    )
    max_attempts: int = field(
        default=3, metadata=_help("workers tried per request before giving up")
    )
    connect_timeout_s: float = field(
        default=2.0, metadata=_help("timeout to connect to a worker")
    )
    read_timeout_s: float = field(
        default=300.0, metadata=_help("timeout between bytes read from a worker")
    )
    max_connections: int = field(
        default=1024, metadata=_help("connection pool limit towards all workers")
    )
    max_connections_per_worker: int = field(
        default=256, metadata=_help("connection pool limit towards one worker")
    )
    warm_connections: int = field(
        default=2,
        metadata=_help("connections to each healthy HTTP worker opened ahead of any request, "
                       "at each health probe: a burst after the connections went idle (4 s) "
                       "writes its first requests at once, not after the connects of the "
                       "whole burst (0: none)"),
    )
    first_byte_timeout_s: float = field(
        default=0.0,
        metadata=_help("give up on a worker that sent no reply (status line; for a stream, its "
                       "first chunk) within this many seconds and re-route the request (0: no "
                       "limit; a non-streaming reply only starts when it is complete). A worker "
                       "the health probes find down loses its waiting requests to other "
                       "workers either way"),
    )
    response_pin_ttl_s: float = field(
        default=86400.0,
        metadata=_help("how long a Responses API answer stays pinned to the worker that made "
                       "it, for previous_response_id and GET /v1/responses/{id} (seconds; "
                       "the engine's own store bounds how long it keeps them; 0: no pins, "
                       "for engines that share their store: such requests are routed by "
                       "what they carry and unknown ids are the engine's to answer)"),
    )
    stream_idle_timeout_s: float = field(
        default=60.0,
        metadata=_help("end a stream whose worker sent nothing for this many seconds after its "
                       "first chunk, with an SSE error event (counts as a worker failure for "
                       "its circuit breaker; 0: only --read-timeout-s)"),
    )
    breaker_failures: int = field(
        default=5, metadata=_help("consecutive failed attempts that open a worker's circuit "
                                  "breaker (0: no breakers)")
    )
    breaker_cooldown_s: float = field(
        default=5.0, metadata=_help("seconds an open breaker keeps requests away before one "
                                    "trial request (half-open); doubled after a failed trial")
    )
    body_timeout_s: float = field(
        default=30.0, metadata=_help("seconds a client may take to send its request body "
                                     "(408 after that)")
    )
    max_client_connections: int = field(
        default=0, metadata=_help("client connections open at once; one more takes the place "
                                  "of the oldest without a request in progress, or with none "
                                  "such is answered 503 and closed (0: what the open-file "
                                  "limit allows, raised to its hard limit, less "
                                  "--max-connections and 256)")
    )
    idle_timeout_s: float = field(
        default=75.0, metadata=_help("seconds a client connection may stay idle between "
                                     "requests, or take to send a request's head, before the "
                                     "gateway closes it")
    )
    queue_timeout_s: float = field(
        default=5.0, metadata=_help("seconds a request may wait for a free connection to a "
                                    "worker (503 with Retry-After after that)")
    )
    health_interval_s: float = field(
        default=5.0, metadata=_help("seconds between two active health checks of a worker "
                                    "(a round's checks are spread evenly over them)")
    )
    k8s_selector: str = field(
        default="", metadata=_help("Kubernetes label selector (e.g. app=vllm): the ready pods "
                                   "it names are workers, joining and leaving as they change "
                                   "(list and watch; see gateway.discovery)")
    )
    k8s_namespace: str = field(
        default="", metadata=_help("namespace of the --k8s-selector pods (default: the "
                                   "gateway pod's own)")
    )
    k8s_port: str = field(
        default="8000", metadata=_help("the discovered pods' port: a number, or the name of a "
                                       "container port")
    )
    k8s_scheme: str = field(
        default="http", metadata=_help("how discovered pods are spoken to: http or https "
                                       "(OpenAI-compatible), vllm+http or vllm+https (vLLM: "
                                       "tenant namespaces as cache_salt)")
    )
    k8s_api_url: str = field(
        default="", metadata=_help("the Kubernetes API server (default: in-cluster, from "
                                   "KUBERNETES_SERVICE_HOST/PORT)")
    )
    k8s_token_file: str = field(
        default=str(SERVICE_ACCOUNT / "token"),
        metadata=_help("bearer token for the API server, read again for every request"),
    )
    k8s_ca_file: str = field(
        default=str(SERVICE_ACCOUNT / "ca.crt"),
        metadata=_help("CA certificate of the API server"),
    )
    warmup: bool = field(
        default=True,
        metadata=_help("warm a joining worker before it takes its full share: replay the "
                       "prefixes it is about to own as prefill-only requests, then ramp its "
                       "ring weight (see gateway.warmup)"),
    )
    warmup_file: str = field(
        default="", metadata=_help("JSON lines of OpenAI bodies (system prompts) to replay on "
                                   "every joining worker; optional 'tenant' per line")
    )
    warmup_sample: tuple[str, ...] = field(
        default=(),
        metadata=_help("tenants (names as configured with their API keys) whose recent "
                       "prompts the gateway may keep in memory (never in the store or logs) "
                       "and replay on joining workers; '*' = every tenant, '-' = requests "
                       "without an API key; default: none"),
    )
    warmup_peers: int = field(
        default=64,
        metadata=_help("prompts to ask each serving worker for when another joins (reference "
                       "workers with an admin secret export their hottest prompts; the "
                       "gateway replays them and keeps none); 0: do not ask"),
    )
    warmup_budget_s: float = field(
        default=30.0, metadata=_help("most seconds a warm-up may take before the worker serves")
    )
    warmup_ramp_s: float = field(
        default=10.0, metadata=_help("seconds a warmed worker's ring weight takes to grow from "
                                     "a quarter to its full value")
    )
    warmup_cache_fraction: float = field(
        default=0.5, metadata=_help("share of a joining worker's cache the warm-up may fill")
    )
    warmup_concurrency: int = field(
        default=2, metadata=_help("warm-up requests in flight at once on a joining worker")
    )
    lean_http: bool = field(
        default=True,
        metadata=_help("serve plain completion requests (a Content-Length body of at most "
                       "64 KiB, not a stream) and the GETs of the health, model, metrics and "
                       "worker views on the gateway's lean HTTP/1.1 path instead of aiohttp's "
                       "request and response objects; any other request hands its connection "
                       "to aiohttp (see gateway.contracts.lean_http)"),
    )
    prewarm: bool = field(
        default=True,
        metadata=_help("predictive pre-warming: when a hot prefix's holder nears its load "
                       "bound, replay the prefix on the next holder before the spread "
                       "(see gateway.prewarm)"),
    )
    prewarm_whole: bool = field(
        default=False,
        metadata=_help("a pre-warm replays the whole request, not only the prefix its holder "
                       "held (the part past it is usually that request's own: a question, a "
                       "session's history)"),
    )
    prewarm_fraction: float = field(
        default=0.8, metadata=_help("share of the holder's load bound at which a hot prefix "
                                    "is pre-warmed on its next holder")
    )
    copy_priority: int = field(
        default=0,
        metadata=_help("the 'priority' a session copy (the volume guard's, see "
                       "gateway.prewarm) is sent with, to engines that run priority "
                       "scheduling (vLLM --scheduling-policy priority: lower values run "
                       "first, 0 is a request's default): a positive value prefills the "
                       "copy with the capacity the requests there leave. Each vLLM engine "
                       "(and reference worker) is asked first with a one-token request; one "
                       "on first-come-first-served scheduling refuses it, and engines that "
                       "read priorities otherwise (SGLang, llama.cpp) are not asked: their "
                       "copies go without one. 0: never sent, nobody asked (a session's next "
                       "turn may reach a yielding copy before it ran, and compute it again)"),
    )
    shutdown_timeout_s: float = field(
        default=30.0, metadata=_help("seconds in-flight requests get to finish on shutdown")
    )
    procs: int = field(
        default=1,
        metadata=_help("gateway processes serving the port (SO_REUSEPORT); they keep affinity "
                       "with each other through the store, or with memory:// through a hub "
                       "in the parent process"),
    )
    reuse_port: bool = field(
        default=False, metadata=_help("bind the port with SO_REUSEPORT (each of --procs does)")
    )
    event_loop: str = field(
        default="auto", metadata=_help("event loop: auto (uvloop when installed), uvloop, asyncio")
    )
    access_log: str = field(
        default="json", metadata=_help(f"one line per request: {', '.join(ACCESS_LOG_MODES)}")
    )
    otel_endpoint: str = field(
        default="", metadata=_help("OpenTelemetry: OTLP endpoint to export traces to, e.g. "
                                   "http://collector:4318 (http) or http://collector:4317 "
                                   "(grpc); empty: tracing off")
    )
    otel_protocol: str = field(
        default="http", metadata=_help(f"OTLP protocol: {', '.join(PROTOCOLS)}")
    )
    otel_sample_ratio: float = field(
        default=1.0, metadata=_help("share of new traces sampled, 0-1 (a sampled caller's "
                                    "trace is always followed)")
    )
    otel_service_name: str = field(
        default="affinity-gateway", metadata=_help("service.name of the exported spans")
    )

    api_key: tuple[str, ...] = field(
        default=(), repr=False,
        metadata=_secret("an API key clients must send as 'Authorization: Bearer KEY', with its "
                         "tenant: KEY:TENANT (tenant names contain no ':'). With any key "
                         "configured every /v1/* call needs one"),
    )
    api_keys_file: str = field(
        default="",
        metadata=_help("file of salted key hashes, one 'TENANT sha256$SALT$DIGEST' per line "
                       "(python -m gateway.auth hash-key writes one); re-read on SIGHUP"),
    )
    admin_token: str = field(
        default="", repr=False,
        metadata=_secret("token for /admin/* ('Authorization: Bearer TOKEN' or "
                         "'x-admin-token: TOKEN'); prefer GATEWAY_ADMIN_TOKEN or "
                         "--admin-token-file"),
    )
    admin_token_file: str = field(
        default="", metadata=_help("file holding the admin token (instead of --admin-token)")
    )
    tls_cert_file: str = field(
        default="",
        metadata=_help("serve the client port over HTTPS with this certificate (PEM, may hold "
                       "the chain); needs --tls-key-file; SIGHUP reloads both"),
    )
    tls_key_file: str = field(
        default="", metadata=_help("the private key (PEM) of --tls-cert-file")
    )
    worker_ca_file: str = field(
        default="",
        metadata=_help("verify https:// workers against this CA bundle (PEM) instead of the "
                       "system's"),
    )
    worker_cert_file: str = field(
        default="",
        metadata=_help("client certificate (PEM) presented to https:// workers (mutual TLS); "
                       "needs --worker-key-file"),
    )
    worker_key_file: str = field(
        default="", metadata=_help("the private key (PEM) of --worker-cert-file")
    )
    admin_port: int = field(
        default=0,
        metadata=_help("also serve on 127.0.0.1:PORT, where /admin/* needs no token (0: off)"),
    )
    metrics_auth: bool = field(
        default=False, metadata=_help("/metrics needs the admin token too")
    )
    route_headers: str = field(
        default="",
        metadata=_help("who sees the x-route-*, x-prefix-*, x-cache-* and Server-Timing "
                       "headers: all, admin (requests with the admin token) or none; default: "
                       "none when API keys are configured, else all"),
    )
    cors_origin: tuple[str, ...] = field(
        default=(),
        metadata=_help("an origin whose web pages may call the client API from a browser "
                       "(CORS), e.g. http://localhost:3000; * for any; none by default"),
    )
    tenant_secret: str = field(
        default="", repr=False,
        metadata=_secret("server secret of the keyed hashes that name tenants and cache "
                         "namespaces outside the process (Redis, workers); replicas sharing a "
                         "store need the same one. Prefer GATEWAY_TENANT_SECRET or "
                         "--tenant-secret-file"),
    )
    tenant_secret_file: str = field(
        default="", metadata=_help("file holding the tenant secret")
    )
    registry_secret: str = field(
        default="", repr=False,
        metadata=_secret("shared secret of signed worker registrations: registry entries "
                         "without a valid signature are ignored, so write access to the store "
                         "alone cannot add a worker (workers sign with their "
                         "--registry-secret). Prefer GATEWAY_REGISTRY_SECRET or "
                         "--registry-secret-file"),
    )
    registry_secret_file: str = field(
        default="", metadata=_help("file holding the registration secret")
    )
    worker_api_key: str = field(
        default="", repr=False,
        metadata=_secret("API key the gateway sends to workers ('Authorization: Bearer'), e.g. "
                         "a vLLM started with --api-key; a worker URL's ?api_key_env=NAME or "
                         "?api_key_file=PATH overrides it for that worker"),
    )
    worker_api_key_file: str = field(
        default="", metadata=_help("file holding --worker-api-key")
    )
    worker_admin_token: str = field(
        default="", repr=False,
        metadata=_secret("token for workers' /admin/* (cache flush on a model change, hot "
                         "prompts for a warm-up); default: the worker's API key"),
    )
    max_worker_weight: float = field(
        default=4.0,
        metadata=_help("most ring weight a registered worker gets from its cache size, as a "
                       "multiple of the pool's median; its claim counts only once its own "
                       "/metrics confirm it"),
    )
    tenant_rpm: float = field(
        default=0.0, metadata=_help("requests per minute one tenant may send (token bucket, "
                                    "bursts up to a minute's worth; 0: no limit)")
    )
    tenant_tpm: float = field(
        default=0.0, metadata=_help("tokens per minute one tenant may use, prompt plus "
                                    "max_tokens as estimated at admission (0: no limit)")
    )
    tenant_concurrency: int = field(
        default=0, metadata=_help("requests one tenant may have in flight (0: no limit)")
    )
    max_inflight: int = field(
        default=0, metadata=_help("requests the gateway serves at once; more wait in a "
                                  "bounded queue (0: no limit)")
    )
    max_queue: int = field(
        default=256, metadata=_help("requests that may wait for --max-inflight; beyond: 429")
    )
    max_held_body_bytes: int = field(
        default=1 << 30,
        metadata=_help("request body bytes the gateway holds at once, all requests together "
                       "(as received, from before each is read until it is answered); a body "
                       "that does not fit is refused with 429 before it is read (0: no limit; "
                       "else at least --max-body-bytes)"),
    )
    admission_timeout_s: float = field(
        default=10.0, metadata=_help("longest wait in the --max-inflight queue before a 429")
    )

    def __post_init__(self) -> None:
        if min(self.tenant_rpm, self.tenant_tpm, self.tenant_concurrency, self.max_inflight,
               self.max_queue, self.admission_timeout_s, self.max_held_body_bytes) < 0:
            raise ValueError("limits must be >= 0")
        if self.route_headers not in ("", *ROUTE_HEADER_MODES):
            raise ValueError(
                f"route_headers must be one of {', '.join(ROUTE_HEADER_MODES)}, "
                f"got {self.route_headers!r}"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if bool(self.worker_cert_file) != bool(self.worker_key_file):
            raise ValueError("--worker-cert-file and --worker-key-file go together")
        for origin in self.cors_origin:
            normal_origin(origin)  # raises ValueError for what is not an origin
        if not 0 <= self.admin_port <= 65535:
            raise ValueError(f"admin_port must be in 0..65535, got {self.admin_port}")
        if self.k8s_scheme not in K8S_SCHEMES:
            raise ValueError(f"k8s_scheme must be one of {', '.join(K8S_SCHEMES)}, "
                             f"got {self.k8s_scheme!r}")
        if not self.k8s_port or (self.k8s_port.isdigit()
                                 and not 0 < int(self.k8s_port) <= 65535):
            raise ValueError(f"k8s_port must be a port number or a port name, "
                             f"got {self.k8s_port!r}")
        if self.max_worker_weight < 1:
            raise ValueError("max_worker_weight must be >= 1")
        if self.policy not in POLICY_NAMES:
            raise ValueError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}"
            )
        build_engine(self.policy, self.policy_options())  # validates the policy settings
        if min(self.first_byte_timeout_s, self.stream_idle_timeout_s, self.breaker_cooldown_s,
               self.breaker_failures) < 0:
            raise ValueError(
                "first_byte_timeout_s, stream_idle_timeout_s, breaker_* must not be negative")
        if self.body_timeout_s <= 0 or self.queue_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("body_timeout_s, queue_timeout_s and idle_timeout_s must be "
                             "positive")
        if self.warm_connections < 0:
            raise ValueError("warm_connections must be >= 0")
        if self.response_pin_ttl_s < 0:
            raise ValueError("response_pin_ttl_s must be >= 0")
        if self.max_attempts < 1 or self.max_body_bytes < 1 or self.chars_per_token <= 0:
            raise ValueError("max_attempts, max_body_bytes and chars_per_token must be positive")
        if self.chat_history_bytes < 0:
            raise ValueError("chat_history_bytes must be >= 0")
        if 0 < self.max_held_body_bytes < self.max_body_bytes:
            # A body the budget could never hold would be told to retry for ever.
            raise ValueError("max_held_body_bytes must be 0 (no budget) or at least "
                             "max_body_bytes")
        if min(self.normal_text_bytes, self.parse_thread_items, self.max_client_connections) < 0:
            raise ValueError("normal_text_bytes, parse_thread_items and max_client_connections "
                             "must be >= 0")
        self.fingerprint_options()  # validates the block settings
        self._tokenizer_options("")  # validates the tokenizer settings, file or not
        if self.chat_template != "reference" and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template {self.chat_template!r}: no such file")
        if self.kv_events_max_blocks < 1 or self.kv_pending_ttl_s < 0:
            raise ValueError("kv_events_max_blocks must be >= 1 and kv_pending_ttl_s >= 0")
        if self.kv_events_view not in ("hybrid", "events"):
            raise ValueError("kv_events_view must be hybrid or events")
        if self.kv_events_settle_s < 0 or self.kv_events_skew_s < 0:
            raise ValueError("kv_events_settle_s and kv_events_skew_s must be >= 0")
        if self.procs < 1:
            raise ValueError("procs must be >= 1")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}")
        if self.warmup_budget_s < 0 or self.warmup_ramp_s < 0 or self.warmup_concurrency < 1:
            raise ValueError("warmup_budget_s and warmup_ramp_s must be >= 0, "
                             "warmup_concurrency >= 1")
        if not 0.0 < self.prewarm_fraction <= 1.0:
            raise ValueError("prewarm_fraction must be in (0, 1]")
        if self.warmup_peers < 0:
            raise ValueError("warmup_peers must be >= 0")
        if not 0.0 < self.warmup_cache_fraction <= 1.0:
            raise ValueError("warmup_cache_fraction must be in (0, 1]")
        if self.access_log not in ACCESS_LOG_MODES:
            raise ValueError(f"access_log must be one of {', '.join(ACCESS_LOG_MODES)}, "
                             f"got {self.access_log!r}")
        self.tracing_options()  # validates the OpenTelemetry settings
        if not self.store.startswith(("memory://", "redis://", "rediss://", "unix://", "hub://")):
            raise ValueError(f"store must be memory:// or a redis:// URL, got {self.store!r}")

    def tokenizer_options(self) -> TokenizerOptions | None:
        return self._tokenizer_options(self.tokenizer_file) if self.tokenizer_file else None

    def _tokenizer_options(self, path: str) -> TokenizerOptions:
        return TokenizerOptions(
            path=path, block_size=self.kv_block_size,
            max_blocks=self.max_blocks, anchor_blocks=self.anchor_blocks,
            threads=self.tokenize_threads,
            chat_template=self.chat_template,
            prefix_store=PrefixStoreOptions(max_segments=self.tokenize_prefix_segments),
            inline_chars=self.tokenize_inline_chars,
        )

    def fingerprint_options(self) -> FingerprintOptions:
        """The same object for every request (built once per distinct setting)."""
        return _fingerprint_options(self.block_chars, self.max_blocks, self.anchor_blocks)

    def tracing_options(self) -> TracingOptions:
        return TracingOptions(self.otel_endpoint, self.otel_protocol, self.otel_sample_ratio,
                              self.otel_service_name)

    def normalize_options(self) -> NormalizeOptions:
        return _normalize_options(self.normalize, self.trim_line_whitespace)

    def policy_options(self) -> PolicyOptions:
        """Every :class:`PolicyOptions` field is a setting of the same name (and default)."""
        return PolicyOptions(**{f.name: getattr(self, f.name) for f in fields(PolicyOptions)})

    def kubernetes_options(self) -> KubernetesOptions | None:
        """Pod discovery's options; None without ``--k8s-selector``."""
        if not self.k8s_selector:
            return None
        return KubernetesOptions(
            selector=self.k8s_selector, namespace=self.k8s_namespace, port=self.k8s_port,
            scheme=self.k8s_scheme, api_url=self.k8s_api_url, token_file=self.k8s_token_file,
            ca_file=self.k8s_ca_file)

    def limit_options(self) -> LimitOptions:
        return LimitOptions(
            tenant_rpm=self.tenant_rpm, tenant_tpm=self.tenant_tpm,
            tenant_concurrency=self.tenant_concurrency, max_inflight=self.max_inflight,
            max_queue=self.max_queue, queue_timeout_s=self.admission_timeout_s,
            max_held_body_bytes=self.max_held_body_bytes,
        )

    def sampled_tenants(self) -> frozenset[str]:
        """Tenant names of ``warmup_sample`` ('-' is the tenant of requests without a key)."""
        return frozenset("" if t == "-" else t for t in self.warmup_sample)

    def replica_id(self) -> str:
        return self.gateway_id or f"{self.host}:{self.port}:{os.getpid()}"

    def tokens_per_block(self) -> float:
        """Tokens in one fingerprint block, to convert worker cache sizes into blocks."""
        return self.block_chars / self.chars_per_token


@functools.cache
def _fingerprint_options(
    block_chars: int, max_blocks: int, anchor_blocks: int
) -> FingerprintOptions:
    return FingerprintOptions(block_chars, max_blocks, anchor_blocks)


@functools.cache
def _normalize_options(enabled: bool, trim_lines: bool) -> NormalizeOptions:
    return NormalizeOptions(enabled=enabled, line_trailing_whitespace=trim_lines)


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> GatewaySettings:
    return load_settings(
        GatewaySettings,
        argv,
        env_prefix="GATEWAY_",
        prog="python -m gateway",
        description="Cache-affinity routing gateway for OpenAI-compatible LLM servers.",
        environ=environ,
    )
