"""A pre-warm counts in the prefix index from the decision that chose it, as a routed request
does, and is written to the worker then, so its engine admits it ahead of the requests routed
after it; it is forgotten if it fails; a joining worker's warm-up replay and a session's copy
count once answered.

A reference worker over real HTTP on 127.0.0.1; the gateway's own backends send the replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from aiohttp import web

from gateway.app import backend_options
from gateway.backends.base import Backend, UpstreamRequest
from gateway.backends.registry import build_backends
from gateway.contracts.engine_owners import REFERENCE_OWNER
from gateway.fingerprint import Namespace, fingerprint
from gateway.kvevents.tokenize import PromptTokenizer, TokenizerOptions
from gateway.normalize import render_chat
from gateway.pool import WorkerPool
from gateway.prewarm import PreWarmer, PrewarmOptions
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Decision, DecisionKind, RouteRequest, Worker
from gateway.settings import GatewaySettings
from gateway.store.memory import MemoryStore
from gateway.sync import StoreSync
from gateway.warmup import WarmupManager, WarmupOptions
from gateway.warmup_sources import WarmPrompt
from loadtest.tiny_tokenizer import train
from tests.conftest import FAST_WORKER, MODEL, engine_stub, free_port, serve
from worker.server import create_app as create_worker

TEXT = "You are the support desk of a bicycle shop. " * 30


@dataclasses.dataclass
class Sent:
    """The engine-exact source's side: what it was told."""

    log: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)

    def sent(self, worker_id: str, blocks: Sequence[int], now: float) -> None:
        self.log.append(("sent", worker_id, len(blocks)))

    def unsent(self, worker_id: str, blocks: Sequence[int]) -> None:
        self.log.append(("unsent", worker_id, len(blocks)))

    def done(self, worker_id: str, blocks: Sequence[int], now: float) -> None:
        self.log.append(("done", worker_id, len(blocks)))


@dataclasses.dataclass
class Setup:
    manager: WarmupManager
    index: PrefixIndex
    live: str  # a worker that answers
    dead: str  # a worker nothing listens on
    sent: Sent
    pool: WorkerPool
    backend: Backend  # the live worker's


@contextlib.asynccontextmanager
async def priority_worker(setup: Setup) -> AsyncIterator[str]:
    """A worker whose engine runs priority scheduling, serving in ``setup``'s pool: its id."""
    port = free_port()
    runner = await serve(create_worker(dataclasses.replace(
        FAST_WORKER, port=port, scheduling_policy="priority")), port)
    try:
        wid = setup.pool.add(f"http://127.0.0.1:{port}")
        setup.pool.mark_up(wid, frozenset({MODEL}), engine=REFERENCE_OWNER)
        yield wid
    finally:
        await runner.cleanup()


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    port = free_port()
    worker = dataclasses.replace(FAST_WORKER, port=port)
    runner = await serve(create_worker(worker), port)
    live, dead = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
    index = PrefixIndex()
    pool = WorkerPool([f"http://{live}", f"http://{dead}"], index)
    for state in pool.states():
        pool.mark_up(state.worker.id, frozenset({MODEL}), engine=REFERENCE_OWNER)
    settings = GatewaySettings(connect_timeout_s=0.5)
    backends = build_backends(backend_options(settings))
    for backend in backends.values():
        await backend.start()
    sync = StoreSync(MemoryStore(), pool, index, origin="test", tokens_per_block=16.0,
                     shares_state=False)
    manager = WarmupManager(pool, index, sync, lambda w: backends[w.kind], WarmupOptions())
    sent = Sent()
    manager.exact = sent
    try:
        yield Setup(manager, index, live, dead, sent, pool,
                    backends[pool.get(live).worker.kind])
    finally:
        for backend in backends.values():
            await backend.close()
        await runner.cleanup()


def prompt() -> WarmPrompt:
    key = fingerprint(TEXT, Namespace(model=MODEL))
    return WarmPrompt("/v1/completions", {"model": MODEL, "prompt": TEXT}, "", MODEL, key)


def held(index: PrefixIndex, wid: str, p: WarmPrompt) -> int:
    return index.match(p.key.blocks, 0.0).get(wid, 0)


async def cache_usage(backend: Backend, worker: Worker,
                      request: UpstreamRequest) -> tuple[int, int]:
    """``request`` sent to ``worker``: the prompt tokens it found cached, and its prompt's."""
    reply = await backend.open(worker, request)
    try:
        await reply.read()
        return (int(reply.headers.get("x-cache-matched-tokens", "0")),
                int(reply.headers["x-cache-input-tokens"]))
    finally:
        reply.release()


async def test_a_prewarm_counts_from_its_decision(setup: Setup) -> None:
    p = prompt()
    task = asyncio.ensure_future(setup.manager.prewarm(setup.live, p))
    # Recorded by the call itself, before the request is even written.
    assert held(setup.index, setup.live, p) == len(p.key.blocks)
    assert setup.sent.log == [("sent", setup.live, len(p.key.blocks))]
    assert await task
    assert held(setup.index, setup.live, p) == len(p.key.blocks)
    assert setup.sent.log[-1] == ("done", setup.live, len(p.key.blocks))


async def test_a_late_replay_counts_once_answered(setup: Setup) -> None:
    p = prompt()
    task = asyncio.create_task(setup.manager.replay(setup.live, p))
    await asyncio.sleep(0)
    assert held(setup.index, setup.live, p) == 0  # a joining worker's warm-up: at the reply
    assert await task
    assert held(setup.index, setup.live, p) == len(p.key.blocks)


async def test_a_session_copy_at_a_background_priority_counts_once_answered(
        setup: Setup) -> None:
    # The volume guard's copy of a session sent at a background priority: its engine may not
    # have begun it when the session's next turn comes, so the session moves there only
    # after its answer. At the default priority (here: to an engine that refuses one) it
    # counts from its send, as any pre-warm.
    p = dataclasses.replace(prompt(), session_copy=True, priority=1)
    async with priority_worker(setup) as wid:
        setup.manager.takes_priority[wid] = True
        task = asyncio.ensure_future(setup.manager.prewarm(wid, p))
        await asyncio.sleep(0)
        assert held(setup.index, wid, p) == 0
        assert await task
        assert held(setup.index, wid, p) == len(p.key.blocks)
    setup.manager.takes_priority[setup.live] = False
    task = asyncio.ensure_future(setup.manager.prewarm(setup.live, p))
    await asyncio.sleep(0)
    assert held(setup.index, setup.live, p) == len(p.key.blocks)
    assert await task
    task = asyncio.ensure_future(setup.manager.prewarm(setup.dead, dataclasses.replace(
        p, priority=0)))
    await asyncio.sleep(0)
    assert held(setup.index, setup.dead, p) == len(p.key.blocks)
    assert not await task  # failed: forgotten again
    assert held(setup.index, setup.dead, p) == 0


async def test_a_failed_prewarm_is_forgotten(setup: Setup) -> None:
    p = prompt()
    assert not await setup.manager.prewarm(setup.dead, p)
    assert held(setup.index, setup.dead, p) == 0
    assert [e[0] for e in setup.sent.log] == ["sent", "done", "unsent"]


async def test_a_prewarm_reaches_the_worker_before_the_requests_routed_after_it(
        setup: Setup) -> None:
    # The pre-warm's task has not run yet when a request for its prompt is routed to the
    # pre-warmed worker (the index already says it holds the prompt): the pre-warm was written
    # at its decision, so the engine admits it first and the request finds its blocks cached.
    p = prompt()
    prewarm = setup.manager.prewarm(setup.live, p)  # the decision; its task starts later
    worker = setup.pool.get(setup.live).worker
    routed = UpstreamRequest(path="/v1/completions",
                             body={"model": MODEL, "prompt": TEXT, "max_tokens": 1})
    cached, prompt_tokens = await cache_usage(setup.backend, worker, routed)
    assert await asyncio.ensure_future(prewarm)
    assert prompt_tokens > 16
    assert cached >= prompt_tokens - 16  # every full block of the prompt


async def test_a_prewarm_copies_only_the_prefix_its_holder_held(setup: Setup) -> None:
    """The pre-warmer, handed to the manager as the gateway does, copies a chat's held prefix
    (its system prompt, which the busy holder had) to the next worker, and not the question
    of the request that caused the copy (the live worker's cache, asked over HTTP)."""
    messages = [{"role": "system", "content": TEXT},
                {"role": "user", "content": "Which tyre fits a touring frame? " * 20}]
    first = {"model": MODEL, "max_tokens": 1, "messages": messages}
    key = fingerprint(render_chat(messages), Namespace(model=MODEL))
    system = key.checkpoints_within(len(render_chat(messages[:1])) // 64)
    for _ in range(2):  # asked for before, on the holder (the worker nothing listens on)
        setup.index.record(key.blocks[:system], setup.dead, 0.0, key.depths[:system])
    setup.pool.acquire(setup.dead, 3000, prefill=2500)  # and busy there
    warmer = PreWarmer(setup.pool, setup.index, setup.manager.prewarm, PrewarmOptions())
    view = setup.pool.snapshot(0.0).by_id[setup.dead]  # type: ignore[index]
    decision = Decision(worker=type(view)(view.worker, True, 3, 0), policy="cache_aware",
                        kind=DecisionKind.PREFIX_HIT, match_blocks=key.depth_at(system - 1))
    request = RouteRequest(key=key, model=MODEL, cost_tokens=300, prompt_tokens=250)
    target = warmer.after_route(decision, request,
                                UpstreamRequest("/v1/chat/completions", first), "", 0.0)
    assert target == setup.live
    for _ in range(100):  # the copy's reply
        if not warmer.stats()["inflight"]:
            break
        await asyncio.sleep(0.01)
    assert warmer.stats()["placed"] == 1

    again, prompt_tokens = await cache_usage(
        setup.backend, setup.pool.get(setup.live).worker,
        UpstreamRequest("/v1/chat/completions", first))
    assert again >= len(TEXT) // 4 - 32  # the system prompt was there (about 4 characters
    assert again < prompt_tokens - 64  # a token); the first question was not


async def test_with_token_keys_a_prewarm_of_token_ids_warms_the_chat(tmp_path: Path) -> None:
    """With token-exact keys the pre-warmer sends the held prefix as a completions request of
    the chat's leading token ids; the reference worker (same tokenizer) then finds that
    prefix for the chat itself, and not its question."""
    tok_path = str(train(tmp_path / "tokenizer.json"))
    port = free_port()
    runner = await serve(create_worker(dataclasses.replace(
        FAST_WORKER, port=port, tokenizer_file=tok_path)), port)
    live, dead = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
    index = PrefixIndex()
    pool = WorkerPool([f"http://{live}", f"http://{dead}"], index)
    for state in pool.states():
        pool.mark_up(state.worker.id, frozenset({MODEL}), engine=REFERENCE_OWNER)
    backends = build_backends(backend_options(GatewaySettings(connect_timeout_s=0.5)))
    for backend in backends.values():
        await backend.start()
    tokenizer = PromptTokenizer(TokenizerOptions(tok_path, threads=1))
    try:
        sync = StoreSync(MemoryStore(), pool, index, origin="test", tokens_per_block=16.0,
                         shares_state=False)
        manager = WarmupManager(pool, index, sync, lambda w: backends[w.kind], WarmupOptions())

        async def leading_ids(upstream: UpstreamRequest, tokens: int) -> list[int] | None:
            return await tokenizer.leading_ids(upstream.body, chat=True, tokens=tokens)

        messages = [{"role": "system", "content": TEXT},
                    {"role": "user", "content": "Which tyre fits a touring frame? " * 20}]
        chat = {"model": MODEL, "max_tokens": 1, "messages": messages}
        tokenized = await tokenizer.key(chat, chat=True, salt="")
        assert tokenized is not None
        key = tokenized.key
        system = len(tokenizer.encode(TEXT)) // 16 - 2  # blocks well inside the system prompt
        for _ in range(2):  # asked for before, on the holder nothing listens on
            index.record(key.blocks[:system], dead, 0.0)
        pool.acquire(dead, 3000, prefill=2500)
        warmer = PreWarmer(pool, index, manager.prewarm, PrewarmOptions(), leading_ids)
        view = pool.snapshot(0.0).by_id[dead]  # type: ignore[index]
        decision = Decision(worker=type(view)(view.worker, True, 3, 0), policy="cache_aware",
                            kind=DecisionKind.PREFIX_HIT, match_blocks=system)
        request = RouteRequest(key=key, model=MODEL, cost_tokens=300, prompt_tokens=250,
                               block_tokens=16)
        upstream = UpstreamRequest("/v1/chat/completions", chat)
        assert warmer.after_route(decision, request, upstream, "", 0.0) == live
        # Recorded at the decision as the held blocks, before its ids are even encoded.
        assert index.match(key.blocks, 0.0).get(live) == system
        for _ in range(200):  # the copy's reply
            if warmer.stats()["placed"]:
                break
            await asyncio.sleep(0.01)
        assert warmer.stats()["placed"] == 1
        assert index.match(key.blocks, 0.0).get(live) == system
        worker = pool.get(live).worker
        cached, prompt_tokens = await cache_usage(backends[worker.kind], worker, upstream)
        assert cached == system * 16  # the held blocks, found by the chat
        assert cached < prompt_tokens - 64
    finally:
        tokenizer.close()
        for backend in backends.values():
            await backend.close()
        await runner.cleanup()


async def known(manager: WarmupManager, wid: str) -> bool:
    """Whether ``wid`` takes a scheduling priority, once the manager's probe found out."""
    for _ in range(200):
        if wid in manager.takes_priority:
            return manager.takes_priority[wid]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no answer to the priority probe of {wid}")


async def test_a_copy_carries_its_priority_only_to_workers_that_take_it(setup: Setup) -> None:
    """A session copy's scheduling priority goes only to a worker whose engine is known to
    take it. Until a probe (off the copy's path) finds out, copies go without: an engine on
    first-come-first-served scheduling refuses any priority but 0, and a refused copy sent
    again would reach the engine after the requests routed meanwhile."""
    p = dataclasses.replace(prompt(), priority=1)
    assert await setup.manager.prewarm(setup.live, p)  # without the priority: answered
    assert held(setup.index, setup.live, p) == len(p.key.blocks)
    assert not await known(setup.manager, setup.live)  # the worker runs fcfs
    assert setup.manager.no_priority == [setup.live]
    assert await setup.manager.prewarm(setup.live, p)
    # Were it taken for one that takes it, the copy would carry it, be refused, and the
    # worker known to refuse it again.
    setup.manager.takes_priority[setup.live] = True
    assert not await setup.manager.prewarm(setup.live, p)
    assert setup.manager.no_priority == [setup.live]
    async with priority_worker(setup) as wid:
        assert await setup.manager.prewarm(wid, p)
        assert await known(setup.manager, wid)
        assert await setup.manager.prewarm(wid, p)  # now with it
        assert setup.manager.no_priority == [setup.live]
        setup.manager.left(setup.live)
        assert setup.manager.no_priority == []


async def test_with_a_copy_priority_each_worker_is_asked_once_it_serves(setup: Setup) -> None:
    """With ``copy_priority`` set, every worker is asked whether its engine takes it as soon
    as it serves: those in the pool at start-up, and one that joins later, so that the first
    copy to it already goes the right way. Without it, nobody is asked."""
    idle = WarmupManager(setup.pool, setup.index, setup.manager.sync,
                         setup.manager._backend_for, WarmupOptions())
    idle.start()
    manager = WarmupManager(setup.pool, setup.index, setup.manager.sync,
                            setup.manager._backend_for, WarmupOptions(copy_priority=1))
    manager.start()
    port = free_port()
    runner = await serve(create_worker(dataclasses.replace(
        FAST_WORKER, port=port, scheduling_policy="priority")), port)
    try:
        assert not await known(manager, setup.live)  # fcfs, asked at start-up
        wid = setup.pool.add(f"http://127.0.0.1:{port}")  # joins: asked once it serves
        await asyncio.sleep(0.1)
        assert wid not in manager.takes_priority
        setup.pool.mark_up(wid, frozenset({MODEL}), engine=REFERENCE_OWNER)
        assert await known(manager, wid)
        assert manager.no_priority == [setup.live]
        # Routing sees which engines run the copies at background priority (the volume
        # guard copies to those however busy they are).
        assert setup.pool.get(wid).view().copies_yield
        assert not setup.pool.get(setup.live).view().copies_yield
        assert setup.dead not in manager.takes_priority  # nothing answered: still unknown
        assert idle.takes_priority == {}
    finally:
        await manager.stop()
        await idle.stop()
        await runner.cleanup()


async def test_any_answer_but_200_counts_as_not_taking_the_priority(setup: Setup) -> None:
    """An engine that answers the question otherwise (here a 404: a model it does not
    serve) is taken not to take a priority, so it is not asked again at every copy; one
    that does not answer at all stays unknown."""
    worker = setup.pool.get(setup.live).worker
    setup.manager._probe_priority(worker, "no-such-model", 1)
    assert not await known(setup.manager, setup.live)
    assert setup.manager.no_priority == [setup.live]
    dead = setup.pool.get(setup.dead).worker
    setup.manager._probe_priority(dead, MODEL, 1)
    for _ in range(100):
        if dead.id not in setup.manager._probing:
            break
        await asyncio.sleep(0.01)
    assert dead.id not in setup.manager.takes_priority


async def test_an_engine_that_reads_priorities_otherwise_is_not_asked(setup: Setup) -> None:
    """An engine that does not take a priority as vLLM does (here one that names itself
    SGLang and answers any completion 200, as SGLang does unless started to refuse a priority
    it does not schedule by) is never asked: its 200 would not say that a copy yields, and
    SGLang by default runs higher values first. It is known not to take one, and its copies go
    without; one that does not name itself is not asked either, and stays unknown."""
    seen: list[dict[str, object]] = []
    app = engine_stub()

    async def complete(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"text": "x"}]})

    app.router.add_post("/v1/completions", complete)
    port = free_port()
    runner = await serve(app, port)
    try:
        sglang = setup.pool.add(f"http://127.0.0.1:{port}")
        setup.pool.mark_up(sglang, frozenset({MODEL}), engine="sglang")
        unnamed = setup.pool.add(f"http://127.0.0.1:{free_port()}")
        setup.pool.mark_up(unnamed, frozenset({MODEL}))
        p = dataclasses.replace(prompt(), priority=1)
        assert await setup.manager.prewarm(sglang, p)
        assert setup.manager.takes_priority.get(sglang) is False
        assert setup.manager.no_priority == [sglang]
        assert not setup.pool.get(sglang).view().copies_yield
        assert await setup.manager.prewarm(sglang, p)
        assert [body.get("priority") for body in seen] == [None, None]  # never sent, never asked
        setup.manager._probe_priority(setup.pool.get(unnamed).worker, MODEL, 1)
        assert unnamed not in setup.manager.takes_priority
    finally:
        await runner.cleanup()
