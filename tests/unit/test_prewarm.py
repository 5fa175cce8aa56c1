"""Predictive pre-warming: when a hot prefix's holder nears its bound, the next holder gets it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any

import pytest

from gateway.backends.base import UpstreamRequest
from gateway.fingerprint import Namespace, PrefixKey, fingerprint
from gateway.normalize import render_chat
from gateway.pool import WorkerPool
from gateway.prewarm import LeadingIds, PreWarmer, PrewarmOptions, held_prefix
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Decision, DecisionKind, RouteRequest
from gateway.warmup_sources import WarmPrompt

URLS = [f"http://10.0.0.{i}:8001" for i in range(1, 5)]
Later = Coroutine[Any, Any, WarmPrompt] | None  # a copy's request, ready later
TEXT = "You are the support desk. " * 40


def setup(heat: int) -> tuple[WorkerPool, PrefixIndex, RouteRequest, str]:
    index = PrefixIndex()
    pool = WorkerPool(URLS, index)
    for state in pool.states():
        pool.mark_up(state.worker.id, frozenset({"m"}))
    key = fingerprint(TEXT, Namespace(model="m"))
    request = RouteRequest(key=key, model="m", cost_tokens=300, prompt_tokens=250)
    holder = pool.ring.owner(key.anchor)
    assert holder is not None
    for _ in range(heat):
        index.record(key.blocks, holder, 0.0, key.depths)
    return pool, index, request, holder


def half_held(asked: int) -> tuple[WorkerPool, PrefixIndex, RouteRequest, str]:
    """The holder holds the first half of the prompt, which ``asked`` requests ended with."""
    pool, index, request, holder = setup(heat=0)
    key = request.key
    half = key.checkpoints_within(key.total_blocks // 2)
    for _ in range(asked):
        index.record(key.blocks[:half], holder, 0.0, key.depths[:half])
    return pool, index, request, holder


def decision(pool: WorkerPool, holder: str, depth: int, inflight: int, bound: float,
             requests: int) -> Decision:
    view = pool.snapshot(0.0).by_id[holder]  # type: ignore[index]
    view = type(view)(view.worker, True, requests, inflight)
    return Decision(worker=view, policy="cache_aware", kind=DecisionKind.PREFIX_HIT,
                    match_blocks=depth, load_bound=bound)


async def run(heat: int, inflight: int, depth: int | None = None, calls: int = 1,
              requests: int = 3) -> list[str]:
    pool, index, request, holder = setup(heat)
    placed: list[str] = []

    async def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> bool:
        placed.append(wid)
        index.record(prompt.key.blocks, wid, 0.0, prompt.key.depths)
        return True

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    d = request.key.total_blocks if depth is None else depth
    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    for _ in range(calls):
        warmer.after_route(decision(pool, holder, d, inflight, 1000.0, requests), request,
                           upstream, "", 0.0)
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    expected = next(w for w in pool.ring.walk(request.key.anchor) if w != holder)
    assert all(w == expected for w in placed)
    return placed


async def test_hot_prefix_near_its_bound_goes_to_the_next_worker_on_the_ring_once() -> None:
    assert len(await run(heat=10, inflight=900, calls=3)) == 1  # then the cooldown holds


async def test_the_prewarm_is_handed_over_at_its_decision() -> None:
    """The replay is called inside ``after_route``, before any other request is decided (the
    manager records the pre-warm then, as a routed request is recorded at its decision);
    only its sending waits for the task."""
    pool, index, request, holder = setup(10)
    called: list[str] = []

    def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> Awaitable[bool]:
        called.append(wid)
        return asyncio.sleep(0, True)

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    warmer.after_route(decision(pool, holder, request.key.total_blocks, 900, 1000.0, 3),
                       request, upstream, "", 0.0)
    assert called == [next(w for w in pool.ring.walk(request.key.anchor) if w != holder)]
    assert warmer.stats()["inflight"] == 1
    await asyncio.sleep(0.01)
    assert (warmer.stats()["placed"], warmer.stats()["inflight"]) == (1, 0)


async def test_a_prewarm_counts_used_once_a_request_is_routed_to_its_copy() -> None:
    """A later decision that sends the prefix to the pre-warmed worker uses the pre-warm
    (once); decisions to its holder, or without a match there, do not."""
    pool, index, request, holder = setup(10)

    def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> Awaitable[bool]:
        index.record(prompt.key.blocks, wid, 0.0, prompt.key.depths)
        return asyncio.sleep(0, True)

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    blocks = request.key.total_blocks
    warmer.after_route(decision(pool, holder, blocks, 900, 1000.0, 3), request, upstream, "",
                       0.0)
    copy = next(w for w in pool.ring.walk(request.key.anchor) if w != holder)
    assert (warmer.sent, warmer.used) == (1, 0)
    used = []
    for wid, depth in ((holder, blocks), (copy, 0), (copy, blocks), (copy, blocks)):
        warmer.target(decision(pool, wid, depth, 0, 1000.0, 1), request, 1.0, 0)
        used.append(warmer.used)
    assert used == [0, 0, 1, 1]
    await asyncio.sleep(0.01)
    assert warmer.stats()["used"] == 1


async def test_cool_prefix_or_low_load_or_a_miss_is_left_alone() -> None:
    assert await run(heat=3, inflight=900) == []
    assert await run(heat=10, inflight=100) == []
    assert await run(heat=10, inflight=900, depth=0) == []
    assert await run(heat=10, inflight=900, requests=1) == []  # one request: at the floor


async def cost_rule(asked: int) -> tuple[list[list[str]], str]:
    """The cost rule alone (the prefix is not hot): the holder holds the first half of the
    prompt, which ``asked`` requests ended with; a little prefill is queued on it, then much
    more, with a decision after each. The pre-warms placed after each, and the worker next
    on the ring."""
    pool, index, request, holder = half_held(asked)
    placed: list[str] = []

    async def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> bool:
        placed.append(wid)
        return True

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    d = decision(pool, holder, request.key.total_blocks // 2, 0, 1000.0, 3)
    after: list[list[str]] = []
    for tokens, prefill in ((300, 100), (3000, 2500)):
        pool.acquire(holder, tokens, prefill=prefill)
        warmer.after_route(d, request, upstream, "", 0.0)
        await asyncio.sleep(0.01)
        after.append(list(placed))
    return after, next(w for w in pool.ring.walk(request.key.anchor) if w != holder)


async def test_a_holder_whose_queue_outgrows_the_prefill_a_move_adds_warms_the_next() -> None:
    """The holder of half the prompt, asked for again: a little queued prefill is far from
    the half it saves; then its queued prefill above the pool's mean nears what a move would
    add (0.75 x 2,600 >= 0.8 x 125 x 11.4), so the spread is near and the next is warmed."""
    after, expected = await cost_rule(asked=2)
    assert after == [[], [expected]]


async def test_a_prefix_asked_for_once_is_not_warmed_however_long_the_queue() -> None:
    """The cost rule's spread needs the prefix again while the holder is busy: a prefix
    asked for once (a conversation's previous turn) is left where it is, since its copy
    would only evict other prefixes from the next worker's cache."""
    after, _ = await cost_rule(asked=1)
    assert after == [[], []]


async def copy_of_half(path: str, body: dict[str, Any], text: str, block_tokens: int = 0,
                       whole: bool = False, leading_ids: LeadingIds | None = None,
                       ) -> tuple[WarmPrompt, PrefixKey, int]:
    """The pre-warm of a request whose holder held the first half of its prompt (``text``,
    its fingerprint text), asked for twice before, decided onto that holder while much
    prefill is queued there; the request's key; the pre-warmer's count of cut copies."""
    index = PrefixIndex()
    pool = WorkerPool(URLS, index)
    for state in pool.states():
        pool.mark_up(state.worker.id, frozenset({"m"}))
    key = fingerprint(text, Namespace(model="m"))
    request = RouteRequest(key=key, model="m", cost_tokens=300, prompt_tokens=250,
                           block_tokens=block_tokens)
    holder = pool.ring.owner(key.anchor)
    assert holder is not None
    half = key.checkpoints_within(key.total_blocks // 2)
    for _ in range(2):
        index.record(key.blocks[:half], holder, 0.0, key.depths[:half])
    index.record(key.blocks, holder, 0.0, key.depths)  # at its decision
    copies: list[WarmPrompt] = []

    async def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> bool:
        copies.append(await later if later is not None else prompt)
        return True

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0, fraction=0.8,
                                                           whole=whole), leading_ids)
    pool.acquire(holder, 3000, prefill=2500)
    warmer.after_route(decision(pool, holder, key.depth_at(half - 1), 0, 1000.0, 3), request,
                       UpstreamRequest(path, body), "", 0.0)
    await asyncio.sleep(0.01)
    assert len(copies) == 1
    cut = warmer.stats()["cut"]
    assert isinstance(cut, int)
    return copies[0], key, cut


async def test_a_prewarm_copies_the_held_prefix_of_a_completions_prompt() -> None:
    """Only the prefix the holder held is copied (what a later request for it reuses; the
    rest is this request's own), keyed as its own text would be."""
    prompt = TEXT + "Question: where is my parcel? " * 10
    copy, key, cut = await copy_of_half("/v1/completions", {"model": "m", "prompt": prompt},
                                        prompt)
    assert cut == 1
    chars = key.total_blocks // 2 * 64
    assert copy.body["prompt"] == prompt[:chars]
    assert copy.key.blocks == fingerprint(prompt[:chars], Namespace(model="m")).blocks
    assert copy.key.text_chars == chars
    assert copy.key.anchor == key.anchor
    assert copy.replay_body()["max_tokens"] == 1


async def test_a_prewarm_copies_the_held_prefix_of_a_chat() -> None:
    """A chat is cut inside the message the held prefix ends in; its rendering is the
    request's text up to the cut."""
    messages = [{"role": "system", "content": TEXT},
                {"role": "user", "content": "Document: " + "the parcel went north. " * 60}]
    text = render_chat(messages)
    copy, key, cut = await copy_of_half("/v1/chat/completions",
                                        {"model": "m", "messages": messages}, text)
    assert cut == 1
    chars = key.total_blocks // 2 * 64
    assert len(copy.body["messages"]) == 2  # cut inside the user's document
    assert render_chat(copy.body["messages"]) == text[:chars]
    assert copy.key.blocks == fingerprint(text[:chars], Namespace(model="m")).blocks


async def test_a_prewarm_told_so_copies_the_whole_request() -> None:
    """``--prewarm-whole``: no cut."""
    prompt = TEXT + "Question: where is my parcel? " * 10
    body = {"model": "m", "prompt": prompt}
    copy, key, cut = await copy_of_half("/v1/completions", body, prompt, whole=True)
    assert cut == 0
    assert copy.body == body
    assert copy.key == key


async def test_a_session_the_volume_guard_moves_is_copied_whole_whatever_the_rule() -> None:
    """A decision naming a worker to copy its session to (``copy_to``) is pre-warmed there
    even with the pre-warm rule off and nothing queued on the holder: the whole request
    (its next turn extends all of it)."""
    pool, index, request, holder = half_held(asked=0)
    prompt = TEXT + "Observation: the tests pass. " * 10
    body = {"model": "m", "prompt": prompt}
    other = next(w for w in pool.ring.walk(request.key.anchor) if w != holder)
    copies: list[tuple[str, WarmPrompt]] = []

    async def replay(wid: str, copy: WarmPrompt, later: Later = None) -> bool:
        copies.append((wid, copy))
        return True

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(enabled=False))
    view = pool.snapshot(0.0).by_id[holder]  # type: ignore[index]
    kept = Decision(worker=view, policy="cache_aware", kind=DecisionKind.PREFIX_HIT,
                    match_blocks=request.key.total_blocks // 2, copy_to=other)
    upstream = UpstreamRequest("/v1/completions", body)
    assert warmer.after_route(kept, request, upstream, "", 0.0) == other
    await asyncio.sleep(0.01)
    assert [(wid, c.body, c.key) for wid, c in copies] == [(other, body, request.key)]
    assert warmer.stats()["sessions"] == 1
    assert warmer.stats()["cut"] == 0
    # The pool counts it in flight on its worker until it is answered (the volume guard
    # sends no other copy there meanwhile).
    gate = asyncio.Event()

    async def slow(wid: str, copy: WarmPrompt, later: Later = None) -> bool:
        await gate.wait()
        return True

    warmer._replay = slow
    assert warmer.after_route(kept, request, upstream, "", 0.0) == other
    assert pool.snapshot(0.0).by_id[other].copies == 1  # type: ignore[index]
    # Meanwhile the session's next turn asks for a copy again (the index records one only
    # once it answered): none is sent while this one is under way; another session's is.
    following = RouteRequest(key=fingerprint(prompt + "Observation: done. " * 20,
                                             Namespace(model="m")),
                             model="m", cost_tokens=300, prompt_tokens=300)
    assert warmer.after_route(kept, following, upstream, "", 0.0) is None
    assert warmer.stats()["copies_waited"] == 1
    stranger = RouteRequest(key=fingerprint("Another session. " * 40, Namespace(model="m")),
                            model="m", cost_tokens=300, prompt_tokens=300)
    assert warmer.after_route(kept, stranger, upstream, "", 0.0) == other
    gate.set()
    await asyncio.sleep(0.01)
    assert pool.snapshot(0.0).by_id[other].copies == 0  # type: ignore[index]
    assert warmer.after_route(kept, following, upstream, "", 0.0) == other
    # Without ``copy_to`` the rule decides, and it is off.
    plain = Decision(worker=view, policy="cache_aware", kind=DecisionKind.PREFIX_HIT,
                     match_blocks=request.key.total_blocks // 2)
    assert warmer.after_route(plain, request, upstream, "", 0.0) is None


async def test_a_session_copy_goes_at_the_copy_priority_and_other_prewarms_without() -> None:
    """With ``copy_priority`` a session copy asks the engine to schedule it at that priority
    (vLLM's ``priority``, lower first): its replay body carries it. A pre-warm of a hot
    prefix carries none: its spread is imminent, it must be ready first."""
    pool, index, request, holder = half_held(asked=0)
    body = {"model": "m", "prompt": TEXT + "Observation: the tests pass. " * 10,
            "priority": -3}
    other = next(w for w in pool.ring.walk(request.key.anchor) if w != holder)
    copies: list[WarmPrompt] = []

    async def replay(wid: str, copy: WarmPrompt, later: Later = None) -> bool:
        copies.append(copy)
        return True

    view = pool.snapshot(0.0).by_id[holder]  # type: ignore[index]
    kept = Decision(worker=view, policy="cache_aware", kind=DecisionKind.PREFIX_HIT,
                    match_blocks=request.key.total_blocks // 2, copy_to=other)
    upstream = UpstreamRequest("/v1/completions", body)
    for priority in (0, 7):
        warmer = PreWarmer(pool, index, replay, PrewarmOptions(enabled=False,
                                                               copy_priority=priority))
        assert warmer.after_route(kept, request, upstream, "", 0.0) == other
        await asyncio.sleep(0.01)
        warmer.copied(other, request.key)
    # Without a copy priority the body's own is kept; with one, it replaces it.
    assert [(c.priority, c.replay_body()["priority"]) for c in copies] == [(0, -3), (7, 7)]
    pool, index, request, holder = setup(10)
    hot: list[WarmPrompt] = []

    async def keep(wid: str, copy: WarmPrompt, later: Later = None) -> bool:
        hot.append(copy)
        return True

    warmer = PreWarmer(pool, index, keep, PrewarmOptions(hot_threshold=8.0, fraction=0.8,
                                                         copy_priority=7))
    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    d = request.key.total_blocks
    assert warmer.after_route(decision(pool, holder, d, 900, 1000.0, 3), request, upstream, "",
                              0.0) is not None
    await asyncio.sleep(0.01)
    assert [(c.priority, "priority" in c.replay_body()) for c in hot] == [(0, False)]


def test_a_replayed_copy_of_a_session_counts_as_one_wherever_it_went() -> None:
    """The simulator at a live run's decision instants: where its decision asks for a copy of
    the session and the live gateway copied it (to whichever worker), that copy is placed
    as the session's copy (counted, and the worker making it given no other)."""
    pool, index, request, holder = half_held(asked=0)
    warmer = PreWarmer(pool, index, _never, PrewarmOptions())
    view = pool.snapshot(0.0).by_id[holder]  # type: ignore[index]
    others = [w for w in pool.ring.walk(request.key.anchor) if w != holder]
    asked = Decision(worker=view, policy="cache_aware", kind=DecisionKind.PREFIX_HIT,
                     match_blocks=request.key.total_blocks // 2, copy_to=others[0])
    assert warmer.replayed(asked, request, 0.0, others[1]) == others[1]
    assert warmer.stats()["sessions"] == 1
    assert pool.snapshot(0.0).by_id[others[1]].copies == 1  # type: ignore[index]
    warmer.copied(others[1], request.key)
    assert pool.snapshot(0.0).by_id[others[1]].copies == 0  # type: ignore[index]


def test_a_session_copy_counts_used_when_the_sessions_next_turn_goes_to_it() -> None:
    """A copy of a session is used by the session's next turn routed to the worker it was
    copied to (once); not by a turn on the holder, nor by another prompt sent there."""
    pool, index, request, holder = half_held(asked=0)
    warmer = PreWarmer(pool, index, _never, PrewarmOptions())
    view = pool.snapshot(0.0).by_id[holder]  # type: ignore[index]
    other = next(w for w in pool.ring.walk(request.key.anchor) if w != holder)
    blocks = request.key.total_blocks
    asked = Decision(worker=view, policy="cache_aware", kind=DecisionKind.PREFIX_HIT,
                     match_blocks=blocks // 2, copy_to=other)
    assert warmer.replayed(asked, request, 0.0, other) == other
    following = RouteRequest(key=fingerprint(TEXT + "Observation: done. " * 20,
                                             Namespace(model="m")),
                             model="m", cost_tokens=400, prompt_tokens=350)
    stranger = RouteRequest(key=fingerprint("Another session. " * 80, Namespace(model="m")),
                            model="m", cost_tokens=400, prompt_tokens=350)
    used = []
    for wid, turn in ((holder, following), (other, stranger), (other, following),
                      (other, following)):
        warmer.target(decision(pool, wid, blocks, 0, 1000.0, 1), turn, 1.0, 0)
        used.append(warmer.used)
    assert used == [0, 0, 1, 1]


async def _never(wid: str, prompt: WarmPrompt, later: Later = None) -> bool:
    raise AssertionError("nothing is sent when a known pre-warm is replayed")


async def test_with_token_keys_a_prewarm_copies_the_held_token_ids() -> None:
    """Token-exact keys count tokens: the held prefix is sent as a completions request of its
    token ids (a chat's too), keyed by the held blocks; without the ids (no tokenizer, an
    image in the chat), the whole request."""
    messages = [{"role": "system", "content": TEXT},
                {"role": "user", "content": "Document: " + "the parcel went north. " * 60}]
    body = {"model": "m", "messages": messages}
    asked: list[int] = []

    async def ids(upstream: UpstreamRequest, tokens: int) -> list[int] | None:
        asked.append(tokens)
        return list(range(tokens))

    copy, key, cut = await copy_of_half("/v1/chat/completions", body, render_chat(messages),
                                        block_tokens=16, leading_ids=ids)
    assert cut == 1
    half = key.total_blocks // 2
    assert asked == [half * 16]
    assert copy.path == "/v1/completions"
    assert copy.body == {"model": "m", "prompt": list(range(half * 16))}
    assert copy.key.blocks == key.blocks[:half]
    assert copy.key.text_chars == half * 16  # tokens

    async def none(upstream: UpstreamRequest, tokens: int) -> list[int] | None:
        return None

    copy, key, cut = await copy_of_half("/v1/chat/completions", body, render_chat(messages),
                                        block_tokens=16, leading_ids=none)
    assert cut == 0
    assert copy.body == body
    assert copy.key == key


async def from_a_trunk(branches: str) -> tuple[list[str], str]:
    """A 4-block trunk on its holder that earlier prompts went on from, as ``branches``:
    "sessions" (their next turns extended them) or "documents" (questions on one shared it
    from inside); then a request with 8 blocks of its own past the trunk, decided onto the
    holder of the trunk while much prefill is queued there. The pre-warms placed, and the
    worker next on the ring."""
    index = PrefixIndex()
    pool = WorkerPool(URLS, index)
    for state in pool.states():
        pool.mark_up(state.worker.id, frozenset({"m"}))
    trunk = (1, 2, 3, 4)
    blocks = (*trunk, *range(100, 108))
    request = RouteRequest(key=PrefixKey(blocks, blocks[3], 64 * len(blocks)), model="m",
                           cost_tokens=300, prompt_tokens=250)
    holder = pool.ring.owner(request.key.anchor)
    assert holder is not None
    tails = ([(10, 11), (20, 21), (20, 21, 22), (20, 21, 22, 23)] if branches == "sessions"
             else [(10, 11, 12), (20, 21, 22), (20, 21, 23), (20, 21, 24)])
    for tail in tails:
        index.record((*trunk, *tail), holder, 0.0)
    index.record(blocks, holder, 0.0)  # recorded at its decision, before the pre-warmer runs
    placed: list[str] = []

    async def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> bool:
        placed.append(wid)
        return True

    warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    pool.acquire(holder, 3000, prefill=2500)
    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    warmer.after_route(decision(pool, holder, len(trunk), 0, 1000.0, 3), request, upstream, "",
                       0.0)
    await asyncio.sleep(0.01)
    return placed, next(w for w in pool.ring.walk(request.key.anchor) if w != holder)


async def test_a_request_past_a_fork_of_sessions_is_not_copied_for_the_trunk() -> None:
    """Past a trunk whose branches are documents, the questions on each share it, and it is
    copied when the holder's queue nears what a move adds; a trunk whose branches are
    sessions would be used by new sessions only (the next turns go to their own holders),
    which without the copy prefill it once anyway: it is not copied."""
    placed, expected = await from_a_trunk("documents")
    assert placed == [expected]
    placed, _ = await from_a_trunk("sessions")
    assert placed == []


async def test_stats_count_what_was_sent_placed_failed_and_in_flight() -> None:
    """The counts ``/admin/workers`` shows: a pre-warm the worker refused is failed, one still
    waiting for its worker is in flight, and none is counted placed before it answers."""
    answers: list[asyncio.Future[bool]] = []

    async def replay(wid: str, prompt: WarmPrompt, later: Later = None) -> bool:
        answers.append(asyncio.get_running_loop().create_future())
        return await answers[-1]

    upstream = UpstreamRequest("/v1/completions", {"model": "m", "prompt": TEXT})
    warmers = []
    for _ in range(3):  # three prefixes' worth: one pre-warm each (a warmer per prefix)
        pool, index, request, holder = setup(heat=10)
        warmer = PreWarmer(pool, index, replay, PrewarmOptions(hot_threshold=8.0))
        warmer.after_route(decision(pool, holder, request.key.total_blocks, 900, 1000.0, 3),
                           request, upstream, "", 0.0)
        warmers.append(warmer)
    await asyncio.sleep(0)
    assert [w.stats()["inflight"] for w in warmers] == [1, 1, 1]
    assert all(w.stats()["placed"] == 0 for w in warmers)
    answers[0].set_result(True)
    answers[1].set_result(False)
    await asyncio.sleep(0.01)
    stats = [w.stats() for w in warmers]
    assert [(s["sent"], s["placed"], s["failed"], s["inflight"]) for s in stats] == [
        (1, 1, 0, 0), (1, 0, 1, 0), (1, 0, 0, 1)]
    await warmers[2].stop()


def test_a_known_prewarm_is_counted_as_the_rule_would_whatever_the_rule_says() -> None:
    # The simulator replays a live run's pre-warms (PreWarmer.replayed): placed where the live
    # gateway placed them, none where it placed none, and counted (sent, cooldown, used) as
    # target() counts its own.
    pool, index, request, holder = setup(heat=10)
    other = next(w for w in pool.ring.walk(request.key.anchor) if w != holder)
    warmer = PreWarmer(pool, index, lambda wid, prompt, later: asyncio.sleep(0, True),
                       PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    busy = decision(pool, holder, request.key.total_blocks, 900, 1000.0, 3)
    assert warmer.target(busy, request, 0.0, 0) == other  # the rule fires here ...
    warmer = PreWarmer(pool, index, lambda wid, prompt, later: asyncio.sleep(0, True),
                       PrewarmOptions(hot_threshold=8.0, fraction=0.8))
    assert warmer.replayed(busy, request, 0.0, "") is None  # ... but live placed none
    assert warmer.sent == 0
    idle = decision(pool, holder, request.key.total_blocks, 0, 1000.0, 0)
    assert warmer.target(idle, request, 0.0, 0) is None  # the rule does not fire here ...
    assert warmer.replayed(idle, request, 1.0, other) == other  # ... but live placed one
    assert warmer.sent == 1
    assert warmer.target(busy, request, 2.0, 0) is None  # its cooldown holds
    used = decision(pool, other, request.key.total_blocks, 0, 1000.0, 0)
    warmer.replayed(used, request, 3.0, "")
    assert warmer.used == 1  # a later request routed to the pre-warmed worker used it


@pytest.mark.parametrize("match", [5, 100, 257, 700, 1500, 2999])
def test_the_held_prefix_is_keyed_as_its_own_text_would_be(match: int) -> None:
    """Past the dense blocks the checkpoints thin out; the held prefix of a long prompt is
    still the key of the text cut where it ends, checkpoint for checkpoint."""
    text = "".join(f"line {i} of a long document\n" for i in range(7000))
    key = fingerprint(text, Namespace(model="m"))
    held = held_prefix(key, match, 64)
    own = fingerprint(text[:held.text_chars], Namespace(model="m"))
    assert (held.blocks, held.depths) == (own.blocks, own.depths)
    assert held.total_blocks <= match
