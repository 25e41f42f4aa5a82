"""The cluster page in a real browser: headless Chromium shows two training islands and plots.

A real cluster (`diloco-server start --metrics-port` and two islands of
`page_island.py`, each a `worker.join` session training a numpy regression:
subprocesses on 127.0.0.1, random ports) and Debian's chromium +
chromium-driver driven by selenium. Skipped only when chromium or its driver is
not installed (`.ci/run` installs both).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import free_port, wait_for

from bench.launcher import LocalCluster

HERE = Path(__file__).resolve().parent

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)


def browser(profile: Path):
    """A headless Chromium under selenium, with a fresh profile and nothing fetched."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def page_state(driver) -> dict:
    return driver.execute_script("return window.clusterPage || {};") or {}


class Islands:
    """`page_island.py` processes, started one after the other, stopped with SIGTERM."""

    def __init__(self, connect: str, tmp_path: Path) -> None:
        self.connect, self.tmp_path = connect, tmp_path
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str) -> None:
        ready = self.tmp_path / f"{name}.joined"
        log = (self.tmp_path / f"{name}.log").open("w")
        argv = [sys.executable, str(HERE / "page_island.py"), self.connect, name, str(ready)]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        wait_for(
            lambda: ready.exists() or proc.poll() is not None,
            f"island {name} to join",
            timeout_s=90,
        )
        assert proc.poll() is None, (self.tmp_path / f"{name}.log").read_text()

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver",
)
def test_the_page_shows_two_islands_with_their_loss_and_plots(tmp_path):
    port = free_port()
    server_args = ("--metrics-port", str(port), "--mode", "async", "--heartbeat-interval-s", "0.5")
    with LocalCluster(tmp_path / "run", shards=2, server_args=server_args) as cluster:
        cluster.start_server()
        islands = Islands(cluster.connect, tmp_path)
        try:
            islands.start("a")  # the first initialises the cluster
            islands.start("b")
            with tempfile.TemporaryDirectory(prefix="diloco-chromium-") as profile:
                shot = look(browser(Path(profile)), port, tmp_path)
        finally:
            islands.stop()
    assert shot.stat().st_size > 10_000


def look(driver, port: int, tmp_path: Path) -> Path:
    """Open the page, wait for both islands with a loss and both plots with points; screenshot."""
    try:
        driver.get(f"http://127.0.0.1:{port}/")

        def shown():
            state = page_state(driver)
            with_loss = {i["island"] for i in state.get("islands", []) if i.get("loss") is not None}
            points = min(state.get("lossPoints", 0), state.get("versionPoints", 0))
            return with_loss == {"a", "b"} and points >= 4 and state

        state = wait_for(shown, "both islands with a loss and the plots", timeout_s=60, poll_s=0.5)
        assert state["error"] is None
        rows = driver.find_elements("css selector", "#islands tbody tr")
        by_island = {r.get_attribute("data-island"): r for r in rows}
        assert set(by_island) == {"a", "b"}
        for row in by_island.values():
            assert float(row.get_attribute("data-loss")) > 0
            assert "live" in row.text
        shards = driver.find_elements("css selector", "#shards tbody tr")
        assert [s.get_attribute("data-shard") for s in shards] == ["0", "1"]
        assert all(" up " in f" {s.text} " for s in shards)
        assert len(driver.find_elements("css selector", ".chart canvas")) == 2
        shot = tmp_path / "cluster-page.png"
        assert driver.save_screenshot(str(shot))
        return shot
    finally:
        driver.quit()
