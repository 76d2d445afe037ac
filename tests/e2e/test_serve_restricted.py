"""The Serve configs validate; an app with an API key and small overload limits, over real
HTTP on 127.0.0.1, bounded in count and time."""
import asyncio

import aiohttp
import pytest
import requests
import yaml

from app import build_app
from tests.serve_process import ROOT, ServeProcess

MODEL = "smollm2-135m-instruct"
SERVE = str(ROOT / ".venv" / "bin" / "serve")
KEY = "test-key-123"


@pytest.mark.parametrize("name", ["serve_cpu.yaml", "serve_gpu.yaml", "serve_multi_replica.yaml"])
def test_serve_configs_are_valid_and_build(name):
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "ray_configs" / name).read_text()))
    (application,) = config.applications
    assert application.import_path == "app:build_app"
    build_app(application.args)  # every arg is a known, valid setting


@pytest.fixture(scope="module")
def restricted():
    command = [SERVE, "run", "app:build_app", "max_num_seqs=2", "max_waiting_requests=1",
               "kv_cache_memory_gb=0.25", f"api_key={KEY}", "dtype=float32"]
    with ServeProcess(command) as app:
        yield app


def test_api_key_is_required_when_configured(restricted):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = requests.post(restricted.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json() == {"error": {
            "message": "a valid API key is required: send 'Authorization: Bearer <key>'",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    ok = requests.post(restricted.url + "/v1/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert requests.get(restricted.url + "/health", timeout=10).status_code == 200  # not behind the key


def test_a_burst_over_the_limit_gets_only_200_and_503(restricted):
    async def one(session, i):
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 24, "ignore_eos": True,
                "stream": i % 2 == 0}
        async with session.post(restricted.url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {KEY}"}) as response:
            text = await response.text()
            return response.status, response.headers.get("Retry-After"), text

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(16)))

    results = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 3 and statuses.count(503) >= 1, statuses
    for status, retry_after, text in results:
        if status == 503:
            assert retry_after == "1" and '"code":"overloaded"' in text.replace(" ", "")
