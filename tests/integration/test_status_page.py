"""The status page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs) driven by selenium, against a live gateway.

Selenium is told the driver's path and runs offline (``SE_OFFLINE``), so nothing is downloaded.
The screenshot is saved next to the test's temporary files, and into ``$STATUS_PAGE_SHOTS`` when
that is set.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import aiohttp

from tests.browser import needs_browser
from tests.conftest import MODEL, StartCluster

PREFIX = "You are the assistant of a garden centre; advise on plants, soil and watering. " * 16

pytestmark = needs_browser


async def test_status_page_renders_workers_charts_and_misses(
    start_cluster: StartCluster, browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    # Probes often enough that the engines' time to first token is known when the page loads.
    cluster = await start_cluster(workers=3, health_interval_s=0.2)
    async with aiohttp.ClientSession() as http:
        for i in range(6):
            async with http.post(cluster.gateway_url + "/v1/completions", json={
                "model": MODEL, "prompt": PREFIX + f"question {i}", "max_tokens": 2,
            }) as r:
                assert r.status == 200
                holder = r.headers["x-route-worker"]
        # The holder forgets everything: the next request is a diagnosed miss.
        async with http.post(f"http://{holder}/admin/flush") as r:
            assert r.status == 200
        async with http.post(cluster.gateway_url + "/v1/completions", json={
            "model": MODEL, "prompt": PREFIX + "question 7", "max_tokens": 2,
        }) as r:
            assert r.status == 200
        async with http.get(cluster.gateway_url + "/ui") as r:
            html = await r.text()
        for _ in range(100):  # until a probe after the requests read the holder's histogram
            async with http.get(cluster.gateway_url + "/ui/data") as r:
                data = await r.json()
            first_token_ms = {w["id"]: w["first_token_ms"] for w in data["workers"]}
            if first_token_ms[holder] is not None:
                break
            await asyncio.sleep(0.05)
        assert first_token_ms[holder] > 0
    # Self-contained: no script, style, font or image from anywhere else.
    assert "https://" not in html
    assert html.count("http://") == html.count('"http://www.w3.org/2000/svg"')
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", html)

    def load() -> None:
        browser.get(cluster.gateway_url + "/ui")
        WebDriverWait(browser, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#workers tbody tr[data-worker]"))

    await asyncio.to_thread(load)
    rows = browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr[data-worker]")
    assert {r.get_attribute("data-worker") for r in rows} == {
        u.removeprefix("http://") for u in cluster.worker_urls}
    holder_row = browser.find_element(By.CSS_SELECTOR, f'#workers tr[data-worker="{holder}"]')
    assert "healthy" in holder_row.text
    assert " ms" in holder_row.text  # the engine's time to first token, as the probe read it
    assert browser.find_element(By.ID, "kpi-requests").text == "7"
    assert browser.find_element(By.ID, "kpi-workers").text == "3 / 3"
    assert browser.find_element(By.ID, "kpi-hit").text.endswith("%")
    assert browser.find_element(By.ID, "policy").text == "cache_aware"
    decisions = {e.get_attribute("data-name") for e in browser.find_elements(
        By.CSS_SELECTOR, "#decisions .item")}
    assert {"cold", "prefix_hit"} <= decisions
    causes = browser.find_element(By.ID, "causes").text
    assert "stale_index_entry" in causes
    misses = browser.find_element(By.ID, "misses").text
    assert "stale_index_entry" in misses
    assert holder in misses
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-hit path")  # a drawn line
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-requests rect")
    assert "no actions yet" in browser.find_element(By.ID, "actions").text
    png = browser.get_screenshot_as_png()
    assert len(png) > 10_000
    keep_screenshot(png, tmp_path)


def keep_screenshot(png: bytes, tmp_path: Path) -> None:
    (tmp_path / "status-page.png").write_bytes(png)
    if os.environ.get("STATUS_PAGE_SHOTS"):
        target = Path(os.environ["STATUS_PAGE_SHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        (target / "status-page.png").write_bytes(png)
