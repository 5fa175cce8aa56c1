"""Warm-up on join: a worker that joins the pool is warmed before it takes its full share.

When a worker joins (a ``--worker`` at start-up, a worker registered in the store, a SageMaker
variant), the manager marks it *warming*: while another worker can serve, routing leaves it
out. It then replays, as prefill-only requests (``max_tokens`` 1, no streaming, the same
normalized body and cache namespace as real traffic), the prompts the worker is about to own
(:func:`gateway.warmup_sources.plan`: operator prompts, hot prefixes, anchors the ring moves to
it; most valuable first, within a share of its cache and a time budget), and records each
replayed prefix in the prefix index as held by it, so routing sends matching requests there
at once. Then it *ramps*: its ring weight (and so its load bound) grows in steps from a
quarter to its full value over ``ramp_s``, so the requests it did not warm arrive gradually.

The state of each joining worker (phase, prompts and blocks planned and done, failures, ramp
factor) is shown per worker in ``/admin/workers`` under ``"warmup"``.

Gateways that share a store (replicas on Redis, the processes of ``--procs N`` on their hub)
warm a joining worker once: each of them notices the join and holds the worker out, but only
the one that takes the store's lease ``warmup:<worker>`` replays prompts (its replays reach
the others' prefix indexes through the store, as any routed request does). The others wait
until the lease says it is done (or it expires: the warming gateway went away, and one of them
takes over), then ramp the worker up in their own routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from gateway.backends.base import Backend, BackendUnavailable, UpstreamReply, UpstreamRequest
from gateway.contracts.engine_owners import PRIORITY_AS_VLLM
from gateway.contracts.engine_paths import COMPLETIONS_PATH
from gateway.contracts.tasks import stop_if_cancelled
from gateway.fingerprint import FingerprintOptions
from gateway.normalize import NormalizeOptions
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Worker
from gateway.store.base import StoreUnavailable
from gateway.sync import StoreSync
from gateway.warmup_sources import (
    Namespaces,
    PlanOptions,
    PromptSample,
    WarmPrompt,
    peer_prompt,
    plan,
)

log = logging.getLogger(__name__)

RAMP_STEPS = (0.25, 0.5, 0.75, 1.0)
_WARMING, _DONE = "warming:", "done:"
_DONE_TTL_S = 60.0  # how long the other gateways can still see that the warm-up is done
_FOLLOW_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class WarmupOptions:
    enabled: bool = True
    budget_s: float = 30.0  # the most a warm-up may take before the worker serves anyway
    ramp_s: float = 10.0  # from a quarter of its ring weight to all of it
    cache_fraction: float = 0.5  # of the worker's cache the warm-up may fill
    concurrency: int = 2  # replays in flight at once on the joining worker
    max_prompts: int = 256
    ring_choices: int = 4
    hot_uses: float = 8.0
    health_wait_s: float = 30.0  # how long a joining worker may take to answer its probe
    peer_prompts: int = 64  # asked of each serving worker (its hottest prompts); 0: none
    # The scheduling priority session copies go with (--copy-priority): each worker is asked
    # whether its engine takes one as soon as it serves. 0: none is sent, none asked.
    copy_priority: int = 0
    fingerprint: FingerprintOptions = field(default_factory=FingerprintOptions)
    normalize: NormalizeOptions = field(default_factory=NormalizeOptions)


@dataclass(slots=True)
class WarmupStatus:
    """What ``/admin/workers`` shows for a worker that joined (JSON via :meth:`as_dict`)."""

    phase: str = "waiting"  # waiting (for its first probe), warming, ramping, ready, failed
    reason: str = "joined"
    planned: int = 0
    planned_blocks: int = 0
    done: int = 0
    done_blocks: int = 0
    failed: int = 0
    held_out: bool = False
    ramp: float = 1.0
    started_at: float = field(default_factory=time.time)  # wall clock, for people
    finished_at: float | None = None
    error: str = ""
    # The gateway (replica id) that replays the prompts: this one, or another one on the store.
    warmed_by: str = ""
    from_peers: int = 0  # candidate prompts the serving workers exported

    @property
    def warming(self) -> bool:
        return self.phase in ("waiting", "warming", "ramping")

    def as_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "warming": self.warming,
            "reason": self.reason,
            "planned_prompts": self.planned,
            "planned_blocks": self.planned_blocks,
            "done_prompts": self.done,
            "done_blocks": self.done_blocks,
            "failed_prompts": self.failed,
            "progress": (self.done + self.failed) / self.planned if self.planned else 1.0,
            "held_out": self.held_out,
            "ramp": self.ramp,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "warmed_by": self.warmed_by,
            "peer_prompts": self.from_peers,
        }


class InFlightBlocks(Protocol):
    """Told which blocks went to which worker and when that request ended."""

    def sent(self, worker_id: str, blocks: Sequence[int], now: float) -> None: ...

    def unsent(self, worker_id: str, blocks: Sequence[int]) -> None: ...

    def done(self, worker_id: str, blocks: Sequence[int], now: float) -> None: ...


class WarmupManager:
    """Owns the warm-up tasks of joining workers (one per worker, cancelled on leave/stop)."""

    def __init__(
        self,
        pool: WorkerPool,
        index: PrefixIndex,
        sync: StoreSync,
        backend_for: Callable[[Worker], Backend],
        options: WarmupOptions,
        *,
        sample: PromptSample | None = None,
        file_prompts: Sequence[WarmPrompt] = (),
    ) -> None:
        self.pool = pool
        self.index = index
        self.sync = sync
        self._backend_for = backend_for
        self.options = options
        self.sample = sample if sample is not None else PromptSample()
        self.namespaces = Namespaces()  # fed by the request path: namespace -> tenant id
        self.file_prompts = tuple(file_prompts)
        self.status: dict[str, WarmupStatus] = {}
        self._epochs: dict[str, str] = {}  # worker -> what its current warm-up is for
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running = False
        # Told of the early replays' blocks (the engine-exact source, awaiting its events).
        self.exact: InFlightBlocks | None = None
        # Whether each worker's engine takes a scheduling ``priority`` (vLLM's priority
        # scheduling) or refuses it (first-come-first-served), as a probe found; a replay
        # carries its priority only to a worker known to take it.
        self.takes_priority: dict[str, bool] = {}
        self._probing: set[str] = set()
        self._background: set[asyncio.Future[None]] = set()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin watching joins. Workers already in the pool at start-up are warmed from the
        operator's file, if there is one (with nothing else routable they serve meanwhile)."""
        self._running = True
        self.pool.on_join = self.joined
        self.pool.on_leave = self.left
        for state in self.pool.states():
            self._ask_priority(state.worker.id)
        if self.options.enabled and self.file_prompts:
            for state in self.pool.states():
                self.joined(state.worker.id, reason="start-up")

    async def stop(self) -> None:
        self._running = False
        self.pool.on_join = None
        self.pool.on_leave = None
        tasks = [*self._tasks.values(), *self._background]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._background.clear()

    def joined(self, wid: str, reason: str = "joined", epoch: str = "") -> None:
        """``wid`` joined (or lost its cache). ``epoch`` tells warm-ups of one worker apart
        across gateways (the model version it warms for); empty for a join."""
        if self._running and reason in ("joined", "restarted"):
            self._ask_priority(wid)
        if not self._running or not self.options.enabled or wid in self._tasks:
            return
        self.status[wid] = WarmupStatus(reason=reason)
        self._epochs[wid] = epoch
        task = asyncio.get_running_loop().create_task(self._warm(wid), name=f"warmup-{wid}")
        self._tasks[wid] = task
        task.add_done_callback(self._forget_task)

    def restarted(self, wid: str) -> None:
        """``wid`` restarted: warmed as a worker that joined, and its engine asked again
        whether it takes a scheduling priority (it may run another policy now). Gateways
        sharing a store warm it once per restart they see together: the lease names it."""
        self._learned_priority(wid, None)
        self.joined(wid, reason="restarted", epoch="restarted")

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        for wid, t in list(self._tasks.items()):
            if t is task:
                del self._tasks[wid]

    def left(self, wid: str) -> None:
        task = self._tasks.pop(wid, None)
        if task is not None:
            task.cancel()
        self.status.pop(wid, None)
        self._epochs.pop(wid, None)
        self.takes_priority.pop(wid, None)

    def warming(self) -> dict[str, WarmupStatus]:
        return {wid: s for wid, s in self.status.items() if s.warming}

    # -- request path (no I/O) ----------------------------------------------------------------
    def observe(self, prompt: WarmPrompt, name: str) -> None:
        """A routed request of the tenant ``name``; kept if that tenant may be sampled."""
        self.sample.observe(prompt, time.monotonic(), name)

    # -- one worker ---------------------------------------------------------------------------
    async def _warm(self, wid: str) -> None:
        status = self.status[wid]
        try:
            if not await self._wait_healthy(wid):
                status.phase, status.error = "failed", "not healthy within the wait"
                return
            others = [s for s in self.pool.states()
                      if s.worker.id != wid and s.healthy and not s.held_out]
            status.held_out = bool(others)
            self.pool.set_held_out(wid, status.held_out)
            status.phase = "warming"
            if await self._lead(wid, status):
                try:
                    peer = await self._peer_prompts(wid)
                    status.from_peers = len(peer)
                    prompts = self._plan(wid, peer)
                    status.planned = len(prompts)
                    status.planned_blocks = sum(p.key.total_blocks for p in prompts)
                    if prompts:
                        log.info("warming worker %s: %d prompt(s), %d block(s)", wid,
                                 status.planned, status.planned_blocks)
                    await self._replay_all(wid, prompts, status)
                finally:
                    await self._lease(wid, _DONE + self.sync.origin, _DONE_TTL_S, replace=True)
            status.held_out = False
            self.pool.set_held_out(wid, False)
            status.phase = "ramping"
            await self._ramp(wid, status)
            status.phase = "ready"
            log.info("worker %s warmed: %d/%d prompt(s) replayed, %d failed", wid, status.done,
                     status.planned, status.failed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a warm-up problem must never keep a worker out for good
            log.exception("warm-up of %s failed", wid)
            status.phase, status.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            status.finished_at = time.time()
            if wid in self.pool:
                self.pool.set_held_out(wid, False)
                self.pool.set_ramp(wid, 1.0)
            status.held_out, status.ramp = False, 1.0

    async def _lease(self, wid: str, value: str, ttl_s: float, replace: bool = False) -> str:
        """The store's warm-up lease for ``wid`` (``value`` itself when no other gateway shares
        the store or the store cannot be reached: then this gateway warms on its own)."""
        if not self.sync.shares_state:
            return value
        epoch = self._epochs.get(wid, "")
        name = f"warmup:{wid}" + (f":{epoch}" if epoch else "")
        try:
            return await self.sync.store.lease(name, value, ttl_s, replace)
        except StoreUnavailable:
            return value

    async def first(self, name: str, ttl_s: float) -> bool:
        """True for the first gateway on the store to ask for ``name`` within ``ttl_s`` (always
        for a gateway that shares no store)."""
        mine = self.sync.origin
        if not self.sync.shares_state:
            return True
        try:
            return await self.sync.store.lease(name, mine, ttl_s) == mine
        except StoreUnavailable:
            return True

    async def _lead(self, wid: str, status: WarmupStatus) -> bool:
        """True when this gateway replays the prompts; otherwise wait while another one does
        (until it is done, or its lease lapses and this one takes over)."""
        mine = _WARMING + self.sync.origin
        ttl_s = self.options.budget_s + 10.0
        deadline = time.monotonic() + ttl_s + 5.0
        while True:
            held = await self._lease(wid, mine, ttl_s)
            if held == mine:
                status.warmed_by = self.sync.origin
                return True
            status.warmed_by = held.split(":", 1)[1] if ":" in held else held
            if held.startswith(_DONE) or time.monotonic() > deadline or wid not in self.pool:
                return False
            stop_if_cancelled()
            await asyncio.sleep(_FOLLOW_POLL_S)

    async def _wait_healthy(self, wid: str) -> bool:
        deadline = time.monotonic() + self.options.health_wait_s
        while wid in self.pool:
            if self.pool.get(wid).healthy:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return False

    async def _peer_prompts(self, wid: str) -> list[WarmPrompt]:
        """What the serving workers export as their hottest prompts, keyed for this gateway
        (prompts of namespaces it has not routed are left out)."""
        limit = self.options.peer_prompts
        peers = [s.worker for s in self.pool.states()
                 if s.worker.id != wid and s.healthy and not s.held_out]
        if limit <= 0 or not peers:
            return []

        async def ask(worker: Worker) -> list[dict[str, Any]]:
            try:
                export = getattr(self._backend_for(worker), "hot_prompts", None)
            except LookupError:
                return []
            if export is None:
                return []
            entries: list[dict[str, Any]] = await export(worker, limit)
            return entries

        out: list[WarmPrompt] = []
        for entries in await asyncio.gather(*(ask(w) for w in peers)):
            for entry in entries:
                prompt = peer_prompt(entry, self.namespaces, normalize=self.options.normalize,
                                     fingerprint_options=self.options.fingerprint)
                if prompt is not None:
                    out.append(prompt)
        return out

    def _plan(self, wid: str, peer: Sequence[WarmPrompt] = ()) -> list[WarmPrompt]:
        state = self.pool.get(wid)
        weights = {s.worker.id: s.worker.weight for s in self.pool.states()}
        capacity = self.index.capacity(wid)
        opts = self.options
        candidates = [
            p.rekeyed(self.pool.model_identity(p.model), opts.fingerprint)
            for p in (*self.file_prompts, *self.sample.prompts(time.monotonic()), *peer)
        ]
        return plan(wid, candidates, weights, state.worker.models, PlanOptions(
            ring_choices=opts.ring_choices, hot_uses=opts.hot_uses,
            budget_blocks=capacity * opts.cache_fraction, max_prompts=opts.max_prompts,
        ))

    async def _replay_all(self, wid: str, prompts: Sequence[WarmPrompt],
                          status: WarmupStatus) -> None:
        queue = list(reversed(prompts))  # most valuable first: pop() from the end
        deadline = time.monotonic() + self.options.budget_s

        async def runner() -> None:
            while queue and wid in self.pool and time.monotonic() < deadline:
                prompt = queue.pop()
                if await self.replay(wid, prompt):
                    status.done += 1
                    status.done_blocks += prompt.key.total_blocks
                else:
                    status.failed += 1

        workers = max(1, self.options.concurrency)
        try:
            await asyncio.wait_for(
                asyncio.gather(*(runner() for _ in range(workers))),
                timeout=max(0.0, deadline - time.monotonic()) + 1.0,
            )
        except TimeoutError:
            status.error = "time budget spent"
        if queue:
            status.error = status.error or "time budget spent"

    async def replay(self, wid: str, prompt: WarmPrompt) -> bool:
        """Send one prefill-only request to ``wid``; on success the index records that the
        worker holds the prompt's prefix (and the store tells the other replicas)."""
        if wid not in self.pool:
            return False
        ok = await self._send(self.pool.get(wid).worker, prompt)
        if ok:
            self.index.record(prompt.key.blocks, wid, time.monotonic(), prompt.key.depths)
            self.sync.assigned(prompt.key, wid)
        return ok

    def prewarm(self, wid: str, prompt: WarmPrompt,
                later: Coroutine[Any, Any, WarmPrompt] | None = None) -> Awaitable[bool]:
        """The pre-warmer's replay of ``prompt`` on ``wid``, recorded at once: it is called at
        the decision that chose it, and recorded then, as a routed request is (it goes to a
        serving worker, whose engine admits it ahead of the requests routed after it and
        evicts for it then; recorded at the reply, the index would meanwhile predict blocks
        those evictions took). The awaitable it returns sends it, and forgets it again if it
        fails. A session's copy sent at a background priority is recorded only once it
        answered (``prompt.recorded_at_answer``): the engine may not have begun it when the
        session's next turn comes, and that turn would compute the history again.
        ``later``: the request to send is ready only then (a held prefix's token ids, still
        to be encoded); ``prompt.key`` is what it caches."""
        if wid not in self.pool:
            if later is not None:
                later.close()
            return _refused()
        worker = self.pool.get(wid).worker
        if prompt.priority and not self.takes_priority.get(wid, False):
            # Not known to take it: the copy goes without (a refusal and a second send would
            # reach the engine after the requests routed meanwhile, which the index predicts
            # find the copy), and a probe finds out for the next one.
            if wid not in self.takes_priority:
                self._probe_priority(worker, prompt.model, prompt.priority)
            prompt = dataclasses.replace(prompt, priority=0)
        key = prompt.key
        now = time.monotonic()
        held = self.index.match(key.blocks, now).get(wid, 0)
        if not prompt.recorded_at_answer:  # else at its answer (_prewarmed)
            self.index.record(key.blocks, wid, now, key.depths)
        if self.exact is not None:
            self.exact.sent(wid, key.blocks, now)
        # Written now, as a routed request is when its decision is made: sent from the task
        # that awaits it, it would reach the worker after requests routed meanwhile, which the
        # index already predicts find its blocks.
        sending = self._start(worker, prompt) if later is None else self._ready(worker, later)
        return self._prewarmed(worker, prompt, held, sending)

    async def _ready(self, worker: Worker,
                     later: Coroutine[Any, Any, WarmPrompt]) -> UpstreamReply:
        sending = self._start(worker, await later)
        if sending is None:
            raise BackendUnavailable(f"{worker.id} cannot take a pre-warm")
        return await sending

    async def _prewarmed(self, worker: Worker, prompt: WarmPrompt, held: int,
                         sending: Coroutine[Any, Any, UpstreamReply] | None) -> bool:
        wid, blocks = worker.id, prompt.key.blocks
        status, text = await self._answer(worker, sending) if sending is not None else (0, b"")
        if status == 400 and prompt.priority and b"priority" in text:
            self._refused_priority(wid, status, text)  # its scheduling changed since the probe
        ok = status == 200
        if self.exact is not None:
            self.exact.done(wid, blocks, time.monotonic())
        if ok:
            if prompt.recorded_at_answer:
                self.index.record(blocks, wid, time.monotonic(), prompt.key.depths)
            self.sync.assigned(prompt.key, wid)
        elif not prompt.recorded_at_answer:
            self.index.forget(wid, blocks, held)
            if self.exact is not None:
                self.exact.unsent(wid, blocks[held:])
        return ok

    async def _send(self, worker: Worker, prompt: WarmPrompt) -> bool:
        sending = self._start(worker, prompt)
        return sending is not None and await self._replied(worker, sending)

    def _start(self, worker: Worker,
               prompt: WarmPrompt) -> Coroutine[Any, Any, UpstreamReply] | None:
        """The prefill-only request replaying ``prompt``, written to ``worker`` now
        (:meth:`Backend.send`); None if its backend cannot take it."""
        try:
            return self._backend_for(worker).send(worker, _upstream(prompt))
        except (BackendUnavailable, LookupError) as exc:
            log.info("warm-up request to %s failed: %s", worker.id, exc)
            return None

    def _ask_priority(self, wid: str) -> None:
        """With a copy priority set: ask ``wid`` whether its engine takes it as soon as it
        serves (its first probe names its models), before the first copy goes there."""
        priority = self.options.copy_priority
        if not priority or wid in self.takes_priority:
            return

        async def when_serving() -> None:
            if await self._wait_healthy(wid):
                worker = self.pool.get(wid).worker
                if worker.models:
                    self._probe_priority(worker, min(worker.models), priority)

        task = asyncio.ensure_future(when_serving())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _probe_priority(self, worker: Worker, model: str, priority: int) -> None:
        """Find out, off any copy's path, whether ``worker``'s engine takes the scheduling
        ``priority``: a one-token completion of a one-character prompt of ``model`` carrying
        it. Answered 200, it does; any other answer (vLLM on first-come-first-served
        scheduling refuses it with a 400; an engine that knows no such field may answer
        otherwise) and it does not, until the worker joins again; no answer at all (the worker
        unreachable) leaves it unknown, to be asked again at the next copy. Only an engine
        that takes a priority as vLLM does is asked (gateway.contracts.engine_owners): one
        that names itself otherwise does not take it, and one that does not name itself is
        not asked; the copies to either go without."""
        if worker.id in self._probing or worker.id not in self.pool:
            return
        engine = self.pool.get(worker.id).engine
        if not engine:  # not named (yet, or ever: a SageMaker endpoint): copies go without
            return
        if engine not in PRIORITY_AS_VLLM:
            log.info("%s runs %r, whose answer about a scheduling priority would not say "
                     "whether a copy yields: its session copies go without one", worker.id,
                     engine)
            self._learned_priority(worker.id, False)
            return
        self._probing.add(worker.id)
        probe = UpstreamRequest(
            path=COMPLETIONS_PATH, request_id="warmup", headers={"x-request-id": "warmup"},
            body={"model": model, "prompt": ".", "max_tokens": 1, "temperature": 0,
                  "priority": priority})

        async def ask() -> None:
            try:
                sending = self._backend_for(worker).send(worker, probe)
                status, text = await self._answer(worker, sending)
            except (BackendUnavailable, LookupError) as exc:
                log.info("priority probe of %s failed: %s", worker.id, exc)
                return
            finally:
                self._probing.discard(worker.id)
            if status == 200 and worker.id in self.pool:
                self._learned_priority(worker.id, True)
            elif status:
                self._refused_priority(worker.id, status, text)

        task = asyncio.ensure_future(ask())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _refused_priority(self, wid: str, status: int, text: bytes) -> None:
        if wid in self.pool and self.takes_priority.get(wid) is not False:
            why = ("first-come-first-served scheduling" if status == 400 and b"priority" in text
                   else f"answered {status}")
            log.info("%s does not take a scheduling priority (%s): its pre-warms go without "
                     "one", wid, why)
            self._learned_priority(wid, False)

    def _learned_priority(self, wid: str, takes: bool | None) -> None:
        """What ``wid``'s engine makes of the copy priority: takes it, refuses it, or not
        known (None: to be asked again). Routing sees the first as ``copies_yield``."""
        if takes is None:
            self.takes_priority.pop(wid, None)
        else:
            self.takes_priority[wid] = takes
        self.pool.set_copies_yield(wid, takes is True)

    @property
    def with_priority(self) -> list[str]:
        """The workers known to take a scheduling priority."""
        return sorted(wid for wid, takes in self.takes_priority.items() if takes)

    @property
    def no_priority(self) -> list[str]:
        """The workers known to refuse a scheduling priority."""
        return sorted(wid for wid, takes in self.takes_priority.items() if not takes)

    async def _replied(self, worker: Worker,
                       sending: Coroutine[Any, Any, UpstreamReply]) -> bool:
        """Whether the warm-up request ``sending`` was answered 200 (its body read)."""
        return (await self._answer(worker, sending))[0] == 200

    async def _answer(self, worker: Worker,
                      sending: Coroutine[Any, Any, UpstreamReply]) -> tuple[int, bytes]:
        """The status and body of the answer to the warm-up request ``sending`` (0 and
        nothing when none came whole)."""
        try:
            reply = await sending
        except BackendUnavailable as exc:
            log.info("warm-up request to %s failed: %s", worker.id, exc)
            return 0, b""
        try:
            body = await reply.read()
        except (aiohttp.ClientError, TimeoutError):
            return 0, b""
        finally:
            reply.release()
        return reply.status, body

    async def _ramp(self, wid: str, status: WarmupStatus) -> None:
        steps = RAMP_STEPS if self.options.ramp_s > 0 else (1.0,)
        pause = self.options.ramp_s / max(1, len(steps) - 1)
        for i, factor in enumerate(steps):
            if wid not in self.pool:
                return
            status.ramp = factor
            self.pool.set_ramp(wid, factor)
            if i < len(steps) - 1:
                await asyncio.sleep(pause)


def _upstream(prompt: WarmPrompt) -> UpstreamRequest:
    """The prefill-only request that replays ``prompt``."""
    return UpstreamRequest(
        path=prompt.path, body=prompt.replay_body(), namespace=prompt.namespace,
        anchor=prompt.key.anchor_hex, request_id="warmup", headers={"x-request-id": "warmup"},
    )


async def _refused() -> bool:
    return False
