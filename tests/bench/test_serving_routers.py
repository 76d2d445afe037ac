"""``bench/serving.py --replicas N --router a,b``: its ratios are the first router's medians
over each other router's, per request rate (the runs themselves need a served app: the
numbers are in docs/PERFORMANCE.md, "Routing across two engine replicas")."""

import pytest

from tests.bench import load_bench_module


@pytest.fixture(scope="module")
def serving():
    return load_bench_module("serving")


def _run(tok_s, ttft_p50, hit_rate):
    return {"inf": {"output_tokens_per_s": tok_s, "ttft_s": {"p50": ttft_p50},
                    "prefix_cache_hit_rate": hit_rate}}


def test_router_ratios_are_medians_of_the_first_over_each_other(serving):
    runs = {"prefix": [_run(120, 2.0, 0.6), _run(100, 4.0, 0.6), _run(150, 3.0, 0.9)],
            "pow2": [_run(80, 6.0, 0.3), _run(100, 6.0, 0.3), _run(60, 5.0, 0.2)]}
    assert serving.router_ratios(runs) == {"prefix/pow2 @ inf": {
        "output_tokens_per_s": 1.5, "ttft_p50": 0.5, "prefix_cache_hit_rate": 2.0}}
    # A router with a hit rate of 0 has no ratio for it (not a division by zero).
    runs["pow2"] = [_run(100, 6.0, 0.0)]
    assert "prefix_cache_hit_rate" not in serving.router_ratios(runs)["prefix/pow2 @ inf"]


def _summary(tok_s, ttft_p50, completed=32):
    return {"output_tokens_per_s": tok_s, "ttft_s": {"p50": ttft_p50}, "completed": completed}


def test_http_over_direct_is_the_median_of_each_repeats_pair(serving):
    repeats = [{"http": {"inf": _summary(80, 3.0)}, "direct": {"inf": _summary(100, 2.0)}},
               {"http": {"inf": _summary(90, 2.0)}, "direct": {"inf": _summary(100, 2.0)}},
               {"http": {"inf": _summary(60, 4.0)}, "direct": {"inf": _summary(50, 2.0)}}]
    assert serving.http_over_direct(repeats) == {"inf": {
        "output_tokens_per_s": 0.9, "ttft_p50": 1.5, "output_tokens_per_s_each": [0.8, 0.9, 1.2]}}
    # A repeat whose direct run completed nothing (or was skipped) has no ratio.
    repeats[2]["direct"]["inf"]["completed"] = 0
    assert serving.http_over_direct(repeats)["inf"]["output_tokens_per_s_each"] == [0.8, 0.9]
    assert serving.http_over_direct([{"http": {"inf": _summary(80, 3.0)}, "direct": {}}]) == {}


def test_each_repeat_salts_its_direct_requests(serving):
    """A repeat's requests carry its cache_salt, so that it finds no earlier repeat's prefixes;
    each rate's run adds its own."""
    import asyncio

    seen = []

    class FakeLLM:
        async def generate(self, prompt, params):
            seen.append(params.cache_salt)
            yield type("Output", (), {"outputs": [type("Completion", (), {"token_ids": [1, 2]})()]})()

    record = serving.Record(0.0)
    asyncio.run(serving._direct_request(FakeLLM(), {"prompt_token_ids": [1], "max_tokens": 2}, record, "repeat-1"))
    assert seen == ["repeat-1"] and record.num_tokens == 2 and len(record.token_times) == 1
    # every rate's run its own salt: the same requests go out at each rate, and a later rate
    # found an earlier one's prompts cached (without a salt: all of them)
    seen.clear()
    requests = [{"prompt_token_ids": [1], "max_tokens": 2}] * 2
    rates = [1000.0, float("inf")]
    results = asyncio.run(serving.bench_direct(FakeLLM(), requests, rates, 0, (5.0, 0.5), "ab-repeat-0"))
    assert seen == ["ab-repeat-0-rate-1000.0"] * 2 + ["ab-repeat-0-rate-inf"] * 2
    assert [r["completed"] for r in results.values()] == [2, 2]
    assert serving.rate_salt(None, 0.5) == "rate-0.5"


@pytest.fixture
def sse_server():
    """A stand-in for the service on 127.0.0.1: ``/v1/completions`` streams ``max_tokens``
    chunks of one token each, 10 ms apart, then the usage chunk and ``[DONE]``."""
    import asyncio
    import json
    import threading

    from aiohttp import web

    async def completions(request):
        body = await request.json()
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "x-mini-infer-replica": "r0"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_an_idle_client_runs_the_http_runs_at_sched_idle(serving, sse_server):
    """``--client-sched idle``: the HTTP runs go through a process of their own at SCHED_IDLE
    and measure what this process's client measures; ``normal`` keeps them here."""
    import os

    requests = [{"prompt_token_ids": [1, 2], "max_tokens": 5}, {"prompt_token_ids": [3], "max_tokens": 3}]
    args = (sse_server, "m", requests, [float("inf")], 0, (5.0, 0.5))
    assert serving.http_client("normal") is None
    here = serving.http_run(None, *args)["inf"]
    client = serving.http_client("idle")
    try:
        assert client.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
        assert client.submit(os.getpid).result() != os.getpid()
        there = serving.http_run(client, *args)["inf"]
    finally:
        client.shutdown()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this process is left as it was
    for summary in (here, there):
        assert (summary["completed"], summary["failed"], summary["replica_shares"]) == (2, 0, [1.0])
        assert summary["output_tokens_per_s"] * summary["seconds"] == pytest.approx(8, abs=0.2)  # 5 + 3 tokens
        assert summary["itl_s"]["p50"] >= 0.01  # one arrival time per chunk


def test_request_rates_and_the_exit_status_on_failures(serving, capsys):
    import argparse

    rates = serving.positive_list(float, "numbers")  # --request-rates
    assert rates("0.5,1,inf") == [0.5, 1.0, float("inf")]
    for bad in ("abc", "1,,2", "0", "-1,inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            rates(bad)
    # a trial: every request failed (no service) and the run exited 0
    assert serving._report_failures([{"completed": 4, "failed": 0}]) == 0
    assert serving._report_failures([{"completed": 0, "failed": 4}, {"completed": 3, "failed": 1}]) == 1
    assert "5 requests failed (of 8)" in capsys.readouterr().err
