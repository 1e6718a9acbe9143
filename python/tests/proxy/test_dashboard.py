"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, selenium).

The page must load with no console errors, show the figures of a running demo model, update
after a request, and leave a screenshot behind (in the test's tmp dir, or in
``$PLIMSOLL_SCREENSHOT_DIR`` when set). Skipped when chromium, chromedriver or selenium
is absent.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_proxy import MSG, Proxy, chat

MIB = 1024 * 1024
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="chromium and chromium-driver are not installed")


@pytest.fixture(scope="module")
def proxy(tiny_model, tmp_path_factory) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("dashboard")
    huge = tmp / "huge"
    shutil.copytree(tiny_model, huge)
    cfg = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**cfg, "head_dim": 65536}))
    (tmp / "policy.json").write_text(json.dumps({
        "schemaVersion": 1, "host": "box", "totalRamGb": 64, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 0.5}, "clustered": {"maxLocalLlmGb": 1}},
        "models": {"tiny": {"path": str(tiny_model), "context": 4096, "maxTokens": 256},
                   "huge": {"path": str(huge), "context": 4096, "maxTokens": 256}},
    }))
    (tmp / "token").write_text("admin-secret\n")
    p = Proxy(["--policy", str(tmp / "policy.json"), "--admin-token-file", str(tmp / "token")],
              tmp / "serve.log", {"PLIMSOLL_CACHE": str(tmp / "cache")})
    yield p
    assert not p.stop()


def _chromium(profile: Path):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1500",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    return driver


class Browser:
    """A Chromium session that is started again, once, if Chromium goes away (seen once in a
    loaded full suite: ``InvalidSessionIdException: ... the browser has closed the
    connection``): the page is opened again and its first poll awaited, then the call that
    met the lost session is made again. What the dashboard shows is the proxy's state, so
    the checks hold on the new page; a second loss fails the test."""

    def __init__(self, profiles):
        self._profiles, self._url, self.restarts = profiles, None, 0
        self.driver = _chromium(profiles.mktemp("chromium-profile"))

    def lost(self, err: Exception) -> bool:
        from selenium.common.exceptions import InvalidSessionIdException

        if not isinstance(err, InvalidSessionIdException) or self.restarts or not self._url:
            return False
        self.restarts += 1
        with contextlib.suppress(Exception):
            self.driver.quit()
        self.driver = _chromium(self._profiles.mktemp("chromium-profile"))
        self.driver.get(self._url)
        wait(self, lambda d: polls(d) >= 1, "the first poll after a restart")
        return True

    def get(self, url: str) -> None:
        self._url = url
        self.call("get", url)

    def call(self, name: str, *args):
        try:
            return getattr(self.driver, name)(*args)
        except Exception as err:
            if self.lost(err):
                return getattr(self.driver, name)(*args)
            raise

    def __getattr__(self, name: str):  # the driver's methods through call(), its properties
        try:
            attr = getattr(self.driver, name)
        except Exception as err:
            if not self.lost(err):
                raise
            attr = getattr(self.driver, name)
        return functools.partial(self.call, name) if callable(attr) else attr


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory)
    yield b
    b.driver.quit()


def wait(driver, pred, what: str, timeout: float = 60):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page re-renders every poll, so an element found a moment ago may be gone: retry.
    ignored = (NoSuchElementException, StaleElementReferenceException)
    for attempt in range(2):
        try:
            return WebDriverWait(driver.driver, timeout, poll_frequency=0.2,
                                 ignored_exceptions=ignored).until(lambda d: pred(driver))
        except Exception as err:
            if attempt == 0 and driver.lost(err):
                continue
            raise AssertionError(f"timed out waiting for {what}") from err
    raise AssertionError(f"timed out waiting for {what}")


def value(driver, element_id: str) -> int:
    """An element's data-value, read in one script call (no stale element between calls)."""
    got = driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.dataset.value : null",
        element_id)
    return int(got or -1)


def card(driver, model: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'.worker[data-model="{model}"]')


def polls(driver) -> int:
    return int(driver.execute_script("return document.body.dataset.polls || 0"))


def test_dashboard_shows_live_figures_and_updates(proxy, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    d.get(proxy.url + "/")
    assert d.title == "plimsoll"
    wait(d, lambda d: polls(d) >= 1, "the first poll")
    assert wait(d, lambda d: d.find_element(By.ID, "mode").text, "the mode") == "standalone"
    assert value(d, "budget") == 512 * MIB
    assert value(d, "os-floor") == 4 * 1024 * MIB
    host = httpx.get(proxy.url + "/dashboard.json", timeout=30).json()["host"]
    assert value(d, "ceiling") == host["ceiling_bytes"]
    assert value(d, "total-ram") == host["total_ram_bytes"]
    assert value(d, "envelope") == host["envelope_bytes"]
    assert wait(d, lambda d: card(d, "tiny").get_attribute("data-state"), "the card") == "stopped"
    assert value(d, "used-weights") == 0

    # a refusal, then a request that loads the model
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=60,
                   json={"model": "huge", "messages": MSG, "max_tokens": 4})
    assert r.status_code == 503
    assert chat(proxy.client(), "tiny", max_tokens=8).model == "tiny"
    wait(d, lambda d: card(d, "tiny").get_attribute("data-state") == "ready", "tiny ready")
    worker = next(w for w in proxy.running()["workers"] if w["model"] == "tiny")
    pool = worker["memory"]["pool"]
    pool_total = wait(d, lambda d: card(d, "tiny").find_element(By.CSS_SELECTOR, "td.pool")
                      .get_attribute("data-total"), "the pool row")
    assert int(pool_total) == pool["total"]
    wait(d, lambda d: card(d, "tiny").find_element(By.CSS_SELECTOR, "td.requests")
         .get_attribute("data-ok") == "1", "one request counted")
    assert value(d, "used-weights") == worker["admitted"]["weights_bytes"]
    assert value(d, "admitted") == worker["admitted"]["footprint_bytes"]
    wait(d, lambda d: value(d, "used-cache") > 0, "the retained prefix in the cache")
    reasons = wait(d, lambda d: [e.text for e in d.find_elements(
        By.CSS_SELECTOR, "#refusals tr.refusal td.reason")], "the refusals")
    assert "admission_refused" in reasons
    assert "huge" in wait(d, lambda d: d.find_element(By.ID, "refusals").text, "refusals")

    # the timeline grows live
    before = int(wait(d, lambda d: d.find_element(By.ID, "timeline")
                      .get_attribute("data-points"), "the timeline"))
    wait(d, lambda d: int(d.find_element(By.ID, "timeline").get_attribute("data-points"))
         >= max(before + 2, 3), "the timeline to grow")
    assert d.find_elements(By.CSS_SELECTOR, "#timeline path")

    shots = Path(os.environ.get("PLIMSOLL_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    assert d.save_screenshot(str(shots / "dashboard.png"))
    print(f"dashboard screenshot: {shots / 'dashboard.png'}")

    severe = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, f"console errors: {severe}"


def test_page_is_self_contained(proxy):
    html = httpx.get(proxy.url + "/", timeout=10).text
    assert "<script>" in html and "dashboard.json" in html
    for outside in ("http://", "https://", "//cdn"):
        assert outside not in html.replace("http://www.w3.org/2000/svg", "")


def test_a_browser_that_goes_away_is_started_again_once(proxy, tmp_path_factory):
    """The session's restart (:class:`Browser`) does what it is there for: Chromium killed
    under a running session, the next call opens the page on a new one."""
    import psutil

    b = Browser(tmp_path_factory)
    try:
        b.get(proxy.url + "/")
        wait(b, lambda d: polls(d) >= 1, "the first poll")
        driver_pid = b.driver.service.process.pid
        for child in psutil.Process(driver_pid).children(recursive=True):
            child.kill()
        assert wait(b, lambda d: polls(d) >= 1, "a poll on the new page") >= 1
        assert b.restarts == 1 and b.title == "plimsoll"
    finally:
        b.driver.quit()
