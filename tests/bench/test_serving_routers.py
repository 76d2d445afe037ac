"""``bench/serving.py --replicas N --router a,b``: its ratios are the first router's medians
over each other router's, per request rate (the runs themselves need a served app: the
numbers are in docs/PERFORMANCE.md, "Routing across two engine replicas")."""
import sys

import pytest

from tests.serve_process import ROOT


@pytest.fixture(scope="module")
def serving():
    sys.path.insert(0, str(ROOT / "bench"))  # bench scripts import their `common` module
    try:
        import serving
        yield serving
    finally:
        sys.path.remove(str(ROOT / "bench"))


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
    """A repeat's requests carry its cache_salt, so that it finds no earlier repeat's prefixes."""
    import asyncio

    seen = []

    class FakeLLM:
        async def generate(self, prompt, params):
            seen.append(params.cache_salt)
            yield type("Output", (), {"outputs": [type("Completion", (), {"token_ids": [1, 2]})()]})()

    record = serving.Record(0.0)
    asyncio.run(serving._direct_request(FakeLLM(), {"prompt_token_ids": [1], "max_tokens": 2}, record, "repeat-1"))
    assert seen == ["repeat-1"] and record.num_tokens == 2 and len(record.token_times) == 1
