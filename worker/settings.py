"""Settings of ``python -m worker``: one frozen dataclass, from flags and ``WORKER_*`` env."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.config import SettingsError, load_settings

ENGINES = ("sim",)

DESCRIPTION = (
    "Reference OpenAI-compatible inference worker with a real paged prefix cache and a "
    "SIMULATED engine (no model runs: prefill/decode time follows a cost model). Reports "
    "what it reused from its cache in every response (usage + x-cache-* headers) and serves "
    "vLLM-named Prometheus metrics."
)


@dataclass(frozen=True)
class WorkerSettings:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=8001, metadata={"help": "TCP port to listen on."})
    engine: str = field(
        default="sim",
        metadata={"help": "Inference engine. Only 'sim' (simulated engine with real cache "
                  "bookkeeping) exists today."},
    )
    model: str = field(
        default="sim-model",
        metadata={"help": "Served model name; requests naming another model get 404."},
    )
    cache_blocks: int = field(
        default=2048, metadata={"help": "KV cache size in blocks (of --block-size tokens)."}
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV cache block."})
    max_running: int = field(
        default=8,
        metadata={"help": "Most requests running at once; the rest wait in a FIFO queue."},
    )
    prefill_us_per_token: float = field(
        default=200.0,
        metadata={"help": "Simulated prefill cost per UNCACHED prompt token, microseconds."},
    )
    prefill_us_per_cached_token: float = field(
        default=5.0,
        metadata={"help": "Simulated prefill cost per cached prompt token, microseconds."},
    )
    decode_ms_per_token: float = field(
        default=5.0,
        metadata={"help": "Simulated time between output tokens, milliseconds (the first "
                  "token comes right after prefill)."},
    )
    tokenizer_file: str = field(
        default="",
        metadata={"help": "Optional local HuggingFace tokenizers JSON (needs the 'tokenizers' "
                  "package). Empty: built-in deterministic hash tokenizer (~3-4 chars/token)."},
    )
    max_model_len: int = field(
        default=32768,
        metadata={"help": "Most tokens per sequence (prompt + max_tokens); longer requests "
                  "get 400."},
    )
    worker_id: str = field(
        default="", metadata={"help": "Identity reported in /stats and x-worker-id; "
                              "empty means HOST:PORT."}
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise SettingsError(
                f"engine {self.engine!r} is not available; choose one of: {', '.join(ENGINES)}"
            )
        positive = {
            "cache_blocks": self.cache_blocks, "block_size": self.block_size,
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

    @property
    def effective_worker_id(self) -> str:
        return self.worker_id or f"{self.host}:{self.port}"


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
