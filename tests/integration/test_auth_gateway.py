"""Keys, tenants, admin access and isolation through real HTTP: openai client -> gateway ->
reference workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.api import STATE
from gateway.app import create_app as create_gateway
from gateway.auth import hash_key
from gateway.settings import GatewaySettings
from tests.conftest import FAST_WORKER, MODEL, Processes, StartCluster, free_port, serve
from worker.server import create_app as create_worker

PROMPT = "Summarise the maintenance manual of the tandem bicycle, chapter by chapter. " * 20
KEYS = ("sk-acme-1:acme", "sk-globex-1:globex")
ADMIN = "admin-token-123"


def client(base_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers or {}) as r:
        body = await r.json(content_type=None) if r.content_type == "application/json" else None
        return r.status, body


async def test_keys_are_required_and_name_the_tenant(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=2, api_key=KEYS, admin_token=ADMIN)
    async with client(cluster.base_url, "sk-wrong") as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            await bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "invalid_api_key"
    assert error["type"] == "invalid_request_error"
    assert "sk-wrong" not in caught.value.message
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.base_url + "/completions",
                             json={"model": MODEL, "prompt": "hi"}) as r:
            assert r.status == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.get(cluster.base_url + "/models",
                            headers={"Authorization": "Basic c2stYWNtZS0xOg=="}) as r:
            assert r.status == 401
    async with client(cluster.base_url, "sk-acme-1") as acme:
        raw = await acme.completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=2)
        assert raw.parse().choices[0].text
        # Keys configured: routing, cache and timing headers are hidden by default.
        assert not [h for h in raw.headers if h.startswith(("x-route-", "x-prefix-", "x-cache-",
                                                            "server-timing"))]
        assert [m.id for m in (await acme.models.list()).data] == [MODEL]


async def test_route_headers_modes(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS, admin_token=ADMIN,
                                  route_headers="admin")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    auth = {"Authorization": "Bearer sk-acme-1"}
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.base_url + "/completions", json=body, headers=auth) as r:
            assert r.status == 200
            assert "x-route-worker" not in r.headers
            assert "x-cache-matched-tokens" not in r.headers
            assert "Server-Timing" not in r.headers
            assert "x-route-at" not in r.headers
        async with http.post(cluster.base_url + "/completions", json={**body, "stream": True},
                             headers={**auth, "x-admin-token": ADMIN}) as r:
            assert r.status == 200
            assert "x-route-worker" in r.headers
            assert "x-prefix-anchor" in r.headers
            assert "upstream;dur=" in r.headers["Server-Timing"]
            await r.read()
        async with http.post(cluster.base_url + "/completions", json={**body, "stream": True},
                             headers={**auth, "x-admin-token": "guess"}) as r:
            assert "x-route-worker" not in r.headers
            await r.read()
    open_cluster = await start_cluster(workers=1)  # no keys: everything is shown, as before
    async with aiohttp.ClientSession() as http, http.post(
        open_cluster.base_url + "/completions", json=body
    ) as r:
        assert r.status == 200
        assert "x-route-worker" in r.headers
        assert "x-cache-matched-tokens" in r.headers


async def test_admin_and_metrics_need_the_admin_token(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS, admin_token=ADMIN, metrics_auth=True)
    base = cluster.gateway_url
    for path in ("/admin/workers", "/admin/rebalance", "/admin/misses", "/ui/data", "/metrics"):
        status, body = await _get(base + path)
        assert status == 401, path
        assert body["error"]["code"] == "invalid_api_key"
        assert (await _get(base + path, {"Authorization": "Bearer sk-acme-1"}))[0] == 401
        assert (await _get(base + path, {"Authorization": f"Bearer {ADMIN}"}))[0] == 200
        assert (await _get(base + path, {"x-admin-token": ADMIN}))[0] == 200
    assert (await _get(base + "/health"))[0] == 200
    # Keys but no admin token: admin endpoints are closed on the public port.
    closed = await start_cluster(workers=1, api_key=KEYS)
    status, body = await _get(closed.gateway_url + "/admin/workers")
    assert status == 403
    assert body["error"]["type"] == "invalid_request_error"
    assert (await _get(closed.gateway_url + "/metrics"))[0] == 200  # metrics open by default
    # No keys, no token: the local-development default stays open.
    dev = await start_cluster(workers=1)
    assert (await _get(dev.gateway_url + "/admin/workers"))[0] == 200


async def _matched(oa: openai.AsyncOpenAI, salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    done = await oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                       extra_body=extra)
    assert done.usage is not None
    details = done.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


@pytest.mark.parametrize("scheme_prefix", ["", "vllm+"])
async def test_tenants_never_share_cache_even_with_the_same_salt(
    start_cluster: StartCluster, scheme_prefix: str
) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS, scheme_prefix=scheme_prefix)
    async with client(cluster.base_url, "sk-acme-1") as acme, \
            client(cluster.base_url, "sk-globex-1") as globex:
        assert await _matched(acme, "shared-salt") == 0
        assert await _matched(acme, "shared-salt") > 0  # same tenant, same salt: reused
        assert await _matched(globex, "shared-salt") == 0  # other tenant, same salt: nothing
        assert await _matched(globex, None) == 0
        assert await _matched(acme, None) == 0  # a salt narrows a tenant's namespace
        assert await _matched(acme, None) > 0


async def test_worker_key_and_admin_token(tmp_path: Any) -> None:
    """A worker started with --api-key (as vLLM's) serves only callers holding the key; the
    gateway sends it per worker, from an environment variable or a file."""
    runners = []
    urls = []
    for key in ("env-worker-key", "file-worker-key"):
        port = free_port()
        settings = dataclasses.replace(FAST_WORKER, port=port, api_key=key,
                                       admin_token="worker-admin")
        runners.append(await serve(create_worker(settings), port))
        urls.append(f"http://127.0.0.1:{port}")
    key_file = tmp_path / "key"
    key_file.write_text("file-worker-key\n")
    os.environ["I11A_TEST_WORKER_KEY"] = "env-worker-key"
    gport = free_port()
    gateway = await serve(create_gateway(GatewaySettings(port=gport, worker=(
        f"vllm+{urls[0]}?api_key_env=I11A_TEST_WORKER_KEY",
        f"vllm+{urls[1]}?api_key_file={key_file}",
    ))), gport)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            async with http.post(urls[0] + "/v1/completions", json=body) as r:
                assert r.status == 401
            async with http.post(urls[0] + "/admin/flush") as r:
                assert r.status == 401
            async with http.post(urls[0] + "/admin/flush",
                                 headers={"Authorization": "Bearer env-worker-key"}) as r:
                assert r.status == 401  # the API key is not the admin token
            async with http.post(urls[0] + "/admin/flush",
                                 headers={"Authorization": "Bearer worker-admin"}) as r:
                assert r.status == 200
            seen = set()
            for i in range(12):
                async with http.post(f"http://127.0.0.1:{gport}/v1/completions",
                                     json={**body, "prompt": f"prompt {i} " * 30}) as r:
                    assert r.status == 200
                    seen.add(r.headers["x-route-worker"])
            assert len(seen) == 2  # both workers healthy and serving through the gateway
            _, view = await _get(f"http://127.0.0.1:{gport}/admin/workers")
            shown = str(view)
            assert "worker-key" not in shown
            assert "api_key" not in shown
    finally:
        del os.environ["I11A_TEST_WORKER_KEY"]
        await gateway.cleanup()
        for runner in runners:
            await runner.cleanup()


async def test_cli_keys_file_reloads_on_sighup_and_admin_port(
    processes: Processes, tmp_path: Any
) -> None:
    worker_url, _ = await processes.worker()
    keys = tmp_path / "keys"
    keys.write_text(f"acme {hash_key('sk-first')}\n")
    admin_port = free_port()
    base = await processes.gateway(
        "--worker", worker_url, "--api-keys-file", str(keys), "--admin-port", str(admin_port))
    gateway = processes.procs[-1]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}

    async def status_with(key: str) -> int:
        async with aiohttp.ClientSession() as http, http.post(
            base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            return r.status

    assert await status_with("sk-first") == 200
    assert await status_with("sk-second") == 401
    keys.write_text(f"globex {hash_key('sk-second')}\n")
    gateway.send_signal(signal.SIGHUP)
    for _ in range(100):
        if await status_with("sk-second") == 200:
            break
        await asyncio.sleep(0.05)
    assert await status_with("sk-second") == 200
    assert await status_with("sk-first") == 401
    keys.write_text("globex sk-plaintext-is-refused\n")  # a bad file: the old keys stay
    gateway.send_signal(signal.SIGHUP)
    await asyncio.sleep(0.3)
    assert await status_with("sk-second") == 200
    assert gateway.returncode is None
    # Admin: the loopback admin port needs no token; the public port serves no admin.
    assert (await _get(f"http://127.0.0.1:{admin_port}/admin/workers"))[0] == 200
    assert (await _get(base + "/admin/workers"))[0] == 403


async def test_long_texts_found_normal_are_remembered_per_tenant(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS)
    texts = cluster.runners["gateway"].app[STATE].normal_texts
    # Over the memo's threshold, not ASCII, and normal as it is.
    system = "\n".join(f"Rule {i}: answer in \u201cplain\u201d words." for i in range(300))
    assert len(system) >= texts.min_chars

    async def ask(api: openai.AsyncOpenAI, salt: str | None = None) -> None:
        done = await api.chat.completions.create(
            model=MODEL, max_tokens=2, extra_body={"cache_salt": salt} if salt else None,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}])
        assert done.choices[0].message.content is not None

    async with client(cluster.base_url, "sk-acme-1") as acme, \
            client(cluster.base_url, "sk-globex-1") as globex:
        await ask(acme)
        assert (len(texts), texts.hits) == (1, 0)
        await ask(acme)
        assert texts.hits == 1  # the same tenant: checked once
        await ask(globex)
        await ask(acme, salt="s1")
        assert (len(texts), texts.hits) == (3, 1)  # another tenant, another salt: their own


async def test_a_completions_agents_next_prompt_is_checked_past_its_last_per_tenant(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS)
    texts = cluster.runners["gateway"].app[STATE].normal_texts
    prompt = "\n".join(f"Step {i}: read \u201cfile {i}\u201d." for i in range(400))
    assert len(prompt) >= texts.min_chars

    async def ask(api: openai.AsyncOpenAI, text: str) -> None:
        done = await api.completions.create(model=MODEL, max_tokens=2, prompt=text)
        assert done.choices[0].text is not None

    # The next turn ends the last prompt's line in spaces: the rules still see that line.
    turn = prompt + "  \nStep 400: done.\u00a0"
    async with client(cluster.base_url, "sk-acme-1") as acme, \
            client(cluster.base_url, "sk-globex-1") as globex:
        await ask(acme, prompt)
        await ask(acme, turn)
        assert texts.prefix_hits == 1  # checked from the line the last prompt ended in
        await ask(globex, turn)
        assert texts.prefix_hits == 1  # another tenant: checked whole
        # The turn was rewritten (a line's spaces, an NBSP): kept with its rewriting, the
        # next turn is rewritten past it.
        assert texts.held_bytes > len(prompt)
        await ask(acme, turn + "\nStep 401:  \nok")
        assert texts.prefix_hits == 2
    async with aiohttp.ClientSession() as http, http.get(cluster.gateway_url + "/metrics") as r:
        exposition = await r.text()
    assert "gateway_normal_text_prefix_hits_total 2.0" in exposition
    # Each of acme's turns was also hashed past the one before (globex's was not).
    assert "gateway_fingerprint_prefix_hits_total 2.0" in exposition
    assert "gateway_normal_text_rewritten_bytes 0.0" not in exposition
    # --normal-text-bytes 0 keeps no rewritten text.
    bare = await start_cluster(workers=1, normal_text_bytes=0)
    async with client(bare.base_url, "unused") as anyone:
        await ask(anyone, turn)
    assert bare.runners["gateway"].app[STATE].normal_texts.held_bytes == 0


async def test_a_long_chats_next_turn_is_decoded_from_its_new_messages_per_tenant(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS)
    state = cluster.runners["gateway"].app[STATE]
    histories = state.chat_histories
    # An agent's history: long enough to be remembered (tens of kilobytes).
    history: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a coding agent."}]
    for i in range(120):
        history.append({"role": "user", "content": f"Step {i}: " + "read the next file. " * 20})
        history.append({"role": "assistant", "content": f"Done with step {i}."})
    assert len(json.dumps(history)) > histories.min_bytes

    async def ask(api: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam]) -> str:
        done = await api.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
        assert done.choices[0].message.content is not None
        return done.choices[0].message.content

    async with client(cluster.base_url, "sk-acme-1") as acme, \
            client(cluster.base_url, "sk-globex-1") as globex:
        await ask(acme, history)
        assert (len(histories), histories.hits) == (1, 0)
        turn: list[ChatCompletionMessageParam] = [
            *history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "on"}]
        await ask(acme, turn)
        assert histories.hits == 1  # the client's second turn: joined to its first
        assert len(histories) == 1  # and its entry replaced the first turn's
        await ask(globex, turn)
        assert (len(histories), histories.hits) == (2, 1)  # another tenant: its own
    async with aiohttp.ClientSession() as http, http.get(cluster.gateway_url + "/metrics") as r:
        exposition = await r.text()
    assert "gateway_chat_history_hits_total 1.0" in exposition
    assert "gateway_chat_histories 2.0" in exposition


async def test_a_long_completions_prompts_next_turn_is_decoded_from_what_it_adds_per_tenant(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1, api_key=KEYS)
    prompts = cluster.runners["gateway"].app[STATE].prompt_histories
    # An agent's context as one text, long enough to be remembered (tens of kilobytes), with
    # what the client's JSON escapes: quotes, backslashes, typeset characters.
    prompt = "\n".join(f'Step {i}: read "src\\f{i}.py" \u2014 ok.' for i in range(1500))
    assert len(prompt) > prompts.min_bytes

    async def ask(api: openai.AsyncOpenAI, text: str) -> None:
        done = await api.completions.create(model=MODEL, max_tokens=2, prompt=text)
        assert done.choices[0].text is not None

    async with client(cluster.base_url, "sk-acme-1") as acme, \
            client(cluster.base_url, "sk-globex-1") as globex:
        await ask(acme, prompt)
        assert (len(prompts), prompts.hits) == (1, 0)
        turn = prompt + '\nStep 1500: "done"'
        await ask(acme, turn)
        assert (len(prompts), prompts.hits) == (1, 1)  # joined, and its entry replaced
        await ask(globex, turn)
        assert (len(prompts), prompts.hits) == (2, 1)  # another tenant: its own
        await ask(acme, "X" + turn[1:])  # an edit in the part seen: decoded whole
        assert prompts.hits == 1
    async with aiohttp.ClientSession() as http, http.get(cluster.gateway_url + "/metrics") as r:
        exposition = await r.text()
    assert "gateway_prompt_history_hits_total 1.0" in exposition
    # The joined turn was hashed past the prompt before it, as a turn decoded whole is.
    assert "gateway_fingerprint_prefix_hits_total 1.0" in exposition
