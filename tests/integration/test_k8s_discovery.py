"""Workers discovered from Kubernetes: the gateway lists and watches pods on a Kubernetes API
test server (``tests/k8s_api.py``, the real wire format) and routes to the reference workers
those pods name, over real HTTP, as they become ready, stop being ready and go."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.app import create_app as create_gateway
from gateway.settings import GatewaySettings
from tests.conftest import (
    FAST_WORKER,
    MODEL,
    Processes,
    admin_workers,
    free_port,
    serve,
    until,
)
from tests.k8s_api import KubernetesAPI, pod
from worker.server import create_app as create_worker


@dataclasses.dataclass
class Setup:
    api: KubernetesAPI
    api_url: str
    token_file: Path
    ports: list[int]  # the reference workers' ports
    runners: list[web.AppRunner]

    async def gateway(self, **overrides: Any) -> tuple[str, web.AppRunner]:
        port = free_port()
        settings = dataclasses.replace(
            GatewaySettings(port=port, k8s_selector="app=vllm", k8s_api_url=self.api_url,
                            k8s_port="http", k8s_token_file=str(self.token_file),
                            health_interval_s=0.2, warmup=False),
            **overrides)
        runner = await serve(create_gateway(settings), port)
        self.runners.append(runner)
        return f"http://127.0.0.1:{port}", runner


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    api = KubernetesAPI()
    api_port = free_port()
    runners = [await serve(api.app(), api_port)]
    ports = []
    for _ in range(3):
        port = free_port()
        runners.append(await serve(create_worker(dataclasses.replace(FAST_WORKER, port=port)),
                                   port))
        ports.append(port)
    token_file = tmp_path / "token"
    token_file.write_text(api.token + "\n")
    s = Setup(api, f"http://127.0.0.1:{api_port}", token_file, ports, runners)
    yield s
    for runner in reversed(s.runners):  # gateways first, then the workers and the API
        await runner.cleanup()


async def workers_of(http: aiohttp.ClientSession, gateway: str) -> dict[str, dict[str, Any]]:
    return await admin_workers(http, gateway)


async def test_ready_pods_are_workers_and_follow_the_pods_changes(setup: Setup) -> None:
    api = setup.api
    await api.put(pod("engine-a", setup.ports[0]))
    await api.put(pod("engine-b", setup.ports[1]))
    await api.put(pod("engine-c", setup.ports[2], ready=False))
    await api.put(pod("other", setup.ports[2], labels={"app": "something-else"}))
    gateway, _ = await setup.gateway()
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    async with aiohttp.ClientSession() as http:
        # Listed before the first health round: ready at once, named by their pods.
        workers = await workers_of(http, gateway)
        assert set(workers) == {"engine-a", "engine-b"}
        assert workers["engine-a"]["url"] == f"http://127.0.0.1:{setup.ports[0]}"
        assert {w["source"] for w in workers.values()} == {"kubernetes"}
        assert all(w["healthy"] for w in workers.values())
        reply = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert reply.headers["x-route-worker"] in {"engine-a", "engine-b"}

        async def ids() -> set[str]:
            return set(await workers_of(http, gateway))

        await api.set_ready("engine-c", True)  # becomes ready: joins
        await until(lambda: _is(ids, {"engine-a", "engine-b", "engine-c"}))
        await api.set_ready("engine-a", False)  # fails its readiness probe: leaves
        await until(lambda: _is(ids, {"engine-b", "engine-c"}))
        await api.terminate("engine-b")  # being deleted: leaves before it is gone
        await until(lambda: _is(ids, {"engine-c"}))
        await api.delete("engine-b")
        await api.put(pod("other", setup.ports[0], labels={"app": "something-else"}))

        async def healthy_c() -> bool:
            return bool((await workers_of(http, gateway)).get("engine-c", {}).get("healthy"))

        await until(healthy_c)
        for _ in range(4):
            reply = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=2)
            assert reply.headers["x-route-worker"] == "engine-c"
        assert await ids() == {"engine-c"}
        # One list, then watches that each resumed from the version they had reached.
        lists = [c for c in api.calls if "watch" not in c]
        assert len(lists) == 1
        assert lists[0]["labelSelector"] == "app=vllm"
        assert all(c.get("resourceVersion") for c in api.calls if "watch" in c)


async def _is(ids: Callable[[], Awaitable[set[str]]], want: set[str]) -> bool:
    return await ids() == want


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["gone-event", "gone-status"])
async def test_a_dropped_watch_resumes_and_an_expired_one_lists_again(
    setup: Setup, gone_as_status: bool
) -> None:
    api = setup.api
    api.gone_as_status = gone_as_status
    await api.put(pod("engine-a", setup.ports[0]))
    gateway, _ = await setup.gateway()
    async with aiohttp.ClientSession() as http:
        async def ids() -> set[str]:
            return set(await workers_of(http, gateway))

        await until(lambda: _count(api.watches, 1))
        await api.bookmark()  # the watch learns the current version without a change
        await api.drop_watches()
        await api.put(pod("engine-b", setup.ports[1]))  # while no watch is open
        await until(lambda: _is(ids, {"engine-a", "engine-b"}))
        watches = [c for c in api.calls if "watch" in c]
        assert watches[-1]["resourceVersion"] != ""
        assert len([c for c in api.calls if "watch" not in c]) == 1  # resumed, not relisted

        # The server forgets the versions the gateway knows: 410, then a fresh list that
        # also drops a pod deleted while the gateway could not see the event.
        await until(lambda: _count(api.watches, 1))
        await api.drop_watches()
        api.pods.pop("engine-a")  # deleted with its event compacted away
        await api.put(pod("engine-c", setup.ports[2]))
        api.compact()
        await until(lambda: _is(ids, {"engine-b", "engine-c"}))
        assert len([c for c in api.calls if "watch" not in c]) == 2


async def metric(http: aiohttp.ClientSession, gateway: str, name: str) -> float:
    async with http.get(gateway + "/metrics") as response:
        text = await response.text()
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics"
    return float(values[0])


async def _count(watches: Callable[[], int], want: int) -> bool:
    return watches() == want


async def test_static_workers_stay_and_a_wrong_token_is_retried(setup: Setup) -> None:
    api = setup.api
    await api.put(pod("engine-a", setup.ports[0]))
    setup.token_file.write_text("expired-token\n")
    static = f"http://127.0.0.1:{setup.ports[2]}"
    gateway, _ = await setup.gateway(worker=(static,))
    async with aiohttp.ClientSession() as http:
        async def ids() -> set[str]:
            return set(await workers_of(http, gateway))

        # The API refuses the token: the gateway serves with its static worker meanwhile,
        # and says why in /admin/workers and /metrics (never the token itself).
        assert await ids() == {f"127.0.0.1:{setup.ports[2]}"}
        assert api.calls
        assert all("watch" not in c for c in api.calls)
        async with http.get(gateway + "/admin/workers") as response:
            discovery = (await response.json())["discovery"]
        assert discovery["up"] is False
        assert discovery["errors"] >= 1
        assert "401" in discovery["last_error"]
        assert discovery["pods"] == []
        assert "expired-token" not in json.dumps(discovery)
        assert await metric(http, gateway, "gateway_discovery_up") == 0.0
        # The kubelet rotates the token file: read again on the next try.
        setup.token_file.write_text(api.token + "\n")
        await until(lambda: _is(ids, {f"127.0.0.1:{setup.ports[2]}", "engine-a"}),
                         timeout_s=15)
        async with http.get(gateway + "/admin/workers") as response:
            discovery = (await response.json())["discovery"]
        assert discovery["up"] is True
        assert discovery["pods"] == ["engine-a"]
        assert discovery["lists"] == 1
        assert await metric(http, gateway, "gateway_discovery_up") == 1.0
        assert await metric(http, gateway, "gateway_discovery_pods") == 1.0
        await api.delete("engine-a")
        await until(lambda: _is(ids, {f"127.0.0.1:{setup.ports[2]}"}))


async def test_vllm_pods_annotate_their_kv_event_endpoints(setup: Setup) -> None:
    api = setup.api
    await api.put(pod("engine-a", setup.ports[0], annotations={
        "affinity-gateway/kv-events": "5557", "affinity-gateway/kv-replay": "5558"}))
    await api.put(pod("engine-b", setup.ports[1], annotations={
        "affinity-gateway/kv-events": "http://not-zmq"}))
    gateway, _ = await setup.gateway(k8s_scheme="vllm+http")
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    assert reply.choices[0].message.content
    async with aiohttp.ClientSession() as http:
        workers = await workers_of(http, gateway)
    assert set(workers) == {"engine-a"}  # engine-b's annotation is malformed: left out
    async with aiohttp.ClientSession() as http, http.get(gateway + "/admin/workers") as r:
        skipped = (await r.json())["discovery"]["skipped"]
    assert list(skipped) == ["engine-b"]
    assert "tcp://" in skipped["engine-b"]
    assert workers["engine-a"]["kind"] == "vllm"  # spoken to as vLLM: namespaces as cache_salt
    assert workers["engine-a"]["url"] == f"http://127.0.0.1:{setup.ports[0]}"
    described = workers["engine-a"]["kv_events"]
    assert "tcp://127.0.0.1:5557" in str(described)


async def test_watches_that_end_at_once_are_retried_with_a_backoff(setup: Setup) -> None:
    """Something between the gateway and the API server that does not hold streams must not
    turn discovery into a loop of requests."""
    api = setup.api
    api.hold_watches = False
    await api.put(pod("engine-a", setup.ports[0]))
    gateway, _ = await setup.gateway()
    await asyncio.sleep(2.0)
    watches = [c for c in api.calls if "watch" in c]
    assert 1 <= len(watches) <= 6  # 0.5 + 1 s of backoff, where a loop would make hundreds
    async with aiohttp.ClientSession() as http:
        assert set(await workers_of(http, gateway)) == {"engine-a"}


def test_selector_outside_a_pod_needs_the_api_url() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    proc = subprocess.run([sys.executable, "-m", "gateway", "--k8s-selector", "app=vllm"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "--k8s-api-url" in proc.stderr


async def test_a_pod_that_joins_is_probed_at_once_not_at_the_next_interval(
    setup: Setup,
) -> None:
    api = setup.api
    await api.put(pod("engine-a", setup.ports[0]))
    # Rounds an hour apart: only the join itself can have the new pod probed.
    gateway, _ = await setup.gateway(health_interval_s=3600.0)
    async with aiohttp.ClientSession() as http:
        async def healthy() -> set[str]:
            return {wid for wid, w in (await workers_of(http, gateway)).items() if w["healthy"]}

        assert await healthy() == {"engine-a"}  # the start-up round, after the first list
        await api.put(pod("engine-b", setup.ports[1]))
        await until(lambda: _is(healthy, {"engine-a", "engine-b"}))


async def test_the_gateway_as_run_finds_worker_processes_by_their_pods(
    processes: Processes, tmp_path: Path,
) -> None:
    """As a user runs them: ``python -m worker`` processes, and ``python -m gateway`` with only
    a selector (no --worker, no store), against the API test server."""
    api = KubernetesAPI()
    api_port = free_port()
    runner = await serve(api.app(), api_port)
    try:
        urls = [(await processes.worker())[0] for _ in range(2)]
        for i, url in enumerate(urls):
            await api.put(pod(f"engine-{i}", int(url.rsplit(":", 1)[1])))
        token = tmp_path / "token"
        token.write_text(api.token)
        gateway = await processes.gateway(
            "--k8s-selector", "app=vllm", "--k8s-api-url", f"http://127.0.0.1:{api_port}",
            "--k8s-port", "http", "--k8s-token-file", str(token))
        client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        reply = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert reply.headers["x-route-worker"] in {"engine-0", "engine-1"}
        await api.delete(reply.headers["x-route-worker"])
        async with aiohttp.ClientSession() as http:
            async def one_left() -> bool:
                return len(await workers_of(http, gateway)) == 1

            await until(one_left)
    finally:
        await processes.stop_all()
        await runner.cleanup()
