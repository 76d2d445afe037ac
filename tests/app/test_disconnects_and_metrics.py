"""Clients that go away free their blocks within a step; metrics on the service's own port
from the start, and at Ray's endpoint."""
import asyncio
import json
import re
import time
from pathlib import Path

import aiohttp
import requests

from tests.app.conftest import MODEL


async def _stats(session, url):
    async with session.get(url + "/stats") as response:
        return (await response.json())["replicas"][0]


async def _wait_idle(session, url, timeout):
    deadline = time.monotonic() + timeout
    stats = None
    while time.monotonic() < deadline:
        stats = await _stats(session, url)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 \
                and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return True, stats
        await asyncio.sleep(0.05)
    return False, stats


def test_streams_cut_after_their_first_chunk_free_everything_within_2s(api):
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def first_chunk_then_leave(session, i):
        async with session.post(api.url + "/v1/completions", json={**body, "seed": i}) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {"):
                    return  # leaving the context closes the connection

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(first_chunk_then_leave(session, i) for i in range(20)))
            cut_at = time.monotonic()
            idle, stats = await _wait_idle(session, api.url, timeout=2.0)
            return idle, stats, time.monotonic() - cut_at

    aborted = r'mini_infer_request_success_total\{[^}]*finished_reason="abort"[^}]*\}'
    before = _sample(requests.get(api.url + "/metrics", timeout=30).text, aborted)
    idle, stats, seconds = asyncio.run(main())
    assert idle, f"not idle {seconds:.2f}s after 20 disconnects: {stats}"
    deadline, counted = time.monotonic() + 10, 0.0
    while counted < 20 and time.monotonic() < deadline:  # recorded as each stream closes
        counted = _sample(requests.get(api.url + "/metrics", timeout=30).text, aborted) - before
        time.sleep(0.2)
    assert counted == 20  # each request's one choice, finished by its client leaving
    # every token the engine sampled is counted, each departed stream's last one too (a trial
    # found /metrics one token per aborted choice below /stats); taken each second
    sampled = sum(r["num_generation_tokens"] for r in requests.get(api.url + "/stats", timeout=30).json()["replicas"])
    generated = _metric_after_its_update(api.url, r"mini_infer_generation_tokens_total\{[^}]*\}", sampled)
    assert generated == sampled


def test_a_batch_of_prompts_cut_mid_stream_or_unstreamed_frees_every_prompts_request(api):
    # a completions batch runs one engine request per prompt: a client that leaves stops all
    body = {"model": MODEL, "prompt": ["Tell a long story.", "Count to a thousand:", "Once upon a time"], "n": 2,
            "max_tokens": 1000, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.post(api.url + "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status == 200
                num_events = 0
                async for line in response.content:
                    num_events += line.startswith(b"data: {")
                    if num_events == 10:
                        break
            streamed = await _wait_idle(session, api.url, timeout=2.0)
            return streamed, await _leave_unstreamed_after_1s(session, api.url, body)

    (idle, stats), (unstreamed_idle, unstreamed_stats) = asyncio.run(main())
    assert idle, stats
    assert unstreamed_idle, unstreamed_stats


def _sample(text: str, pattern: str) -> float:
    """The sum of the samples whose series matches ``pattern`` in Prometheus text."""
    return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", text, re.M))


def _metric_after_its_update(url: str, pattern: str, expected: float, timeout: float = 10.0) -> float:
    """``_sample`` of ``/metrics`` once it equals ``expected`` or ``timeout`` s have passed: the
    engine's running totals are taken each second, on a thread a busy host may run late."""
    deadline = time.monotonic() + timeout
    while True:
        value = _sample(requests.get(url + "/metrics", timeout=30).text, pattern)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


async def _leave_unstreamed_after_1s(session, url: str, body: dict):
    """Send ``body`` unstreamed, leave after 1 s; then ``_wait_idle`` for 2 s."""
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=1.0)) as response:
            await response.read()
    except asyncio.TimeoutError:
        pass
    return await _wait_idle(session, url, timeout=2.0)


def test_a_non_streaming_client_that_leaves_aborts_its_request(api):
    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True}
            return await _leave_unstreamed_after_1s(session, api.url, body)

    idle, stats = asyncio.run(main())
    assert idle, stats


def _ray_metrics_text(api) -> str:
    """Prometheus text from every target Ray lists for its metrics (its service discovery file)."""
    discovery = api.session_dir() / "prom_metrics_service_discovery.json"
    targets = json.loads(discovery.read_text())[0]["targets"]
    return "\n".join(requests.get(f"http://{t}/metrics", timeout=10).text for t in targets)


def test_engine_metrics_are_exported_by_ray(api):
    requests.post(api.url + "/v1/completions", timeout=60,
                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0})
    requests.post(api.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "top_p": 9})
    for _ in range(2):  # the second finds the first's 2 full blocks in the prefix cache
        requests.post(api.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "The sea was grey. " * 8, "max_tokens": 1})
    expected = ["mini_infer_num_requests_running", "mini_infer_num_requests_waiting",
                "mini_infer_kv_cache_usage_perc", "mini_infer_prompt_tokens_total",
                "mini_infer_generation_tokens_total", "mini_infer_time_to_first_token_seconds_bucket",
                "mini_infer_time_per_output_token_seconds_bucket", "mini_infer_inter_token_latency_seconds_bucket",
                "mini_infer_e2e_request_latency_seconds_bucket", "mini_infer_request_success_total",
                "mini_infer_http_errors_total", "mini_infer_prefix_cache_queries_total",
                "mini_infer_prefix_cache_hits_total"]
    patterns = [rf"^ray_{name}\{{" for name in expected] + [
        r'^ray_mini_infer_http_errors_total\{[^}]*status_code="400"',
        r'^ray_mini_infer_request_success_total\{[^}]*finished_reason="length"']
    deadline = time.monotonic() + 30  # Ray exports on a period of a few seconds
    missing = patterns
    while missing and time.monotonic() < deadline:
        text = _ray_metrics_text(api)
        missing = [p for p in patterns if not re.search(p, text, re.M)]
        time.sleep(1.0)
    assert not missing, f"not exported: {missing}"


def _readme_metric_names() -> list[str]:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return sorted(set(re.findall(r"`(mini_infer_[a-z0-9_]+)`", readme)))


def _families(text: str) -> dict[str, str]:
    """Metric family name -> type, from Prometheus text."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_metrics_on_the_http_port_list_every_readme_series_from_the_start(api):
    names = _readme_metric_names()
    assert len(names) >= 12, names
    families = _families(api.metrics_at_start)
    missing = [n for n in names if n not in families and n.removesuffix("_total") not in families]
    assert not missing, api.metrics_at_start
    text = api.metrics_at_start
    assert re.search(r'^mini_infer_num_preemptions_total\{[^}]*\} 0\.0$', text, re.M)
    for reason in ("stop", "length", "abort"):
        assert re.search(rf'^mini_infer_request_success_total\{{[^}}]*finished_reason="{reason}"', text, re.M)
    for status in ("400", "401", "404", "408", "413", "499", "500", "503"):
        assert re.search(rf'^mini_infer_http_errors_total\{{status_code="{status}"\}}', text, re.M)
    assert re.search(r'^mini_infer_time_to_first_token_seconds_bucket\{le="\+Inf",', text, re.M)


def test_metrics_count_what_happens(api):
    sample = _sample
    before = requests.get(api.url + "/metrics", timeout=30)
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    requests.post(api.url + "/v1/completions", timeout=60,
                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    requests.post(api.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "top_p": 9})
    generated = r"mini_infer_generation_tokens_total\{[^}]*\}"
    # the engine's count of sampled tokens, taken each second (app.engine_server._STATS_PERIOD_S)
    deadline = time.monotonic() + 5
    while True:
        after = requests.get(api.url + "/metrics", timeout=30).text
        if sample(after, generated) - sample(before.text, generated) >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.2)  # one more period: nothing else was sampled
    after = requests.get(api.url + "/metrics", timeout=30).text
    assert sample(after, generated) - sample(before.text, generated) == 5
    errors = r'mini_infer_http_errors_total\{status_code="400"\}'
    assert sample(after, errors) - sample(before.text, errors) == 1


def test_render_merges_replicas_into_one_family_each():
    from app.metrics import HttpMetrics, render

    first, second = HttpMetrics(), HttpMetrics()
    first.record_error(400)
    second.record_error(400)
    second.record_error(503)
    text = render([first.families(), second.families()]).decode()
    assert text.count("# TYPE mini_infer_http_errors_total counter") == 1
    assert 'mini_infer_http_errors_total{status_code="400"} 2.0' in text
    assert 'mini_infer_http_errors_total{status_code="503"} 1.0' in text
    assert 'mini_infer_http_errors_total{status_code="404"} 0.0' in text


def test_readiness_probes_are_not_counted_as_requests(api):
    """A trial: each /ready (a real one-token generation) added a finished request and a TTFT
    sample, which a load balancer's probes would fill the dashboards with."""
    series = {"finished": r"mini_infer_request_success_total\{[^}]*\}",
              "ttft": r'mini_infer_time_to_first_token_seconds_count\{[^}]*\}',
              "e2e": r'mini_infer_e2e_request_latency_seconds_count\{[^}]*\}',
              "generated": r"mini_infer_generation_tokens_total\{[^}]*\}"}
    before = requests.get(api.url + "/metrics", timeout=30).text
    for _ in range(2):
        assert requests.get(api.url + "/ready", timeout=60).status_code == 200
        time.sleep(1.1)  # past READY_CACHE_S: the next one generates again
    _metric_after_its_update(api.url, series["generated"],  # the engine's counts are taken each second
                             _sample(before, series["generated"]) + 2)
    after = requests.get(api.url + "/metrics", timeout=30).text
    deltas = {name: _sample(after, pattern) - _sample(before, pattern) for name, pattern in series.items()}
    assert deltas == {"finished": 0, "ttft": 0, "e2e": 0, "generated": 2}
