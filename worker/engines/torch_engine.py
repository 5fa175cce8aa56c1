"""A REAL inference engine: the :mod:`worker.model` decoder over the worker's paged KV cache.

Admission is the sim engine's (:class:`~worker.engines.admission.AdmissionQueue`: FIFO,
``max_running`` slots, blocks from :class:`~worker.kvcache.PrefixCache`); each request also
reserves private slots for the ``max_tokens - 1`` tokens it will decode, so decode never runs out
of blocks. Block id ``b`` of the cache is row ``b`` of the :class:`~worker.model.KVPool` tensor.

Prefill runs the model on the uncached positions only (``matched_tokens ..``); when the whole
prompt is cached, the last prompt token is recomputed (without rewriting its K/V) to get the
logits. Decode is greedy (argmax; sampling parameters are ignored) and appends one token's K/V per
step. Output text is one piece per token: the tokenizer's ``decode`` when it has one, else a
deterministic pseudo-word per token id (the hash tokenizer cannot be inverted).

Threading: forward passes run on one dedicated thread (a single-worker executor), one at a time,
so the event loop keeps serving. Jobs run in submission order and a request submits its prefill
the moment its blocks are allocated, so a request that matched blocks another request is still
computing always runs after that computation. Jobs are never cancelled once submitted (a
cancelled request's job still runs; the blocks of a request cancelled before its prefill ran, or
whose prefill failed, are unregistered so nobody reuses them). The cache itself is only touched on
the event loop.

Token ids are taken modulo the model's vocabulary; an empty prompt runs as a single token 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from worker.engines.admission import BlockRequest, QueuedEngine
from worker.engines.base import Admission, EngineStats, GenerationRequest, RequestRejectedError
from worker.kvcache import Allocation, PrefixCache
from worker.model import KVPool, ModelConfig, Transformer, pick_device, torch_dtype

T = TypeVar("T")


@dataclass(frozen=True)
class TorchEngineConfig:
    model_config: str = "small"
    model_weights: str = ""
    model_seed: int = 0
    device: str = "auto"
    model_dtype: str = "float32"
    kv_dtype: str = "auto"
    block_size: int = 16
    cache_blocks: int = 0
    """0: ``cache_memory_fraction`` of the memory available after loading the model."""
    cache_memory_fraction: float = 0.1
    max_running: int = 8


def available_memory(device: torch.device) -> int:
    """Free CUDA memory, or MemAvailable of the host, in bytes."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3  # no /proc (not Linux): assume 4 GiB


class ModelRunner:
    """Synchronous prefill/decode on one model and pool. Not thread-safe: one call at a time."""

    def __init__(self, model: Transformer, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.vocab_size = model.cfg.vocab_size

    def _ids(self, tokens: Sequence[int]) -> Tensor:
        ids = [t % self.vocab_size for t in tokens]
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def table(self, alloc: Allocation) -> Tensor:
        return torch.tensor(alloc.block_ids, dtype=torch.long, device=self.device)

    def prefill(self, alloc: Allocation, tokens: Sequence[int], table: Tensor) -> Tensor:
        """Logits after the prompt, computing only positions the cache did not have."""
        n = len(tokens)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        start = min(alloc.matched_tokens, n - 1)
        with torch.inference_mode():
            return self.model.forward_chunk(
                self._ids(tokens[start:]), start, table, self.pool,
                write_from=alloc.matched_tokens,
            )

    def full_prefill(self, tokens: Sequence[int], table: Tensor) -> Tensor:
        """Logits after ``tokens`` computed from scratch (writes all their K/V)."""
        with torch.inference_mode():
            return self.model.forward_chunk(self._ids(tokens), 0, table, self.pool)

    def decode(self, token: int, position: int, table: Tensor) -> Tensor:
        """Logits after appending ``token`` at ``position``."""
        with torch.inference_mode():
            return self.model.forward_chunk(self._ids([token]), position, table, self.pool)


def build_model(cfg: TorchEngineConfig) -> tuple[Transformer, torch.device]:
    model_cfg = ModelConfig.load(cfg.model_config)
    device = pick_device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from worker.model import ModelLoadError

        raise ModelLoadError("device 'cuda' requested but torch sees no CUDA device")
    if cfg.model_weights:
        model = Transformer.from_safetensors(model_cfg, cfg.model_weights)
    else:
        model = Transformer.random(model_cfg, cfg.model_seed)
    model = model.to(device=device, dtype=torch_dtype(cfg.model_dtype)).eval()
    return model, device


class TorchGeneration:
    """One admitted request: the first token comes from prefill, the rest from decode steps."""

    def __init__(
        self,
        engine: TorchEngine,
        admission: Admission,
        first_token: int,
        prompt_len: int,
        max_tokens: int,
        table: Tensor,
    ) -> None:
        self._engine = engine
        self._admission = admission
        self._first = first_token
        self._prompt_len = prompt_len
        self._max_tokens = max_tokens
        self._table = table
        self.token_ids: list[int] = []

    @property
    def admission(self) -> Admission:
        return self._admission

    async def tokens(self) -> AsyncGenerator[str, None]:
        engine = self._engine
        token = self._first
        for i in range(self._max_tokens):
            if i:
                position = self._prompt_len + i - 1
                token, seconds = await engine.run(engine.decode_step, token, position, self._table)
                engine.decode_seconds += seconds
            self.token_ids.append(token)
            engine.generation_tokens += 1
            yield engine.detokenize(token)


class TorchEngine(QueuedEngine):
    """Real engine over a :class:`PrefixCache` and a :class:`KVPool` (see module docstring)."""

    def __init__(
        self,
        model: Transformer,
        cache: PrefixCache,
        pool: KVPool,
        *,
        max_running: int,
        detokenize: Callable[[int], str],
        description: dict[str, Any] | None = None,
    ) -> None:
        if pool.num_blocks != cache.num_blocks or pool.block_size != cache.block_size:
            raise ValueError("the KV pool and the prefix cache must have the same shape")
        super().__init__(cache, max_running)
        self.pool = pool
        self.runner = ModelRunner(model, pool)
        self.detokenize = detokenize
        self._description = dict(description or {})
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")

    @classmethod
    def build(cls, cfg: TorchEngineConfig, detokenize: Callable[[int], str]) -> TorchEngine:
        """Model (random or from safetensors) + a pool sized by blocks or by memory fraction."""
        model, device = build_model(cfg)
        kv_dtype = cfg.model_dtype if cfg.kv_dtype == "auto" else cfg.kv_dtype
        per_block = KVPool.bytes_per_block(model.cfg, cfg.block_size, kv_dtype)
        num_blocks = cfg.cache_blocks
        if not num_blocks:
            budget = available_memory(device) * cfg.cache_memory_fraction
            num_blocks = max(1, int(budget // per_block))
        pool = KVPool(
            num_blocks, cfg.block_size, model.cfg, dtype=kv_dtype,
            compute_dtype=torch_dtype(cfg.model_dtype), device=device,
        )
        description = {
            "model_config": cfg.model_config,
            "model_weights": cfg.model_weights or f"random(seed={cfg.model_seed})",
        }
        return cls(
            model, PrefixCache(num_blocks, cfg.block_size), pool,
            max_running=cfg.max_running, detokenize=detokenize, description=description,
        )

    # -- Engine protocol -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "torch"

    def slots_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return max(prompt_tokens, 1) + max(max_tokens, 1) - 1

    def flush(self, namespace: str | None = None) -> int:
        return self.cache.flush(namespace)

    def info(self) -> dict[str, Any]:
        model = self.runner.model
        return {
            **self._description,
            "model_params": model.num_params(),
            "model": {
                "vocab_size": model.cfg.vocab_size, "hidden_size": model.cfg.hidden_size,
                "num_layers": model.cfg.num_layers, "num_heads": model.cfg.num_heads,
                "num_kv_heads": model.cfg.num_kv_heads,
            },
            "device": str(self.pool.device),
            "model_dtype": str(self.pool.compute_dtype).removeprefix("torch."),
            "kv_dtype": self.pool.kv_dtype,
            "kv_bytes_per_token": self.pool.bytes_per_token,
            "kv_pool_bytes": self.pool.nbytes,
        }

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._queue.running,
            waiting=self._queue.waiting,
            max_running=self.max_running,
            requests_admitted=self.requests_admitted,
            requests_finished=self._queue.requests_finished,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            cache=self.cache.stats(),
        )

    def close(self) -> None:
        """Stop the model thread (queued jobs are dropped; a running one finishes)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- running ---------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread; cancelling the caller does not cancel it."""
        return await asyncio.shield(asyncio.wrap_future(self._submit(fn, *args)))

    def prefill_step(
        self, alloc: Allocation, tokens: Sequence[int], table: Tensor
    ) -> tuple[int, float]:
        t0 = time.perf_counter()
        logits = self.runner.prefill(alloc, tokens, table)
        token = int(torch.argmax(logits).item())
        return token, time.perf_counter() - t0

    def decode_step(self, token: int, position: int, table: Tensor) -> tuple[int, float]:
        t0 = time.perf_counter()
        logits = self.runner.decode(token, position, table)
        nxt = int(torch.argmax(logits).item())
        return nxt, time.perf_counter() - t0

    @asynccontextmanager
    async def admit(self, request: GenerationRequest) -> AsyncIterator[TorchGeneration]:
        if request.max_tokens < 1:
            raise RequestRejectedError("max_tokens must be >= 1")
        tokens = list(request.prompt_tokens) or [0]
        needed = self.slots_needed(len(tokens), request.max_tokens)
        if not self._queue.fits(needed):
            raise RequestRejectedError(
                f"prompt of {len(request.prompt_tokens)} tokens plus {request.max_tokens} "
                f"output tokens exceeds the KV cache ({self.capacity_tokens} tokens)"
            )
        alloc = await self._queue.acquire(
            BlockRequest(
                request.request_id, tokens, request.namespace,
                priority=request.priority, system_tokens=request.system_tokens,
                reserve_tokens=request.max_tokens - 1,
            )
        )
        self.requests_admitted += 1
        self.prompt_tokens += len(request.prompt_tokens)
        prefill_done = False
        try:
            table = self.runner.table(alloc)
            # Submitted before any await: jobs run in allocation order (see module docstring).
            job = asyncio.wrap_future(self._submit(self.prefill_step, alloc, tokens, table))
            first, seconds = await asyncio.shield(job)
            prefill_done = True
            self.prefill_seconds += seconds
            admission = Admission(
                request_id=request.request_id,
                input_tokens=len(request.prompt_tokens),
                matched_tokens=min(alloc.matched_tokens, len(request.prompt_tokens)),
                matched_blocks=alloc.matched_blocks if request.prompt_tokens else 0,
                prefill_seconds=seconds,
            )
            yield TorchGeneration(self, admission, first, len(tokens), request.max_tokens, table)
        finally:
            if not prefill_done:
                # Its K/V may never be written (cancelled before the job ran, or it failed).
                self.cache.forget(request.request_id)
            self._queue.release(request.request_id)
