"""The engine deployment's class outside Serve: what it streams to the ingress."""
from __future__ import annotations

import asyncio

import pytest

from app.config import AppConfig
from app.engine_server import EngineServer
from engine.sampling_params import RequestOutputKind, SamplingParams

PROMPT = {"prompt": "Write a haiku about the sea."}


@pytest.fixture(scope="module")
def server():
    server = EngineServer(AppConfig.load({"dtype": "float32", "kv_cache_memory_gb": 0.25}))
    yield server
    server.llm.shutdown()


def _records(server, stream: bool, **kwargs) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, **kwargs)

    async def main():
        return [record async for record in server.generate(PROMPT, params, echo=True, stream=stream)]

    return asyncio.run(main())


def test_a_non_streaming_request_is_one_record_with_the_streamed_result(server):
    streamed = _records(server, stream=True, logprobs=2)
    (whole,) = _records(server, stream=False, logprobs=2)
    assert len(streamed) > 1
    choice = whole["outputs"][0]
    assert choice["token_ids"] == [t for r in streamed for t in r["outputs"][0]["token_ids"]]
    assert choice["text"] == "".join(r["outputs"][0]["text"] for r in streamed)
    assert choice["logprobs"] == [e for r in streamed for e in r["outputs"][0]["logprobs"]]
    assert len(choice["token_ids"]) == len(choice["logprobs"]) == 16
    assert choice["finish_reason"] == streamed[-1]["outputs"][0]["finish_reason"] == "length"
    assert whole["finished"] and whole["prompt_text"] == streamed[0]["prompt_text"] == PROMPT["prompt"]
    assert server.llm.stats()["num_running"] == 0
