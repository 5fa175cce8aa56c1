"""Token buckets, tenant limits and the admission queue (a hand-driven clock, no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.limits import (
    AdmissionQueue,
    BodyBudget,
    LimitOptions,
    Limits,
    RateLimited,
    TokenBucket,
)
from gateway.normalize import NormalizeOptions
from gateway.openai_schema import parse_completion


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_and_says_how_long_to_wait() -> None:
    bucket = TokenBucket(rate=1.0, capacity=3.0, now=0.0)
    assert [bucket.take(1, 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(1, 0.0) == pytest.approx(1.0)
    assert bucket.take(1, 0.5) == pytest.approx(0.5)
    assert bucket.take(1, 1.0) == 0.0
    # Larger than the bucket: admitted once it is full, leaving it in debt.
    assert bucket.take(10, 1.0) > 0
    assert bucket.take(10, 4.0) == 0.0
    assert bucket.take(1, 4.0) == pytest.approx(8.0)


def test_tenant_buckets_are_separate_and_refused_requests_cost_nothing() -> None:
    clock = Clock()
    limits = Limits(LimitOptions(tenant_rpm=2, tenant_tpm=100), clock)
    limits.tenants.admit("a", 40)
    limits.tenants.admit("a", 40)
    with pytest.raises(RateLimited) as caught:
        limits.tenants.admit("a", 1)
    assert caught.value.status == 429
    assert caught.value.headers["Retry-After"] == "30"
    limits.tenants.admit("b", 40)  # another tenant has its own buckets
    clock.now = 30.0
    with pytest.raises(RateLimited, match="tokens per minute"):
        limits.tenants.admit("a", 90)  # a request came back, the tokens did not
    clock.now = 60.0
    limits.tenants.admit("a", 90)  # the refusal above took nothing from the request bucket


def test_tenant_concurrency_cap() -> None:
    limits = Limits(LimitOptions(tenant_concurrency=2))
    limits.tenants.admit("a", 1)
    limits.tenants.admit("a", 1)
    with pytest.raises(RateLimited) as caught:
        limits.tenants.admit("a", 1)
    assert caught.value.code == "concurrency_limit_exceeded"
    limits.tenants.admit("b", 1)
    limits.tenants.release("a")
    limits.tenants.admit("a", 1)


async def test_admission_queue_is_bounded_fifo_and_times_out() -> None:
    queue = AdmissionQueue(max_inflight=1, max_queue=2, timeout_s=60)
    await queue.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await queue.acquire()
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
    await asyncio.sleep(0)
    assert queue.queued == 2
    with pytest.raises(RateLimited) as caught:
        await queue.acquire()  # the queue is full
    assert caught.value.code == "server_overloaded"
    queue.release()
    await asyncio.sleep(0)
    queue.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1]
    assert queue.inflight == 1
    short = AdmissionQueue(max_inflight=1, max_queue=1, timeout_s=0.01)
    await short.acquire()
    with pytest.raises(RateLimited, match="waited"):
        await short.acquire()
    assert short.queued == 0
    short.release()
    assert short.inflight == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    queue = AdmissionQueue(max_inflight=1, max_queue=4, timeout_s=60)
    await queue.acquire()
    task = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    queue.release()
    assert queue.inflight == 0
    await queue.acquire()
    assert queue.inflight == 1


def test_a_batch_counts_every_prompt_and_choice() -> None:
    opts = NormalizeOptions()
    one = parse_completion({"model": "m", "prompt": "x" * 400}, opts)
    batch = parse_completion({"model": "m", "prompt": ["x" * 400] * 64, "n": 2}, opts)
    assert (one.prompt_chars, one.sequences) == (400, 1)
    assert (batch.prompt_chars, batch.sequences) == (64 * 400, 128)
    ids = parse_completion({"model": "m", "prompt": [[1, 2, 3]] * 10}, opts)
    assert (ids.prompt_token_ids, ids.sequences) == (30, 10)


def test_the_check_before_a_body_is_read_refuses_what_admit_would_and_takes_nothing() -> None:
    clock = Clock()
    limits = Limits(LimitOptions(tenant_rpm=2, tenant_tpm=100, tenant_concurrency=3,
                                 max_inflight=1, max_queue=0), clock)
    for _ in range(5):
        limits.check("a")  # a tenant not seen yet, then one with a full bucket: takes nothing
    limits.tenants.admit("a", 10)
    limits.check("a")
    limits.tenants.admit("a", 10)
    with pytest.raises(RateLimited, match="requests per minute") as caught:
        limits.check("a")  # the request bucket is empty: refused whatever the body costs
    assert caught.value.headers["Retry-After"] == "30"
    limits.check("b")
    clock.now = 30.0
    limits.check("a")
    limits.tenants.admit("a", 150)  # a request larger than the token bucket leaves it in debt
    for _ in range(3):
        limits.tenants.release("a")
    clock.now = 60.0
    with pytest.raises(RateLimited, match="tokens per minute"):
        limits.check("a")  # the request bucket has room again, the token bucket has none
    concurrent = Limits(LimitOptions(tenant_concurrency=1, max_inflight=1, max_queue=0))
    concurrent.tenants.admit("c", 1)
    with pytest.raises(RateLimited) as caught:
        concurrent.check("c")
    assert caught.value.code == "concurrency_limit_exceeded"
    assert concurrent.queue.take_free()
    with pytest.raises(RateLimited) as caught:
        concurrent.check("d")  # every place taken, no room in the queue
    assert caught.value.code == "server_overloaded"
    concurrent.queue.release()
    concurrent.check("d")


def test_the_body_budget_refuses_what_does_not_fit_and_takes_nothing_then() -> None:
    budget = BodyBudget(1000)
    first = budget.hold(600)
    with pytest.raises(RateLimited) as caught:
        budget.hold(500)
    assert caught.value.status == 429
    assert caught.value.code == "server_overloaded"
    assert budget.held == 600
    assert budget.refused == 1
    chunked = budget.hold(None)  # a chunked body: nothing until its chunks arrive
    chunked.grow(300)
    with pytest.raises(RateLimited):
        chunked.grow(200)
    assert budget.held == 900
    assert chunked.size == 300
    first.release()
    assert budget.held == 300
    chunked.grow(200)  # fits now
    chunked.release()
    chunked.release()  # a second release gives back nothing more
    assert budget.held == 0
    assert BodyBudget(0).hold(10**12).size == 10**12  # no limit
