"""Two engine replicas (ray_configs/serve_multi_replica.yaml): requests reach both; one
killed mid-load hangs no client and the app recovers. Real HTTP on 127.0.0.1, bounded."""
import asyncio
import re
import time

import aiohttp
import pytest
import requests

from tests.browser import COUNT_CELLS_JS, chromium, wait
from tests.serve_process import ServeProcess

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"


@pytest.fixture(scope="module")
def two_replicas():
    # Eager (MINI_INFER_ENFORCE_EAGER): routing and recovery, not the compiled glue, which
    # would cost each replica start (three here) ~13 s on two shared cores.
    with ServeProcess.serve_run(["ray_configs/serve_multi_replica.yaml"], num_engine_replicas=2,
                                env={"MINI_INFER_ENFORCE_EAGER": "1"}) as app:
        yield app


async def _complete(session, url, i, timeout=90):
    """One request to its end: its HTTP status, "sse error" for a stream that ended with an
    error event, "cut" for a stream that ended without [DONE]. A hang raises a timeout."""
    body = {"model": MODEL, "prompt": f"Tell me about number {i}.", "max_tokens": 16, "stream": i % 2 == 0}
    async with session.post(url + "/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        text = await response.text()
        if response.status != 200 or not body["stream"]:
            return response.status
        if '"error"' in text:
            return "sse error"
        return 200 if text.rstrip().endswith("[DONE]") else "cut"


def test_requests_reach_both_replicas(two_replicas):
    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8}
            seen, statuses = set(), []
            for _ in range(4):
                responses = await asyncio.gather(*(session.post(two_replicas.url + "/v1/completions", json=body)
                                                   for _ in range(6)))
                statuses += [r.status for r in responses]
                seen |= {r.headers["x-mini-infer-replica"] for r in responses if r.status == 200}
                if len(seen) == 2:
                    break
            return seen, statuses

    seen, statuses = asyncio.run(main())
    assert len(seen) == 2 and set(statuses) == {200}, (seen, statuses)
    replicas = requests.get(two_replicas.url + "/stats", timeout=10).json()["replicas"]
    assert len({r["replica_id"] for r in replicas}) == 2
    metrics = requests.get(two_replicas.url + "/metrics", timeout=10).text
    running = re.findall(r'^mini_infer_num_requests_running\{[^}]*replica="([^"]+)"', metrics, re.M)
    assert sorted(running) == sorted(r["replica_id"] for r in replicas)


def test_dashboard_shows_one_grid_per_replica(two_replicas):
    from selenium.webdriver.common.by import By

    replicas = requests.get(two_replicas.url + "/stats?blocks=1", timeout=30).json()["replicas"]
    assert len({(r["replica_id"], r["node_id"]) for r in replicas}) == 2
    with chromium() as browser:
        browser.get(two_replicas.url + "/dashboard")
        sections = wait(lambda: len(found := browser.find_elements(By.CSS_SELECTOR, "section.replica")) == 2 and found,
                        30, "two replicas' sections")
        assert {s.get_attribute("data-replica-id") for s in sections} == {r["replica_id"] for r in replicas}
        for replica in replicas:
            counts = wait(lambda r=replica: browser.execute_script(COUNT_CELLS_JS, r["replica_id"]), 30, "a grid")
            assert counts["cells"] == replica["num_total_blocks"] == len(replica["blocks"]["ref_counts"])
            assert counts["used"] == counts["shared"] == counts["other"] == 0
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_killing_a_replica_mid_load_hangs_no_client_and_the_app_recovers(two_replicas):
    victims = two_replicas.engine_replicas()
    assert len(victims) == 2

    async def client(session, i, stop_at):
        outcomes = []
        while time.monotonic() < stop_at:
            outcomes.append(await _complete(session, two_replicas.url, i))
        return outcomes

    async def main():
        async with aiohttp.ClientSession() as session:
            stop_at = time.monotonic() + 12
            clients = [asyncio.create_task(client(session, i, stop_at)) for i in range(6)]
            await asyncio.sleep(3)
            victims[0].kill()
            killed_at = time.monotonic()
            outcomes = [o for result in await asyncio.gather(*clients) for o in result]
            # The app serves again: a request succeeds within 60 s of the kill.
            while time.monotonic() - killed_at < 60:
                if await _complete(session, two_replicas.url, 1) == 200:
                    return outcomes, time.monotonic() - killed_at
                await asyncio.sleep(1)
            return outcomes, None

    outcomes, recovered_after = asyncio.run(main())
    assert set(outcomes) <= {200, 503, "sse error"}, outcomes  # complete answers or clean errors
    assert outcomes.count(200) > 0
    assert recovered_after is not None and recovered_after < 60
    # Serve replaces the dead replica: two engine replicas again, within the same minute.
    deadline = time.monotonic() + 60 - recovered_after
    while two_replicas.num_replicas_up() < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert two_replicas.num_replicas_up() == 2
    assert victims[0].pid not in {p.pid for p in two_replicas.engine_replicas()}
