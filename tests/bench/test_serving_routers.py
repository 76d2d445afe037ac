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
