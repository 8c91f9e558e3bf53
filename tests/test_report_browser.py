"""The HTML report in a real headless Chromium, driven over the DevTools protocol: every figure decodes at the
size of the PNG the report wrote (read from the file's own header, not from the page), nothing reaches the
console (console calls, uncaught exceptions, browser log entries), and a full-page screenshot is kept.

Skips only where no chromium binary exists; under CI (CI=true) a missing browser fails instead, since
`scripts/setup_browser.sh` installs Debian's chromium there. Set PACKLOADER_ARTIFACTS to a folder to keep the
screenshot beyond the test's tmp path."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from packloader.cli.main import main

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--remote-allow-origins=*", "--window-size=1200,900"]


def browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true but no chromium on PATH: run scripts/setup_browser.sh (setup.sh dev does)")
        pytest.skip("no chromium on this machine (scripts/setup_browser.sh installs Debian's)")
    return found


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (bytes 16-24)."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


class DevTools:
    """A minimal DevTools-protocol client on one page target: commands by id, events kept in order."""

    def __init__(self, ws) -> None:
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, **params):
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive(timeout=120)).data)
            if msg.get("id") == self.next_id:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]
            self.events.append(msg)

    async def wait_event(self, method: str):
        while not any(e.get("method") == method for e in self.events):
            self.events.append(json.loads((await self.ws.receive(timeout=120)).data))


IMAGES_JS = """Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth,
  h: i.naturalHeight, shown: i.getBoundingClientRect().width > 0}))"""


async def render(url: str, port: int):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            dt = DevTools(ws)
            for domain in ("Page", "Runtime", "Log"):
                await dt.call(f"{domain}.enable")
            await dt.call("Page.navigate", url=url)
            await dt.wait_event("Page.loadEventFired")
            images = (await dt.call("Runtime.evaluate", expression=IMAGES_JS, returnByValue=True))["result"]["value"]
            shot = await dt.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            noise = [e for e in dt.events if e.get("method") in
                     ("Runtime.consoleAPICalled", "Runtime.exceptionThrown", "Log.entryAdded")]
            return images, base64.b64decode(shot["data"]), noise


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    rng = np.random.default_rng(2)
    np.save(tmp / "lengths.npy", np.minimum(16384, (rng.pareto(1.2, 2000) * 600 + 30).astype(np.int64)))
    code = main(["report", "--lengths", str(tmp / "lengths.npy"), "--dp", "2", "--pp", "2", "--model", "tiny",
                 "--max-tokens", "16384", "--tokens-per-step", "65536", "--steps", "3", "--strategies",
                 "fixed,wlb", "--no-advice", "--out", str(tmp / "out"), "--no-progress"])
    assert code == 0
    return tmp / "out"


@pytest.mark.multiprocess
def test_report_renders_in_chromium_every_figure_loads_and_the_console_stays_empty(report_dir, tmp_path):
    exe = browser()
    html = report_dir / "report.html"
    pngs = sorted(report_dir.glob("*.png"))
    assert html.exists() and len(pngs) >= 3, sorted(p.name for p in report_dir.iterdir())
    profile = tmp_path / "profile"  # a fresh user-data-dir: no state from another run
    log = tmp_path / "chromium.log"  # a file, not a pipe nobody reads while it runs
    with open(log, "w") as err:
        proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        active = profile / "DevToolsActivePort"  # Chromium writes its port here once it listens
        for _ in range(600):  # a bound for a browser that never starts, not a timing assertion
            if active.exists() and active.read_text().strip():
                break
            if proc.poll() is not None:
                pytest.fail(f"chromium exited with {proc.returncode}: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        port = int(active.read_text().split()[0])
        images, shot, noise = asyncio.run(render(html.resolve().as_uri(), port))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    (tmp_path / "report.png").write_bytes(shot)
    if os.environ.get("PACKLOADER_ARTIFACTS"):
        keep = Path(os.environ["PACKLOADER_ARTIFACTS"])
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "report-in-chromium.png").write_bytes(shot)

    assert noise == [], noise  # no console output, no exception, no browser log entry
    assert [i for i in images if not (i["complete"] and i["shown"])] == []
    # every PNG the report wrote is on the page, decoded at its own size
    assert sorted((i["w"], i["h"]) for i in images) == sorted(png_size(p) for p in pngs)
    import matplotlib.image as mpimg

    page = mpimg.imread(tmp_path / "report.png")
    assert page.shape[0] > 900  # full page, beyond the 900-pixel viewport: the figures are below the tables
    ink = (page[..., :3].mean(axis=2) < 0.5).mean()  # dark pixels: text, tables and plots were drawn
    assert 0.005 < ink < 0.5


def test_png_size_reads_the_header(tmp_path):
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(3, 2), dpi=50)
    fig.savefig(tmp_path / "f.png")
    plt.close(fig)
    assert png_size(tmp_path / "f.png") == (150, 100)
