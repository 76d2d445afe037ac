"""Hostile input against the default service (``make run``): a huge request is refused
without stalling anyone else, refused inputs leave the engine replica's memory where it was,
and no error body grows with the input. Real HTTP on 127.0.0.1, bounded in count and time;
latency is compared with the same requests alone, in the same test (the CPU is shared)."""
import asyncio
import json
import statistics
import threading
import time

import aiohttp
import pytest
import requests

from tests.app.conftest import MODEL

BODY_LIMIT = 64 * 8192 + (1 << 20)  # the default: 64 bytes a token of max_model_len, + 1 MiB
NORMAL = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0,
          "ignore_eos": True}
HUGE = {
    "20 MB prompt": ("/v1/completions",
                     {"model": MODEL, "prompt": "hello world " * 1_750_000, "max_tokens": 4}),
    "100,000-message chat": ("/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 100_000,
                              "max_tokens": 4}),
}


async def _post(session, url, path, data: bytes):
    async with session.post(url + path, data=data, headers={"content-type": "application/json"}) as response:
        return response.status, await response.read()


async def _normal_latencies(session, url, count) -> list[float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        status, body = await _post(session, url, "/v1/completions", json.dumps(NORMAL).encode())
        assert status == 200, body
        latencies.append(time.perf_counter() - start)
    return latencies


async def _repeat_until(stop: asyncio.Event, make_call) -> list:
    results = []
    while not stop.is_set():
        results.append(await make_call())
    return results


class _Sender(threading.Thread):
    """Sends one body again and again until stopped, on its own thread and connection, so
    that the client's own work does not count in the latency the test measures. It pauses
    ``PAUSE_S`` between requests: ten 20 MB bodies a second is still a flood, and without a
    pause this process's own sending (GIL and CPU on a 2-core machine) slows the normal
    requests it times about 2x whatever the server does."""

    PAUSE_S = 0.1

    def __init__(self, url: str, data: bytes) -> None:
        super().__init__(daemon=True)
        self.url, self.data = url, data
        self.stop = threading.Event()
        self.answers: list[tuple[int, bytes]] = []

    def run(self) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                response = session.post(self.url, data=self.data, timeout=60,
                                        headers={"content-type": "application/json"})
                self.answers.append((response.status_code, response.content))
                self.stop.wait(self.PAUSE_S)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HUGE))
def test_a_huge_request_is_refused_without_stalling_others(api, name):
    path, body = HUGE[name]
    data = json.dumps(body).encode()
    assert len(data) > BODY_LIMIT

    async def health(session):
        start = time.perf_counter()
        async with session.get(api.url + "/health") as response:
            return response.status, time.perf_counter() - start

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await _normal_latencies(session, api.url, 2)  # warm-up
            alone, beside, refusals, health_checks = [], [], [], []
            for _ in range(3):  # alternate, so that both sides see the same machine load
                alone += await _normal_latencies(session, api.url, 4)
                sender, stop = _Sender(api.url + path, data), asyncio.Event()
                sender.start()
                probes = asyncio.create_task(_repeat_until(stop, lambda: health(session)))
                beside += await _normal_latencies(session, api.url, 4)
                sender.stop.set()
                stop.set()
                health_checks += await probes
                await asyncio.to_thread(sender.join)
                refusals += sender.answers
            return alone, beside, refusals, health_checks

    alone, beside, refusals, health_checks = asyncio.run(main())
    assert refusals and all(status == 413 for status, _ in refusals)
    assert json.loads(refusals[0][1]) == {"error": {
        "message": f"the request body is larger than {BODY_LIMIT} bytes (max_request_body_bytes)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    assert health_checks and {status for status, _ in health_checks} == {200}
    ratio = statistics.median(beside) / statistics.median(alone)
    print(f"{name}: {len(refusals)} refused; normal p50 {statistics.median(alone):.3f} s alone, "
          f"{statistics.median(beside):.3f} s beside ({ratio:.2f}x); /health {len(health_checks)} x 200")
    assert ratio <= 2.0, (f"{len(refusals)} refused {name}s slowed normal requests {ratio:.2f}x: "
                          f"alone {sorted(alone)}, beside {sorted(beside)}")


# Inputs under the body limit that reach the engine replica and are refused there: by the
# character bound before tokenizing, by token count after tokenizing (about 0.2 s each), by
# the message bound before templating, by token count after templating.
UNDER_LIMIT = [
    ("/v1/completions", {"model": MODEL, "prompt": "hello world " * 100_000, "max_tokens": 4},
     "prompt: 1200000 characters cannot fit"),
    ("/v1/completions", {"model": MODEL, "prompt": "hello world " * 55_000, "max_tokens": 4},
     "prompt (110001 tokens) + at least 1 output token exceeds max_model_len (8192)"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 200_000, "max_tokens": 4},
     "prompt (200000 tokens) + at least 1 output token exceeds max_model_len (8192)"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 8192},
     "messages: 8192 messages cannot fit in max_model_len (8192) tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 8000},
     "prompt (48025 tokens) + at least 1 output token exceeds max_model_len (8192)"),
]


@pytest.mark.slow
def test_refused_large_requests_leave_the_engine_replica_memory_flat(api):
    (replica,) = api.engine_replicas()
    requests.post(api.url + "/v1/completions", json=NORMAL, timeout=60).raise_for_status()
    before = replica.memory_info().rss
    huge = [HUGE[name] for name in HUGE]
    for i in range(10):  # alternating: refused at the door (413) and in the engine replica (400)
        path, body, fragment = (*huge[i % 2], None) if i % 2 == 0 else UNDER_LIMIT[i // 2]
        response = requests.post(api.url + path, json=body, timeout=60)
        assert response.status_code == (413 if fragment is None else 400), response.text
        assert fragment is None or fragment in response.json()["error"]["message"]
    after = replica.memory_info().rss
    print(f"engine replica RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    assert after <= 1.10 * before, f"engine replica RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB"
    requests.post(api.url + "/v1/completions", json=NORMAL, timeout=60).raise_for_status()


# Inputs whose size an error message could echo: each answer stays small.
ECHOES = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [str(i) for i in range(10_000)]}, "stop"),
    ("/v1/completions", {"model": "m" * 200_000, "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x" * 200_000: 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {f"{i}x": 1 for i in range(20_000)}},
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": "y" * 200_000}}, "logit_bias.1"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "t" * 200_000}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1] * 50_000}, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"k" * 200_000: "y"}},
     "logit_bias." + "k" * 94 + "... (200011 characters)"),  # the key's location, cut to 128
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 50_000}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 50_000}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9] * 8000}, "prompt[0]"),
    # a long key that is not valid Unicode: refused as the body's, no param
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "\ud800" * 100_000: "\ud800"}, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "r" * 200_000, "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 10**4000}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


def test_error_bodies_stay_small_whatever_the_input(api):
    for path, body, param in ECHOES:
        response = requests.post(api.url + path, json=body, timeout=60)
        assert 400 <= response.status_code < 500, response.text[:300]
        assert len(response.content) < 512, response.text[:600]
        assert response.json()["error"]["param"] == param, response.text[:300]
    response = requests.post(api.url + "/v1/chat/completions", timeout=60, json=ECHOES[-1][1])
    assert response.json()["error"]["message"] == "top_logprobs must be in [0, 20]; got 21"
