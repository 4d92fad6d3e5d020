"""/dashboard in a real headless browser (Debian's Chromium, driven by Selenium through its
chromedriver) against a running server with traffic: the charts render, and they update."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from specdec.config import SpeculativeConfig
from specdec.models import LoadedModel
from specdec.server.config import LoadSchedule, RouteConfig, ServerConfig
from specdec.server.dashboard import histogram_quantile
from specdec.server.runtime import ServerThread, build_state

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOT = os.environ.get("SPECDEC_DASHBOARD_SCREENSHOT")  # where to save docs/server.md's picture


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 8.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(1.0, buckets) == pytest.approx(1.0)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == 0.1  # in +Inf: the largest bound


@pytest.fixture(scope="module")
def server(default_model: LoadedModel) -> Iterator[ServerThread]:
    routes = (RouteConfig("specdec", SpeculativeConfig("ngram", 4), LoadSchedule.from_mapping({1: 4, 2: 0})),
              RouteConfig("specdec-plain"))
    running = ServerThread(build_state(ServerConfig(routes=routes, max_model_len=256, max_num_seqs=4), loaded=default_model)).start()
    yield running
    running.stop()


def test_data_endpoint(server: ServerThread) -> None:
    data = httpx.get(f"{server.url}/dashboard/data").json()
    assert set(data["routes"]) == {"specdec", "specdec-plain"}
    route = data["routes"]["specdec"]
    assert {"tokens_per_second", "acceptance_rate", "position_acceptance", "mean_accepted_length", "k", "running", "drift",
            "ttft_seconds", "itl_seconds"} <= set(route)
    assert data["memory"]["target_weight_bytes"] > 0
    assert httpx.get(f"{server.url}/dashboard/static/uplot/uPlot.iife.min.js").status_code == 200
    assert "uPlot" in httpx.get(f"{server.url}/dashboard").text


@pytest.mark.real
@pytest.mark.browser
def test_charts_render_and_update_in_a_browser(server: ServerThread, tmp_path: Path) -> None:
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (make test-all does)")
        pytest.skip("no chromium/chromedriver here (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1750"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    stop = threading.Event()

    def traffic() -> None:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["List the days of the week, one per line.", "Count from one to ten in words.", "Name five colours."]
        i = 0
        while not stop.is_set():
            client.chat.completions.create(model="specdec" if i % 3 else "specdec-plain", max_tokens=48, temperature=0,
                                           messages=[{"role": "user", "content": prompts[i % len(prompts)]}])
            i += 1

    worker = threading.Thread(target=traffic, daemon=True)
    try:
        worker.start()
        driver.get(f"{server.url}/dashboard")

        def dashboard(expr: str):
            return driver.execute_script(f"return window.specdecDashboard ? {expr} : null")

        def wait_for(expr: str, timeout: float = 60.0):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                value = dashboard(expr)
                if value:
                    return value
                time.sleep(0.5)
            raise AssertionError(f"timed out waiting for {expr}")

        # The charts render: one uPlot canvas per chart, drawn at its size.
        wait_for("window.specdecDashboard.updates >= 2")
        canvases = driver.execute_script(
            "return [...document.querySelectorAll('.uplot canvas')].map(c => [c.width, c.height])")
        assert len(canvases) == 6 and all(w > 100 and h > 50 for w, h in canvases), canvases
        # They update: more points, and the speculative route's tokens/s and acceptance rise above 0.
        first = dashboard("window.specdecDashboard.data.tps[0].length")
        wait_for("window.specdecDashboard.data.tps[0].length >= %d" % (first + 3))
        wait_for("Math.max(...window.specdecDashboard.data.tps[1].filter(v => v !== null)) > 0")
        wait_for("Math.max(...window.specdecDashboard.data.acc[1].filter(v => v !== null)) > 0")
        assert float(driver.find_element("css selector", "tr[data-route='specdec'] .tps").text) >= 0
        assert "running" in driver.find_element("id", "status").text
        assert "MiB" in driver.find_element("id", "memory").text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        driver.save_screenshot(SCREENSHOT or str(tmp_path / "dashboard.png"))
    finally:
        stop.set()
        driver.quit()
        worker.join(timeout=120)
