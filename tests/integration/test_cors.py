"""Web pages of other origins calling the gateway (CORS): preflights and answers over real HTTP,
and a real browser (headless Chromium) calling the gateway with an API key from a page of an
allowed origin, and refused from one that is not."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from tests.browser import needs_browser
from tests.conftest import MODEL, StartCluster, free_port, serve

KEYS = ("sk-acme-1:acme",)
PAGE = "http://127.0.0.1:{port}"


async def _call(method: str, url: str, headers: dict[str, str],
                body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.request(
            method, url, headers=headers, json=body) as r:
        await r.read()
        return r.status, r.headers


async def test_preflights_and_answers_for_an_allowed_origin(start_cluster: StartCluster) -> None:
    origin = "http://app.example:3000"
    cluster = await start_cluster(workers=1, api_key=KEYS, cors_origin=(origin,))
    url = cluster.gateway_url + "/v1/chat/completions"
    asked = "authorization, content-type, x-stainless-lang"
    status, headers = await _call("OPTIONS", url, {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    # No key on a preflight: browsers send none.
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == asked
    assert int(headers["Access-Control-Max-Age"]) > 0
    assert "Access-Control-Allow-Credentials" not in headers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key, expected in (("sk-acme-1", 200), ("sk-wrong", 401)):
        status, headers = await _call("POST", url, {"Origin": origin,
                                                    "Authorization": f"Bearer {key}"}, body)
        assert status == expected
        # Errors too: the page must be able to read why it was refused.
        assert headers["Access-Control-Allow-Origin"] == origin
        assert "Origin" in headers.getall("Vary")
        assert "x-request-id" in headers["Access-Control-Expose-Headers"]
    # A stream's headers go out before its body: they carry it as well.
    status, headers = await _call("POST", url, {"Origin": origin,
                                                "Authorization": "Bearer sk-acme-1"},
                                  body | {"stream": True})
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == origin
    # The engine API is client API too.
    status, headers = await _call("OPTIONS", cluster.gateway_url + "/tokenize", {
        "Origin": origin, "Access-Control-Request-Method": "POST"})
    assert status == 204


async def test_other_origins_paths_and_methods_are_refused(start_cluster: StartCluster) -> None:
    origin = "http://app.example:3000"
    cluster = await start_cluster(workers=1, api_key=KEYS, admin_token="adm",
                                  cors_origin=(origin,))
    url = cluster.gateway_url + "/v1/chat/completions"
    for headers in ({"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
                    {"Origin": origin, "Access-Control-Request-Method": "DELETE"}):
        async with aiohttp.ClientSession() as http, http.options(url, headers=headers) as r:
            # A preflight answered other than 2xx fails, whatever its headers; the page of an
            # allowed origin may read why.
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "cors_forbidden"
            assert ("Access-Control-Allow-Origin" in r.headers) == (headers["Origin"] == origin)
    # Admin endpoints are not for pages of other origins.
    status, headers = await _call("OPTIONS", cluster.gateway_url + "/admin/workers", {
        "Origin": origin, "Access-Control-Request-Method": "GET"})
    assert status == 403
    status, headers = await _call("GET", cluster.gateway_url + "/admin/workers",
                                  {"Origin": origin, "Authorization": "Bearer adm"})
    assert status == 200
    assert "Access-Control-Allow-Origin" not in headers
    # A request from another origin is served as before, without CORS headers, so its page
    # cannot read the answer.
    status, headers = await _call("POST", url, {"Origin": "http://evil.example",
                                                "Authorization": "Bearer sk-acme-1"},
                                  {"model": MODEL, "prompt": "hi"})
    assert "Access-Control-Allow-Origin" not in headers


async def test_no_cors_unless_configured(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(workers=1)
    url = cluster.gateway_url + "/v1/chat/completions"
    status, headers = await _call("OPTIONS", url, {
        "Origin": "http://app.example:3000", "Access-Control-Request-Method": "POST"})
    assert status == 405
    assert "Access-Control-Allow-Origin" not in headers
    status, headers = await _call("POST", url, {"Origin": "http://app.example:3000"}, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200
    assert "Access-Control-Allow-Origin" not in headers


_FETCH = """
const [url, key, model] = [arguments[0], arguments[1], arguments[2]];
const done = arguments[arguments.length - 1];
fetch(url, {method: "POST", headers: {
    "Authorization": "Bearer " + key, "Content-Type": "application/json",
    "x-stainless-lang": "js"},
  body: JSON.stringify({model: model, max_tokens: 2,
                        messages: [{role: "user", content: "hello from a page"}]})})
  .then(async r => done({status: r.status, requestId: r.headers.get("x-request-id"),
                         body: await r.json()}))
  .catch(e => done({error: String(e)}));
"""


@needs_browser
async def test_a_page_of_an_allowed_origin_calls_the_gateway_in_a_browser(
        start_cluster: StartCluster, browser: object) -> None:
    from selenium.webdriver.remote.webdriver import WebDriver

    assert isinstance(browser, WebDriver)
    page_port = free_port()
    page = PAGE.format(port=page_port)

    async def index(_: web.Request) -> web.Response:
        return web.Response(text="<html><body>chat app</body></html>",
                            content_type="text/html")

    app = web.Application()
    app.router.add_get("/", index)
    runner = await serve(app, page_port)
    try:
        allowed = await start_cluster(workers=1, api_key=KEYS, cors_origin=(page,))
        closed = await start_cluster(workers=1, api_key=KEYS)

        def run() -> tuple[dict[str, Any], dict[str, Any]]:
            browser.get(page + "/")
            browser.set_script_timeout(30)
            ok = browser.execute_async_script(
                _FETCH, allowed.gateway_url + "/v1/chat/completions", "sk-acme-1", MODEL)
            refused = browser.execute_async_script(
                _FETCH, closed.gateway_url + "/v1/chat/completions", "sk-acme-1", MODEL)
            return ok, refused

        ok, refused = await asyncio.to_thread(run)
    finally:
        await runner.cleanup()
    assert ok.get("status") == 200, ok
    assert ok["body"]["choices"][0]["message"]["content"]
    assert ok["requestId"]  # an exposed header the page may read
    assert "error" in refused, refused  # the browser refused to show the answer
