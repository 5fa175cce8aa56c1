"""Settings of ``python -m worker``: one frozen dataclass, from flags and ``WORKER_*`` env."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.contracts.config import SettingsError, load_settings
from gateway.contracts.registry_signing import load_secret
from gateway.contracts.tracing import TracingOptions
from worker.kvcache import Reuse
from worker.ranks import rank_endpoint

ENGINES = ("sim", "torch", "vllm")
TOKENIZERS = ("hash", "chars")
DEVICES = ("auto", "cpu", "cuda")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
SIM_DEFAULT_CACHE_BLOCKS = 2048
MAX_DATA_PARALLEL_SIZE = 64

DESCRIPTION = (
    "Reference OpenAI-compatible inference worker with a real paged prefix cache. Engines: "
    "'sim' (SIMULATED: no model runs, prefill/decode time follows a cost model) and 'torch' (a "
    "small PyTorch decoder whose attention reads K/V from the paged cache, so prefix hits skip "
    "real prefill compute; needs the optional 'torch' extra). Reports what it reused from its "
    "cache in every response (usage + x-cache-* headers) and serves vLLM-named Prometheus "
    "metrics."
)


SCHEDULING_POLICIES = ("fcfs", "priority")
CACHE_REUSE = tuple(rule.value for rule in Reuse)


@dataclass(frozen=True)
class WorkerSettings:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=8001, metadata={"help": "TCP port to listen on."})
    engine: str = field(
        default="sim",
        metadata={"help": "Inference engine: 'sim' (simulated engine with real cache "
                  "bookkeeping) or 'torch' (real PyTorch decoder on the paged KV cache)."},
    )
    model: str = field(
        default="sim-model",
        metadata={"help": "Served model name; requests naming another model get 404."},
    )
    cache_blocks: int = field(
        default=0,
        metadata={"help": "KV cache size in blocks (of --block-size tokens). 0: automatic, "
                  f"{SIM_DEFAULT_CACHE_BLOCKS} for the sim engine, --cache-memory-fraction of "
                  "available memory for the torch engine."},
    )
    cache_memory_fraction: float = field(
        default=0.1,
        metadata={"help": "Torch engine with --cache-blocks 0: fraction of the memory available "
                  "after loading the model (free GPU memory on CUDA, MemAvailable on CPU) "
                  "given to the KV block pool."},
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV cache block."})
    max_running: int = field(
        default=8,
        metadata={"help": "Most requests running at once; the rest wait in a FIFO queue."},
    )
    data_parallel_size: int = field(
        default=1,
        metadata={"help": "Data-parallel engine ranks behind this one endpoint, as vLLM's "
                  "--data-parallel-size: N engines, each with its own KV cache of "
                  "--cache-blocks (0: every rank the size the first rank's automatic sizing "
                  "gives). A request names its rank in the X-data-parallel-rank "
                  "header, else the least loaded rank runs it. /metrics labels each rank's "
                  "series engine=\"<rank>\"; rank r publishes its KV events at the ports of "
                  f"--kv-events and --kv-replay plus r. From 1 to {MAX_DATA_PARALLEL_SIZE}; "
                  "not with --store."},
    )
    stored_responses: int = field(
        default=1024,
        metadata={"help": "Responses API answers kept for previous_response_id and "
                  "GET /v1/responses/{id} (the oldest go first; 0: none kept)."},
    )
    prefill_us_per_token: float = field(
        default=200.0,
        metadata={"help": "Simulated prefill cost per UNCACHED prompt token, microseconds."},
    )
    prefill_us_per_cached_token: float = field(
        default=5.0,
        metadata={"help": "Simulated prefill cost per cached prompt token, microseconds."},
    )
    prefill_shared: bool = field(
        default=False,
        metadata={"help": "Simulated prefills share one engine's compute: while n requests "
                  "are in prefill each progresses at 1/n of its speed, as prompts batched "
                  "into an engine's steps do (off: each takes its own time whatever else "
                  "runs, so a loaded worker is no slower than an idle one)."},
    )
    cache_reuse: str = field(
        default="scheduled",
        metadata={"help": "The simulated engine's cache: when a request's new blocks are "
                  "reused by other requests. 'scheduled' (vLLM's rule): once the engine "
                  "begins computing them, a request reusing them getting its first token only "
                  "after that computation; 'computed': once the request's prefill is done (a "
                  "request arriving before computes them again, as an engine that caches after "
                  "each prefill does); 'admitted': from the request's admission on, even while "
                  "the engine has not begun it (a request of a lower priority), which flatters "
                  "any router that sends a prompt where its copy has not run yet."},
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={"help": "As vLLM's --scheduling-policy: 'fcfs' refuses a request whose "
                  "'priority' is not 0; 'priority' takes it, and while requests of several "
                  "priorities are in prefill (with --prefill-shared) only those with the "
                  "lowest value progress."},
    )
    decode_ms_per_token: float = field(
        default=5.0,
        metadata={"help": "Simulated time between output tokens, milliseconds (the first "
                  "token comes right after prefill)."},
    )
    tokenizer: str = field(
        default="hash",
        metadata={"help": "Built-in tokenizer when --tokenizer-file is empty: 'hash' (GPT-2 "
                  "regex pieces, ~3-4 chars/token) or 'chars' (one token per 4 characters, "
                  "the gateway's own estimate: text cut at multiples of 4 x --block-size "
                  "characters is cut at block boundaries)."},
    )
    tokenizer_file: str = field(
        default="",
        metadata={"help": "Optional local HuggingFace tokenizers JSON (needs the 'tokenizers' "
                  "package). Empty: built-in deterministic hash tokenizer (~3-4 chars/token)."},
    )
    chat_template: str = field(
        default="reference",
        metadata={"help": "Chat template: 'reference' (this worker's format), or the path of "
                  "a model's tokenizer_config.json or of a Jinja template file, rendered as "
                  "vLLM renders it (--chat-template)."},
    )
    max_model_len: int = field(
        default=32768,
        metadata={"help": "Most tokens per sequence (prompt + max_tokens); longer requests "
                  "get 400."},
    )
    model_config: str = field(
        default="small",
        metadata={"help": "Torch engine: model shape, a preset (tiny, small, bench, gpu) or the "
                  "path of a JSON file with ModelConfig fields (vocab_size, hidden_size, "
                  "num_layers, num_heads, num_kv_heads, ...)."},
    )
    model_weights: str = field(
        default="",
        metadata={"help": "Torch engine: local safetensors file with the weights (needs the "
                  "'safetensors' package). Empty: random weights from --model-seed."},
    )
    model_seed: int = field(
        default=0, metadata={"help": "Torch engine: seed of the random weights."}
    )
    device: str = field(
        default="auto",
        metadata={"help": "Torch engine: auto (CUDA when available), cpu or cuda."},
    )
    model_dtype: str = field(
        default="float32",
        metadata={"help": "Torch engine: weights and activations dtype (float32, bfloat16, "
                  "float16)."},
    )
    kv_dtype: str = field(
        default="auto",
        metadata={"help": "Torch engine: KV cache dtype. auto (= --model-dtype), float32, "
                  "bfloat16, float16 or int8 (per-block scales: a quarter of float32's "
                  "memory)."},
    )
    report_cache_size: bool = field(
        default=True,
        metadata={"help": "Publish the KV cache geometry as vllm:cache_config_info on "
                  "/metrics (as vLLM does); --no-report-cache-size leaves it out, like an "
                  "engine that does not report it."},
    )
    reported_cache_blocks: int = field(
        default=0,
        metadata={"help": "Cache size (blocks) published in vllm:cache_config_info and the "
                  "registry instead of the real one; 0: the real size. For experiments with "
                  "workers that misreport their cache."},
    )
    worker_id: str = field(
        default="", metadata={"help": "Identity reported in /stats and x-worker-id; "
                              "empty means HOST:PORT of --public-url."}
    )
    store: str = field(
        default="",
        metadata={"help": "Metadata store to register in (redis://host:port/db), so gateways "
                  "route to this worker without being told; empty: no registration."},
    )
    store_prefix: str = field(
        default="affinity", metadata={"help": "Key prefix in the store (as the gateway's)."}
    )
    public_url: str = field(
        default="",
        metadata={"help": "URL gateways reach this worker at; empty: http://HOST:PORT (the "
                  "machine's host name when HOST is 0.0.0.0)."},
    )
    heartbeat_s: float = field(
        default=1.0, metadata={"help": "Seconds between registry heartbeats."}
    )
    vllm_binary: str = field(
        default="vllm",
        metadata={"help": "--engine vllm: the command that runs vLLM (its 'serve' subcommand "
                  "and the arguments after -- are appended)."},
    )
    startup_timeout_s: float = field(
        default=900.0, metadata={"help": "--engine vllm: seconds to wait for vLLM's /health."}
    )
    kv_events: str = field(
        default="",
        metadata={"help": "Publish KV-cache events (vLLM's ZMQ format) on this endpoint, e.g. "
                  "tcp://*:5557; gateways subscribe to know exactly what the cache holds. "
                  "Empty: no events."},
    )
    kv_replay: str = field(
        default="",
        metadata={"help": "With --kv-events: serve missed event batches on this ROUTER "
                  "endpoint, e.g. tcp://*:5558."},
    )
    kv_events_buffer: int = field(
        default=10_000,
        metadata={"help": "Event batches kept for replay."},
    )
    model_revision: str = field(
        default="",
        metadata={"help": "Model version reported in /v1/models ('revision': a commit, a "
                  "weights hash); gateways flush this worker's cache and their index when it "
                  "changes. Empty: derived from the engine (weights file, seed)."},
    )
    hot_prompts: int = field(
        default=64,
        metadata={"help": "Prefixes whose latest prompt this worker keeps in memory for a "
                  "gateway warming a new peer (GET /admin/hot-prompts, answered only with "
                  "--admin-token or --api-key set); 0 keeps none."},
    )
    cache_ttl_s: float = field(
        default=0.0,
        metadata={"help": "Drop cached blocks no request has used for this many seconds "
                  "(0: keep them until evicted)."},
    )
    registry_ttl_s: float = field(
        default=3.0,
        metadata={"help": "The registry entry expires this long after the last heartbeat, "
                  "so a dead worker leaves routing within a few seconds."},
    )
    otel_endpoint: str = field(
        default="", metadata={"help": "OpenTelemetry: OTLP endpoint to export traces to "
                              "(continuing the gateway's traces); empty: tracing off."}
    )
    otel_protocol: str = field(default="http", metadata={"help": "OTLP protocol: http, grpc."})
    otel_sample_ratio: float = field(
        default=1.0, metadata={"help": "Share of traces started here that are sampled, 0-1 "
                               "(a sampled caller's trace is always followed)."}
    )
    otel_service_name: str = field(
        default="affinity-worker", metadata={"help": "service.name of the exported spans."}
    )

    api_key: str = field(
        default="", repr=False,
        metadata={"help": "If set, every /v1/* request needs 'Authorization: Bearer KEY' (as "
                  "vLLM's --api-key); the gateway sends it (its --worker-api-key). Prefer "
                  "WORKER_API_KEY in the environment.", "secret": True},
    )
    admin_token: str = field(
        default="", repr=False,
        metadata={"help": "Token for /admin/* ('Authorization: Bearer TOKEN'); without one the "
                  "--api-key guards them, and with neither they are open. Prefer "
                  "WORKER_ADMIN_TOKEN.", "secret": True},
    )

    registry_secret: str = field(
        default="", repr=False,
        metadata={"help": "Sign the registry record with this shared secret (the gateways' "
                  "--registry-secret), so that gateways that require signatures accept it. "
                  "Prefer WORKER_REGISTRY_SECRET or --registry-secret-file.", "secret": True},
    )
    registry_secret_file: str = field(
        default="", metadata={"help": "File holding --registry-secret (its first line)."}
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise SettingsError(
                f"engine {self.engine!r} is not available; choose one of: {', '.join(ENGINES)}"
            )
        if self.tokenizer not in TOKENIZERS:
            raise SettingsError(
                f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}"
            )
        if self.cache_blocks < 0 or self.reported_cache_blocks < 0:
            raise SettingsError("cache_blocks and reported_cache_blocks must be >= 0")
        if not 0.0 < self.cache_memory_fraction <= 0.95:
            raise SettingsError(
                f"cache_memory_fraction must be in (0, 0.95], got {self.cache_memory_fraction}"
            )
        choices = {
            "device": (self.device, DEVICES),
            "model_dtype": (self.model_dtype, MODEL_DTYPES),
            "kv_dtype": (self.kv_dtype, KV_DTYPES),
            "scheduling_policy": (self.scheduling_policy, SCHEDULING_POLICIES),
            "cache_reuse": (self.cache_reuse, CACHE_REUSE),
        }
        for name, (choice, allowed) in choices.items():
            if choice not in allowed:
                raise SettingsError(f"{name} must be one of {', '.join(allowed)}, got {choice!r}")
        positive = {
            "block_size": self.block_size,
            "max_running": self.max_running, "max_model_len": self.max_model_len,
        }
        for name, value in positive.items():
            if value < 1:
                raise SettingsError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in 0..65535, got {self.port}")
        costs = {
            "prefill_us_per_token": self.prefill_us_per_token,
            "prefill_us_per_cached_token": self.prefill_us_per_cached_token,
            "decode_ms_per_token": self.decode_ms_per_token,
        }
        for name, cost in costs.items():
            if not cost >= 0.0:
                raise SettingsError(f"{name} must be >= 0, got {cost}")
        if not self.model:
            raise SettingsError("model must not be empty")
        if self.store and not self.store.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"store must be a redis:// URL, got {self.store!r}")
        if self.kv_replay and not self.kv_events:
            raise SettingsError("kv_replay needs kv_events")
        for name, endpoint in (("kv_events", self.kv_events), ("kv_replay", self.kv_replay)):
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise SettingsError(f"{name} must be a tcp:// or ipc:// endpoint, got "
                                    f"{endpoint!r}")
        self._check_data_parallel()
        if self.kv_events_buffer < 1:
            raise SettingsError("kv_events_buffer must be >= 1")
        if self.hot_prompts < 0:
            raise SettingsError(f"hot_prompts must be >= 0, got {self.hot_prompts}")
        if self.cache_ttl_s < 0:
            raise SettingsError(f"cache_ttl_s must be >= 0, got {self.cache_ttl_s}")
        if self.heartbeat_s <= 0 or self.registry_ttl_s <= self.heartbeat_s:
            raise SettingsError("need 0 < heartbeat_s < registry_ttl_s")
        try:
            self.tracing_options()
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc

    def _check_data_parallel(self) -> None:
        size = self.data_parallel_size
        if not 1 <= size <= MAX_DATA_PARALLEL_SIZE:
            raise SettingsError(
                f"data_parallel_size must be from 1 to {MAX_DATA_PARALLEL_SIZE}, got {size}")
        for endpoint in (self.kv_events, self.kv_replay):
            try:
                rank_endpoint(endpoint, size - 1)
            except ValueError as exc:
                raise SettingsError(str(exc)) from exc
        bound = [rank_endpoint(e, r) for e in (self.kv_events, self.kv_replay) if e
                 for r in range(size)]
        if len(set(bound)) < len(bound):
            raise SettingsError(
                f"with data_parallel_size {size} the KV-event endpoints {self.kv_events!r} and "
                f"{self.kv_replay!r} overlap (rank r binds both ports + r): leave {size} ports "
                "between them")

    def registration_secret(self) -> bytes:
        try:
            return load_secret(self.registry_secret, self.registry_secret_file)
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc

    def tracing_options(self) -> TracingOptions:
        return TracingOptions(self.otel_endpoint, self.otel_protocol, self.otel_sample_ratio,
                              self.otel_service_name)

    @property
    def effective_public_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def advertised(self, endpoint: str) -> str:
        """``endpoint`` as others can reach it: a wildcard host becomes the public host."""
        if not endpoint.startswith("tcp://"):
            return endpoint
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", "::"):
            host = urlsplit(self.effective_public_url).hostname or host
        return f"tcp://{host}:{port}"

    @property
    def effective_worker_id(self) -> str:
        if self.worker_id:
            return self.worker_id
        parts = urlsplit(self.effective_public_url)
        return f"{parts.hostname}:{parts.port or 80}"


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> WorkerSettings:
    return load_settings(
        WorkerSettings,
        argv,
        env_prefix="WORKER_",
        prog="python -m worker",
        description=DESCRIPTION,
        environ=environ,
    )
