"""The engine deployment's class outside Serve: what it streams to the ingress."""
from __future__ import annotations

import asyncio
import threading

import pytest

from app.config import AppConfig
from app.engine_server import EngineServer
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.conftest import hold_the_second_step

PROMPT = {"prompt": "Write a haiku about the sea."}


@pytest.fixture(scope="module")
def server():
    server = EngineServer(AppConfig.load({"dtype": "float32", "kv_cache_memory_gb": 0.25}))
    yield server
    server.llm.shutdown()


def _records(server, stream: bool, release: threading.Event | None = None, **kwargs) -> list[dict]:
    """The request's records; ``release`` (``hold_the_second_step``'s) is set once the first has come."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, **kwargs)

    async def main():
        records = []
        async for record in server.generate(PROMPT, params, echo=True, stream=stream):
            records.append(record)
            if release is not None:
                release.set()
        return records

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


def test_a_request_that_announces_its_acceptance_does_so_first_and_only_when_accepted(server):
    # a streamed completions batch: each prompt's stream starts once it is accepted
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main(prompt):
        return [record async for record in server.generate(prompt, params, echo=True, stream=True,
                                                            announce_added=True)]

    added, *outputs = asyncio.run(main(PROMPT))
    assert added == {"added": True, "replica_id": server.replica_id}
    assert outputs[0]["prompt_text"] == PROMPT["prompt"]  # the first output still carries the echo
    assert sum(len(r["outputs"][0]["token_ids"]) for r in outputs) == 4 and outputs[-1]["finished"]
    (refused,) = asyncio.run(main({"prompt_token_ids": [1, 10**6]}))  # never accepted: only its 400
    assert (refused["status_code"], refused["param"]) == (400, "prompt[1]")
    assert server.llm.stats()["num_running"] == 0


def test_stream_batching_merges_what_comes_within_the_window(server, monkeypatch):
    """``stream_batching_interval_ms`` (Ray Serve LLM's name): the first output at once, later
    ones merged until the window since the last record is over, or the request finishes. With
    a 60 s window, 16 tokens are two records: the first token, then the other 15."""
    streamed = _records(server, stream=True, logprobs=1)
    monkeypatch.setattr(server.config, "stream_batching_interval_ms", 60_000)
    first, rest = _records(server, stream=True, release=hold_the_second_step(monkeypatch, server.llm), logprobs=1)
    assert len(first["outputs"][0]["token_ids"]) == 1 and not first["finished"]
    assert len(rest["outputs"][0]["token_ids"]) == 15 and rest["finished"]
    for field in ("token_ids", "logprobs"):
        assert first["outputs"][0][field] + rest["outputs"][0][field] == [
            e for r in streamed for e in r["outputs"][0][field]]
    assert first["outputs"][0]["text"] + rest["outputs"][0]["text"] == "".join(
        r["outputs"][0]["text"] for r in streamed)
    assert rest["outputs"][0]["finish_reason"] == "length" and first["prompt_text"] == PROMPT["prompt"]
    assert server.llm.stats()["num_running"] == 0


def test_a_consumer_that_leaves_a_batched_stream_aborts_its_request(server, monkeypatch):
    """Closing the stream while the window holds outputs and the next is awaited: the request is
    aborted in the engine (its blocks freed), nothing is left waiting."""
    monkeypatch.setattr(server.config, "stream_batching_interval_ms", 60_000)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    release = hold_the_second_step(monkeypatch, server.llm)

    async def main():
        stream = server.generate(PROMPT, params, stream=True)
        first = await anext(stream)
        release.set()
        waiting = asyncio.ensure_future(anext(stream))  # held by the window
        await asyncio.sleep(0.5)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await stream.aclose()
        for _ in range(100):  # the abort lands within a step
            if server.llm.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.05)
        return first

    first = asyncio.run(main())
    assert len(first["outputs"][0]["token_ids"]) == 1
    stats = server.llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _values(record: dict) -> int:
    """A record's token ids and logprob entries (``RequestOutput.num_values``)."""
    return sum(len(c["token_ids"]) + sum(map(len, c["logprobs"] or ())) for c in record["outputs"])


@pytest.mark.parametrize("stream_batching_interval_ms", [None, 60_000])
def test_a_large_result_goes_in_records_of_at_most_max_joined_values(server, monkeypatch,
                                                                     stream_batching_interval_ms):
    """A non-streamed result (or a batching window) past ``MAX_JOINED_VALUES`` token ids and
    logprob entries is sent as several records, each within the bound, which join to the
    streamed result: one record of n=16 x 600 tokens x 21 logprobs (5.9 MB) was past gRPC's
    4 MiB message limit and failed the request with a 500 after all its work. Here the bound
    is 20 values, and 16 tokens with their top 2 logprobs each (the sampled token's among
    them) are 48: 6 tokens a record."""
    streamed = _records(server, stream=True, logprobs=2)
    monkeypatch.setattr("engine.outputs.MAX_JOINED_VALUES", 20)
    if stream_batching_interval_ms is None:
        records = _records(server, stream=False, logprobs=2)
    else:
        monkeypatch.setattr(server.config, "stream_batching_interval_ms", stream_batching_interval_ms)
        records = _records(server, stream=True, release=hold_the_second_step(monkeypatch, server.llm), logprobs=2)
    assert sum(map(_values, streamed)) == 48
    assert [_values(r) <= 20 for r in records] == [True] * len(records)
    assert [len(r["outputs"][0]["token_ids"]) for r in records] == (
        [6, 6, 4] if stream_batching_interval_ms is None else [1, 6, 6, 3])  # the window's first token at once
    for field in ("token_ids", "logprobs"):
        assert [e for r in records for e in r["outputs"][0][field]] == [
            e for r in streamed for e in r["outputs"][0][field]]
    assert "".join(r["outputs"][0]["text"] for r in records) == "".join(r["outputs"][0]["text"] for r in streamed)
    assert [r["finished"] for r in records] == [False] * (len(records) - 1) + [True]
    assert ["prompt_text" in r for r in records] == [True] + [False] * (len(records) - 1)
    assert server.llm.stats()["num_running"] == 0
