"""Headless Chromium for the dashboard's tests: Debian's chromium and chromium-driver
(scripts/setup.sh installs them), driven by Selenium."""
from __future__ import annotations

import contextlib
import shutil
import time
from typing import Iterator

# Counts the canvas's cells by the colour of each cell's centre pixel (the page's own
# palette, read from its CSS variables): what the user sees, not the page's data.
COUNT_CELLS_JS = """
const canvas = document.querySelector(`section[data-replica-id="${arguments[0]}"] canvas.grid`);
if (!canvas || !canvas.dataset.numBlocks) return null;
const n = Number(canvas.dataset.numBlocks), cols = Number(canvas.dataset.cols), cell = Number(canvas.dataset.cell);
const style = getComputedStyle(document.documentElement);
const rgb = hex => [1, 3, 5].map(i => parseInt(hex.trim().slice(i, i + 2), 16)).join(",");
const names = Object.fromEntries(["free", "cached", "used", "shared"].map(
  s => [rgb(style.getPropertyValue("--" + s)), s]));
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
const counts = {free: 0, cached: 0, used: 0, shared: 0, other: 0, cells: n,
                rows: canvas.height / cell, cols: cols, cell: cell};
for (let i = 0; i < n; i++) {
  const x = (i % cols) * cell + Math.floor(cell / 2), y = Math.floor(i / cols) * cell + Math.floor(cell / 2);
  const k = (y * canvas.width + x) * 4;
  counts[names[[pixels[k], pixels[k + 1], pixels[k + 2]].join(",")] || "other"]++;
}
return counts;
"""


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Chromium WebDriver that keeps the browser console's messages
    (``driver.get_log("browser")``); quit on exit.

    Raises:
        AssertionError: naming the packages, where chromium or chromedriver is missing.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver_path, ("Debian's chromium and chromium-driver are needed (scripts/setup.sh "
                                    "installs them): apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
