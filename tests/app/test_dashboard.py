"""``GET /dashboard`` and ``GET /stats?blocks=1`` on the real service (``make run``): exact
block counts and prefix-cache hits after known requests, and the page in headless Chromium
(Debian's chromium and chromium-driver, which scripts/setup.sh installs, driven by Selenium):
no console errors, one grid per replica with a cell per block, in-use cells that rise while a
long request runs and return to 0 after it ends, hover and click details. A screenshot goes to
.pytest_cache/dashboard/ (git-ignored)."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import requests

from app.dashboard import page
from tests.app.conftest import MODEL
from tests.browser import COUNT_CELLS_JS, chromium, wait
from tests.serve_process import ROOT

SCREENSHOTS = ROOT / ".pytest_cache" / "dashboard"
BLOCK_SIZE = 16  # the service's default block_size



def _stats(api, blocks=True) -> list[dict]:
    response = requests.get(api.url + "/stats", params={"blocks": 1} if blocks else None, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["replicas"]


def _unique_prompt(tokenizer, num_tokens: int) -> str:
    """Text of exactly ``num_tokens`` tokens that no earlier request sent (a fresh uuid first)."""
    words = f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(num_tokens))
    ids = tokenizer(words).input_ids[:num_tokens]
    text = tokenizer.decode(ids)
    assert len(tokenizer(text).input_ids) == num_tokens
    return text


def test_page_is_served_as_committed(api):
    response = requests.get(api.url + "/dashboard", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.content == page()
    assert b"http://" not in page() and b"https://" not in page()  # nothing from the internet


def test_stats_blocks_agree_with_stats_and_count_hits_of_a_known_prompt(api, client, tokenizer):
    (before,) = _stats(api)
    assert len(before["blocks"]["ref_counts"]) == before["num_total_blocks"] and before["block_size"] == BLOCK_SIZE
    assert before["replica_id"] == _stats(api, blocks=False)[0]["replica_id"] and before["node_id"]
    prompt = _unique_prompt(tokenizer, 3 * BLOCK_SIZE + 5)  # 3 full blocks and 5 tokens
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == 3 * BLOCK_SIZE + 5
    (after,) = _stats(api)
    blocks = after["blocks"]
    assert sum(1 for r in blocks["ref_counts"] if r) == after["num_total_blocks"] - after["num_free_blocks"] == 0
    assert len(blocks["cached"]) == after["num_cached_blocks"]
    assert sum(1 for b in blocks["cached"] if blocks["ref_counts"][b] == 0) == after["num_free_cached_blocks"]
    assert after["num_generation_tokens"] - before["num_generation_tokens"] == 1
    assert after["latency"]["num_samples"]["ttft"] >= 1 and after["latency"]["ttft_s"]["p50"] > 0
    # the same prompt again: its 3 full blocks are found in the cache, each hit once more
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK_SIZE
    hits = _stats(api)[0]["blocks"]["hits"]
    gained = {b: n - after["blocks"]["hits"].get(b, 0) for b, n in hits.items() if n != after["blocks"]["hits"].get(b)}
    assert sorted(gained.values()) == [1, 1, 1]
    assert all(int(b) in after["blocks"]["cached"] for b in gained)


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


def test_page_in_chromium_follows_a_long_request(api, browser, tokenizer):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    (idle,) = _stats(api)
    replica_id, total = idle["replica_id"], idle["num_total_blocks"]
    browser.get(api.url + "/dashboard")
    sections = wait(lambda: browser.find_elements(By.CSS_SELECTOR, "section.replica"), 30, "a replica's section")
    assert [s.get_attribute("data-replica-id") for s in sections] == [replica_id]
    counts = wait(lambda: browser.execute_script(COUNT_CELLS_JS, replica_id), 30, "the grid")
    assert counts["cells"] == total and counts["cols"] * counts["rows"] >= total > counts["cols"] * (counts["rows"] - 1)
    assert counts["used"] == counts["shared"] == counts["other"] == 0
    assert counts["free"] + counts["cached"] == total
    assert counts["cached"] == _stats(api, blocks=False)[0]["num_free_cached_blocks"]

    # a long request: 40 prompt tokens, 400 output tokens (ignore_eos), streamed
    prompt = _unique_prompt(tokenizer, 40)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    done = threading.Event()

    def run():
        try:
            response = requests.post(api.url + "/v1/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        in_use = []
        seen = wait(lambda: (c := browser.execute_script(COUNT_CELLS_JS, replica_id))["used"] and c, 120,
                     "in-use cells while the request runs")
        in_use.append(seen["used"])
        time.sleep(2.5)  # two more polls: the request has grown
        grown = browser.execute_script(COUNT_CELLS_JS, replica_id)
        in_use.append(grown["used"])
        assert not done.is_set(), "the long request ended before the page was checked"
        assert in_use[1] >= in_use[0] >= 3  # 40 prompt tokens and more: 3 blocks or more
        assert in_use[0] <= 28  # 40 + 400 - 1 tokens: 28 blocks at most
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOTS / "dashboard.png"))
        # hover over the request's first block: the detail names its holder
        rows = browser.find_elements(By.CSS_SELECTOR, "tr[data-status=running]")
        (seq_id,) = [r.get_attribute("data-seq-id") for r in rows]
        (running,) = [s for s in _stats(api)[0]["running"] if s["seq_id"] == seq_id]
        canvas = browser.find_element(By.CSS_SELECTOR, "canvas.grid")
        first = running["block_table"][0]
        x = (first % grown["cols"]) * grown["cell"] + grown["cell"] // 2
        y = (first // grown["cols"]) * grown["cell"] + grown["cell"] // 2
        ActionChains(browser).move_to_element_with_offset(
            canvas, x - canvas.size["width"] // 2, y - canvas.size["height"] // 2).perform()
        detail = browser.find_element(By.CSS_SELECTOR, ".detail").text
        assert detail.startswith(f"block {first}: in use, ref count 1; held by {seq_id}"), detail
        # a click on the request's row shows its block table: the one /stats reported, read a
        # poll earlier or later (the request grows a block every 16 tokens), so one of the two
        # is the start of the other
        def click_row():
            try:
                browser.find_element(By.CSS_SELECTOR, f'tr[data-seq-id="{seq_id}"]').click()
                return True
            except StaleElementReferenceException:  # a poll rebuilt the table before the click
                return False

        wait(click_row, 10, "a click on the request's row")
        detail = browser.find_element(By.CSS_SELECTOR, ".detail").text
        assert detail.startswith(f"{seq_id} (running): block table ["), detail
        shown = [int(b) for b in detail.split("[", 1)[1].split("]", 1)[0].split(", ")]
        reported = running["block_table"]
        assert len(shown) >= 3 and shown[:len(reported)] == reported[:len(shown)], (shown, reported)
        assert done.wait(300)
    finally:
        thread.join(300)
    after = wait(lambda: (c := browser.execute_script(COUNT_CELLS_JS, replica_id))["used"] == 0 and c, 30,
                  "no in-use cells after the request ended")
    assert after["shared"] == 0 and after["free"] + after["cached"] == total
    stats = _stats(api, blocks=False)[0]
    assert stats["num_free_blocks"] == total
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
