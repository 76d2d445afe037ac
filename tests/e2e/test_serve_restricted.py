"""The Serve configs validate; an app with an API key and small overload limits, over real
HTTP on 127.0.0.1, bounded in count and time."""
import asyncio
import contextlib
import json
import socket
import time

import aiohttp
import pytest
import requests
import yaml

from app import build_app
from tests.serve_process import ROOT, ServeProcess

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"


@pytest.mark.parametrize("name", ["serve_local.yaml", "serve_cpu.yaml", "serve_gpu.yaml",
                                  "serve_multi_replica.yaml"])
def test_serve_configs_are_valid_and_build(name):
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "ray_configs" / name).read_text()))
    (application,) = config.applications
    assert application.import_path == "app:build_app"
    build_app(application.args or {})  # every arg is a known, valid setting


@pytest.fixture(scope="module")
def restricted():
    # Capacity: 2 running + 2 waiting in the engine replica; the ingress admits no more.
    args = ["app:build_app", "max_num_seqs=2", "max_waiting_requests=2",
            "kv_cache_memory_gb=0.25", f"api_key={KEY}", "dtype=float32",
            "request_body_timeout_s=2", f"max_request_body_bytes={BODY_LIMIT}",
            "enforce_eager=true"]  # admission and auth, not the compiled glue: ~13 s less to start
    with ServeProcess.serve_run(args, api_key=KEY) as app:
        yield app


BODY_LIMIT = 16_000_000  # over gRPC's 4 MiB default message size, once pickled too
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
# (method, path, body, status with the key): every route but /health is behind the key,
# FastAPI's own pages and unknown paths included.
CLOSED = [("GET", "/v1/models", None, 200), ("POST", "/v1/completions", BODY, 200),
          ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "Hi"}]}, 200),
          ("GET", "/stats", None, 200), ("GET", "/ready", None, 200), ("GET", "/docs", None, 200),
          ("GET", "/redoc", None, 200), ("GET", "/openapi.json", None, 200),
          ("GET", "/metrics", None, 200), ("GET", "/dashboard", None, 200),
          ("GET", "/stats?blocks=1", None, 200), ("GET", "/no/such/route", None, 404)]


@pytest.mark.parametrize("method,path,body,status", CLOSED, ids=[f"{m} {p}" for m, p, _, _ in CLOSED])
def test_every_route_but_health_needs_the_api_key(restricted, method, path, body, status):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = requests.request(method, restricted.url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json() == {"error": {
            "message": "a valid API key is required: send 'Authorization: Bearer <key>'",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    response = requests.request(method, restricted.url + path, json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text[:300]
    if method == "GET":  # HEAD stands for GET: the same answer, without a body
        head = requests.head(restricted.url + path, timeout=30)
        assert (head.status_code, head.content) == (401, b"")
        head = requests.head(restricted.url + path, headers=AUTH, timeout=60)
        assert (head.status_code, head.content) == (status, b"")


def test_a_request_over_grpcs_default_message_size_reaches_the_engine_replica(restricted):
    """The ingress calls the engine over Serve's gRPC transport (``engine_transport``), whose
    servers take 4 MiB unless told more: the engine replica is told 2 GiB
    (``app.GRPC_MAX_MESSAGE_BYTES``), so a request under ``max_request_body_bytes`` (12 MB of
    JSON here, about 6 MB pickled) gets the engine's own answer, not a transport error."""
    body = {"model": MODEL, "prompt": [40000] * 2_000_000, "max_tokens": 1}
    response = requests.post(restricted.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 400, response.text[:300]
    assert response.json() == {"error": {
        "message": "prompt (2000000 tokens) + at least 1 output token exceeds max_model_len (8192)",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}}


def test_health_is_open(restricted):
    response = requests.get(restricted.url + "/health", timeout=10)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    head = requests.head(restricted.url + "/health", timeout=10)
    assert (head.status_code, head.content) == (200, b"")


def test_ready_can_be_called_repeatedly(restricted):
    async def main():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async def ready():
                async with session.get(restricted.url + "/ready") as response:
                    return response.status, await response.json()
            return await asyncio.gather(*(ready() for _ in range(50)))

    assert asyncio.run(main()) == [(200, {"status": "ready"})] * 50


async def _one(session, url, i):
    """One request of a burst: its status, Retry-After, seconds to the response headers, and
    whether an accepted one completed (all 24 tokens, or a stream that ends with [DONE])."""
    body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 24, "ignore_eos": True,
            "stream": i % 2 == 0}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        seconds = time.perf_counter() - start
        text = await response.text()
    if response.status != 200:
        complete = None
    elif body["stream"]:
        complete = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    else:
        complete = json.loads(text)["usage"]["completion_tokens"] == 24
    return response.status, response.headers.get("Retry-After"), seconds, complete, text


def test_a_burst_over_capacity_is_refused_at_once_and_the_rest_completes(restricted):
    capacity = 2 + 2

    async def main():
        async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(_one(session, restricted.url, i) for i in range(8 * capacity)))

    results = asyncio.run(main())
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert {r[0] for r in refused} <= {429, 503}, [r[0] for r in refused]
    # At least the capacity, and more only where a request finished while the burst arrived.
    assert len(accepted) >= capacity and len(refused) >= 6 * capacity, [r[0] for r in results]
    assert all(complete for _, _, _, complete, _ in accepted)
    for _, retry_after, _, _, text in refused:
        error = json.loads(text)["error"]
        assert retry_after == "1" and error["code"] == "overloaded", text
        assert error["message"].count("retry") == 1, error["message"]
    refusal_seconds = sorted(seconds for _, _, seconds, _, _ in refused)
    p99 = refusal_seconds[min(len(refusal_seconds) - 1, int(0.99 * len(refusal_seconds)))]
    print(f"{len(accepted)} accepted, {len(refused)} refused in {refusal_seconds[0]:.3f}-"
          f"{refusal_seconds[-1]:.3f} s (p99 {p99:.3f} s)")
    assert p99 < 1.0, f"refusals took {refusal_seconds}"
    _assert_idle_soon(restricted)


@contextlib.asynccontextmanager
async def _long_streams(session, url: str, count: int, num_running: int = 2):
    """``count`` streams of 500 tokens sent at once; yields once ``num_running`` of them run
    (their first event read: the ingress sends no header before it) and the others are in the
    engine's queue (``/stats``, within 10 s); all are closed on leaving."""
    long = {"model": MODEL, "prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}

    async def one():
        response = await session.post(url + "/v1/completions", json=long)
        assert response.status == 200 and (await response.content.readline()).startswith(b"data: {")
        return response

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    try:
        done, pending = set(), set(tasks)
        while len(done) < num_running:
            finished, pending = await asyncio.wait(pending, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert finished, "no stream started in 60 s"
            done |= finished
        for _ in range(100):
            async with session.get(url + "/stats") as response:
                (stats,) = (await response.json())["replicas"]
            if stats["num_running"] + stats["num_waiting"] >= count:
                break
            await asyncio.sleep(0.1)
        yield [task.result() for task in done]
    finally:
        for task in tasks:
            task.cancel()
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()


def test_a_full_engine_replica_still_answers_health_stats_and_metrics_at_once(restricted):
    # Serve counts these control calls against the replica's max_ongoing_requests: they waited
    # behind its generations (/health 503 after 5 s; /stats 9.7 s), before it kept places for them
    async def main():
        async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=120)) as session:
            async with _long_streams(session, restricted.url, 2 + 2):  # the whole capacity
                answers = []
                for path in ("/health", "/stats", "/metrics", "/health"):
                    start = time.monotonic()
                    async with session.get(restricted.url + path) as response:
                        body = await response.text()
                        answers.append((path, response.status, time.monotonic() - start, body))
                return answers

    answers = asyncio.run(main())
    assert [(path, status) for path, status, _, _ in answers] == \
        [("/health", 200), ("/stats", 200), ("/metrics", 200), ("/health", 200)], answers
    assert max(seconds for _, _, seconds, _ in answers) < 2.0, answers
    (stats,) = json.loads(answers[1][3])["replicas"]
    assert (stats["num_running"], stats["num_waiting"]) == (2, 2)  # max_num_seqs, max_waiting_requests
    _assert_idle_soon(restricted)


def test_a_batch_of_prompts_takes_a_place_per_prompt(restricted):
    # capacity 4: a batch of 4 runs; of 5 can never run (400); of 3 beside two streams must wait (503)
    url = restricted.url + "/v1/completions"
    batch = {"model": MODEL, "max_tokens": 2, "ignore_eos": True}
    response = requests.post(url, json={**batch, "prompt": ["a", "b", "c", "d"]}, headers=AUTH, timeout=60)
    assert response.status_code == 200 and [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]
    response = requests.post(url, json={**batch, "prompt": ["a"] * 5}, headers=AUTH, timeout=60)
    assert (response.status_code, response.json()["error"]) == (400, {
        "message": "prompt: a batch of 5 prompts is more than the 4 requests this service runs or queues at once "
                   "(max_num_seqs + max_waiting_requests per engine replica)",
        "type": "invalid_request_error", "param": "prompt", "code": None})

    async def main():
        async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=120)) as session:
            async with _long_streams(session, restricted.url, 2):
                async with session.post(url, json={**batch, "prompt": ["a", "b", "c"]}) as refused:
                    return refused.status, refused.headers.get("Retry-After"), await refused.json()

    status, retry_after, body = asyncio.run(main())
    assert (status, retry_after, body["error"]["code"]) == (503, "1", "overloaded")
    assert body["error"]["message"] == ("the service is overloaded: a batch of 3 prompts needs 3 of the 4 places for "
                                        "requests running or waiting (max_num_seqs + max_waiting_requests per engine "
                                        "replica) and 2 are free; retry later")
    _assert_idle_soon(restricted)
    response = requests.post(url, json={**batch, "prompt": ["a", "b", "c", "d"]}, headers=AUTH, timeout=60)
    assert response.status_code == 200  # every place came back


def test_a_streamed_batch_starts_before_its_last_prompt_runs(restricted):
    # max_num_seqs 2: of a batch of 4, two wait for a place; the stream started only once they
    # ran (a second trial: 7.0 s to the first event for 5 prompts over 4 places, not 0.05 s)
    body = {"model": MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def main():
        async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=120)) as session:
            async with session.post(restricted.url + "/v1/completions", json=body) as response:
                first = await response.content.readline()
                async with session.get(restricted.url + "/stats") as stats:
                    (replica,) = (await stats.json())["replicas"]
                rest = (await response.read()).decode()
        return response.status, first, replica, rest

    status, first, replica, rest = asyncio.run(main())
    assert status == 200 and first.startswith(b"data: {")
    assert (replica["num_running"], replica["num_waiting"]) == (2, 2)
    choices = [json.loads(line[6:])["choices"] for line in rest.splitlines() if line.startswith("data: {")]
    assert {c["index"] for chunk in choices for c in chunk} == {0, 1, 2, 3} and rest.rstrip().endswith("[DONE]")
    _assert_idle_soon(restricted)


def _assert_idle_soon(app, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        (stats,) = app.stats()
        idle = stats["num_running"] == stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.1)


def _raw_http(url: str, payload: bytes, read_timeout: float) -> tuple[bytes, float]:
    """Send ``payload`` on a fresh connection to ``url`` (``http://host:port``) and read one
    answer, until the server closes or ``read_timeout`` passes; it and the seconds it took."""
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(payload)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        except TimeoutError:
            pass
    return b"".join(chunks), time.perf_counter() - start


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def test_a_stalled_body_gets_408_in_the_envelope(restricted):
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    answer, seconds = _raw_http(restricted.url, request, read_timeout=30)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert json.loads(body)["error"] == {
        "message": "the request body stopped arriving: nothing for 2 s (request_body_timeout_s)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}
    assert 2 <= seconds < 15


def test_a_malformed_chunked_body_gets_the_http_servers_own_400(restricted):
    # The HTTP front (HAProxy, which make run's wrapper turns on) rejects a broken chunk before
    # the application sees it: the one error that cannot carry OpenAI's envelope
    # (docs/DEPLOYMENT.md, "What to put in front"; behind Serve's Python proxy it is uvicorn's
    # plain-text "Invalid HTTP request received.").
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"zz\r\n{}\r\n0\r\n\r\n")
    answer, _ = _raw_http(restricted.url, request, read_timeout=30)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad request\r\n") and b"Content-Type: text/html" in head, answer
    assert body == b"<html><body><h1>400 Bad request</h1>\nYour browser sent an invalid request.\n</body></html>\n"


@pytest.mark.slow
def test_health_answers_503_at_once_while_no_engine_replica_runs(restricted):
    """Kills the engine replica: keep this test last in the module."""
    (replica,) = restricted.engine_replicas()
    replica.kill()
    killed_at = time.monotonic()
    probes = []  # (seconds since the kill, status, seconds the probe took)
    while time.monotonic() - killed_at < 120:
        start = time.monotonic()
        status = requests.get(restricted.url + "/health", timeout=30).status_code
        probes.append((start - killed_at, status, time.monotonic() - start))
        if status == 200 and any(s == 503 for _, s, _ in probes):
            break
        time.sleep(0.05)
    statuses = [status for _, status, _ in probes]
    assert 503 in statuses and statuses[-1] == 200, probes
    first_503 = statuses.index(503)
    print(f"first 503 {probes[first_503][0]:.2f} s after the kill; 200 again after {probes[-1][0]:.1f} s; "
          f"slowest probe {max(took for _, _, took in probes):.3f} s")
    assert probes[first_503][0] < 2.0, probes[: first_503 + 1]  # within 2 s of the kill
    assert max(took for _, _, took in probes) < 1.0, probes  # each answer at once
    assert set(statuses[first_503:-1]) == {503}  # 503 until a replica runs again, then 200
    response = requests.post(restricted.url + "/v1/completions", json=BODY, headers=AUTH, timeout=60)
    assert response.status_code == 200
