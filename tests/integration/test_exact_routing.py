"""Engine-exact routing end to end: reference workers publish KV events, the gateway tokenizes
prompts with the same tokenizer, and its predictions equal what the workers report."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.settings import GatewaySettings
from loadtest.tiny_tokenizer import train
from tests.conftest import FAST_WORKER, free_port, free_ports, serve, until
from worker.server import create_app as create_worker


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(train(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@dataclasses.dataclass
class Setup:
    gateway: str
    workers: dict[str, str]  # worker id -> URL
    runners: list[web.AppRunner]


async def start(
    tokenizer_file: str, *, evented: int = 2, plain: int = 1, chat_template: str = "reference",
    pending_ttl_s: float = 10.0, view: str = "hybrid",
) -> Setup:
    """``evented`` workers that publish KV events and ``plain`` ones whose cache the gateway
    models, all with the same tokenizer and chat template as the gateway."""
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    workers: dict[str, str] = {}
    for i in range(evented + plain):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        settings = dataclasses.replace(
            FAST_WORKER, port=port, cache_blocks=96, tokenizer_file=tokenizer_file,
            chat_template=chat_template)
        if i < evented:
            ev, rp = free_port(), free_port()
            settings = dataclasses.replace(
                settings, kv_events=f"tcp://127.0.0.1:{ev}", kv_replay=f"tcp://127.0.0.1:{rp}")
            urls.append(f"{url}#kv-events=tcp://127.0.0.1:{ev}&kv-replay=tcp://127.0.0.1:{rp}")
        else:
            urls.append(url)
        runners.append(await serve(create_worker(settings), port))
        workers[f"127.0.0.1:{port}"] = url
    gport = free_port()
    gsettings = GatewaySettings(port=gport, worker=tuple(urls), tokenizer_file=tokenizer_file,
                                chat_template=chat_template, kv_pending_ttl_s=pending_ttl_s,
                                kv_events_view=view)
    runners.insert(0, await serve(create_gateway(gsettings), gport))
    return Setup(f"http://127.0.0.1:{gport}", workers, runners)


@pytest.fixture
async def setup(tokenizer_file: str) -> AsyncIterator[Setup]:
    s = await start(tokenizer_file)
    yield s
    for runner in s.runners:
        await runner.cleanup()

async def admin(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with s.get(f"{base}/admin/workers") as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


async def chat(s: aiohttp.ClientSession, base: str, system: str, question: str,
               key: str = "k1") -> tuple[str, int]:
    body = {"model": FAST_WORKER.model, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}
    async with s.post(f"{base}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-route-worker"], int(r.headers["x-cache-matched-tokens"])


def system_prompt(i: int) -> str:
    return f"You are agent {i}. " + " ".join(f"rule {j} for the billing team" for j in range(60))


async def live(s: aiohttp.ClientSession, base: str, count: int) -> dict[str, Any]:
    for _ in range(200):
        view = await admin(s, base)
        if sum(w["cache_source"] == "events" for w in view["workers"]) == count:
            return view
        await asyncio.sleep(0.02)
    raise AssertionError("feeds did not go live")


async def test_predictions_are_exact_and_admin_names_the_source(setup: Setup) -> None:
    async with aiohttp.ClientSession() as s:
        view = await live(s, setup.gateway, 2)
        sources = {w["id"]: w["cache_source"] for w in view["workers"]}
        assert sorted(sources.values()) == ["events", "events", "model"]
        for i in range(36):
            await chat(s, setup.gateway, system_prompt(i % 6), f"question {i} about invoices",
                       key=f"k{i % 2}")
            await asyncio.sleep(0.01)  # let the events of this reply arrive
        view = await admin(s, setup.gateway)
        assert view["tokenizer"]["prompts"] == 36
        assert view["tokenizer"]["fallbacks"] == 0
        evented = [w for w in view["workers"] if w["cache_source"] == "events"]
        responses = sum(w["predictions"]["responses"] for w in evented)
        assert responses > 0
        assert sum(w["predictions"]["exact"] for w in evented) == responses
        assert all(w["kv_events"]["gaps"] == 0 and w["kv_events"]["blocks"] > 0 for w in evented)
        assert sum(w["matched_tokens"] for w in view["workers"]) > 0  # affinity found hits


async def test_responses_requests_get_token_keys_and_exact_predictions(setup: Setup) -> None:
    """A Responses request is keyed by the tokens of the chat it amounts to, which is the
    prompt the worker runs: predicted and reported cached tokens agree, as for chats."""
    async with aiohttp.ClientSession() as s:
        await live(s, setup.gateway, 2)
        for i in range(24):
            body = {"model": FAST_WORKER.model, "max_output_tokens": 2,
                    "instructions": system_prompt(i % 4),
                    "input": [{"role": "user", "content": f"question {i} about invoices"}]}
            async with s.post(f"{setup.gateway}/v1/responses", json=body,
                              headers={"Authorization": "Bearer k1"}) as r:
                assert r.status == 200, await r.text()
            await asyncio.sleep(0.01)  # let the events of this reply arrive
        view = await admin(s, setup.gateway)
    assert (view["tokenizer"]["prompts"], view["tokenizer"]["fallbacks"]) == (24, 0)
    evented = [w for w in view["workers"] if w["cache_source"] == "events"]
    responses = sum(w["predictions"]["responses"] for w in evented)
    assert responses > 0
    assert sum(w["predictions"]["exact"] for w in evented) == responses
    assert sum(w["matched_tokens"] for w in view["workers"]) > 0


async def test_a_flushed_worker_is_known_cold(setup: Setup) -> None:
    async with aiohttp.ClientSession() as s:
        view = await live(s, setup.gateway, 2)
        evented = {w["id"] for w in view["workers"] if w["cache_source"] == "events"}
        for i in range(40):  # a prompt the ring places on an event-fed worker
            system = system_prompt(100 + i)
            wid, _ = await chat(s, setup.gateway, system, "first")
            if wid in evented:
                break
        else:
            raise AssertionError("no prompt landed on an event-fed worker")
        await asyncio.sleep(0.05)
        again, matched = await chat(s, setup.gateway, system, "second")
        assert (again, matched > 0) == (wid, True)
        # A flush within --kv-events-skew-s of a request's end may have come before the engine
        # admitted it (the hybrid view keeps that request's prompt): flush a moment later.
        await asyncio.sleep(0.05)
        async with s.post(f"{setup.workers[wid]}/admin/flush") as r:
            assert r.status == 200
        await asyncio.sleep(0.05)  # AllBlocksCleared reaches the gateway
        view = await admin(s, setup.gateway)
        before = {w["id"]: w["predictions"]["exact"] for w in view["workers"]}
        where, matched = await chat(s, setup.gateway, system, "third")
        view = await admin(s, setup.gateway)
        after = {w["id"]: w["predictions"]["exact"] for w in view["workers"]}
        # Wherever it went, the prediction was exact: the gateway knew the cache was gone.
        assert after[where] == before[where] + 1
        assert matched == 0


async def test_blocks_another_gateway_stored_count_in_the_hybrid_view(
    setup: Setup, tokenizer_file: str,
) -> None:
    """A second gateway (no shared store) fills an event-fed worker's cache: the first
    gateway's model knows nothing of it, the events do. It routes the same prompt there and
    predicts the cached tokens exactly."""
    async with aiohttp.ClientSession() as s:
        view = await live(s, setup.gateway, 2)
        assert {w["kv_events"]["view"] for w in view["workers"] if w["kv_events"]} == {"hybrid"}
        target = sorted(w["id"] for w in view["workers"] if w["cache_source"] == "events")[1]
        port = free_port()
        other = await serve(create_gateway(GatewaySettings(
            port=port, worker=(setup.workers[target],), tokenizer_file=tokenizer_file)), port)
        setup.runners.append(other)
        system = system_prompt(500)
        where, _ = await chat(s, f"http://127.0.0.1:{port}", system, "first")
        assert where == target
        for _ in range(100):  # its store events reach the first gateway
            view = await admin(s, setup.gateway)
            feed = next(w for w in view["workers"] if w["id"] == target)["kv_events"]
            if feed["corrections"]["foreign_blocks"] > 0:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the worker's store events did not arrive")
        before = next(w for w in view["workers"] if w["id"] == target)["predictions"]
        where, matched = await chat(s, setup.gateway, system, "second")
        assert where == target  # the only worker holding the prefix
        assert matched > 0
        view = await admin(s, setup.gateway)
        after = next(w for w in view["workers"] if w["id"] == target)["predictions"]
        assert after["responses"] == before["responses"] + 1
        assert after["exact"] == before["exact"] + 1


async def test_bad_event_option_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker URL option"):
        create_gateway(GatewaySettings(worker=("http://127.0.0.1:1#kv-event=tcp://x:1",)))


JINJA = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_model_chat_template_and_bos_keep_predictions_exact(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A model whose Jinja template writes BOS and whose tokenizer adds BOS to completions:
    the gateway renders and encodes as the engine does, so event-fed predictions stay exact."""
    root = tmp_path_factory.mktemp("model")
    tok = str(train(root / "tokenizer.json", bos="<s>"))
    config = root / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": JINJA, "bos_token": "<s>"}))
    # Predictions from events alone (nothing counted as held on the gateway's own say-so).
    setup = await start(tok, evented=1, plain=0, chat_template=str(config), pending_ttl_s=0.0,
                        view="events")
    try:
        async with aiohttp.ClientSession() as s:
            await live(s, setup.gateway, 1)
            matched = []
            for i in range(8):
                _, m = await chat(s, setup.gateway, system_prompt(i % 2), f"question {i}")
                matched.append(m)
                body = {"model": FAST_WORKER.model, "max_tokens": 2,
                        "prompt": system_prompt(i % 2) + f" completion {i}"}
                async with s.post(f"{setup.gateway}/v1/completions", json=body,
                                  headers={"Authorization": "Bearer k1"}) as r:
                    assert r.status == 200, await r.text()
                await asyncio.sleep(0.05)  # this reply's events arrive
            view = await admin(s, setup.gateway)
        assert view["tokenizer"]["fallbacks"] == 0
        (worker,) = view["workers"]
        assert worker["predictions"]["responses"] == 16
        assert worker["predictions"]["exact"] == 16
        assert sum(matched[2:]) > 0  # repeated system prompts hit
    finally:
        for runner in setup.runners:
            await runner.cleanup()


async def test_each_data_parallel_rank_feeds_its_own_events(tokenizer_file: str) -> None:
    """One server of two engine ranks, listed with ``#dp-size=2`` and rank 0's event ports:
    the gateway reads each rank's events at the ports plus its rank, and its predictions for
    either rank are exact."""
    port = free_port()
    ev = free_ports(4)
    rp = ev + 2
    settings = dataclasses.replace(
        FAST_WORKER, port=port, cache_blocks=96, tokenizer_file=tokenizer_file,
        data_parallel_size=2, kv_events=f"tcp://127.0.0.1:{ev}",
        kv_replay=f"tcp://127.0.0.1:{rp}")
    worker = await serve(create_worker(settings), port)
    url = (f"http://127.0.0.1:{port}#dp-size=2&kv-events=tcp://127.0.0.1:{ev}"
           f"&kv-replay=tcp://127.0.0.1:{rp}")
    gport = free_port()
    gateway = await serve(create_gateway(GatewaySettings(
        port=gport, worker=(url,), tokenizer_file=tokenizer_file)), gport)
    base = f"http://127.0.0.1:{gport}"
    try:
        async with aiohttp.ClientSession() as s:
            view = await live(s, base, 2)
            feeds = {w["id"]: w["kv_events"]["endpoint"] for w in view["workers"]}
            assert feeds == {f"127.0.0.1:{port}/dp{r}": f"tcp://127.0.0.1:{ev + r}"
                             for r in range(2)}
            for i in range(24):
                await chat(s, base, system_prompt(i % 6), f"question {i} about invoices")
                await asyncio.sleep(0.01)  # let the events of this reply arrive
            view = await admin(s, base)
            # A prompt run on rank 1 directly reaches the gateway through rank 1's feed alone.
            body = {"model": FAST_WORKER.model, "prompt": system_prompt(50), "max_tokens": 1}
            before = {w["id"]: w["kv_events"]["events"] for w in view["workers"]}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                              headers={"X-data-parallel-rank": "1"}) as r:
                assert r.status == 200

            async def grown() -> bool:
                after = {w["id"]: w["kv_events"]["events"]
                         for w in (await admin(s, base))["workers"]}
                return bool(after[f"127.0.0.1:{port}/dp1"] > before[f"127.0.0.1:{port}/dp1"])

            await until(grown)
            after = {w["id"]: w["kv_events"]["events"] for w in (await admin(s, base))["workers"]}
            assert after[f"127.0.0.1:{port}/dp0"] == before[f"127.0.0.1:{port}/dp0"]
        ranks = view["workers"]
        responses = sum(w["predictions"]["responses"] for w in ranks)
        assert responses > 0
        assert sum(w["predictions"]["exact"] for w in ranks) == responses
    finally:
        await gateway.cleanup()
        await worker.cleanup()
