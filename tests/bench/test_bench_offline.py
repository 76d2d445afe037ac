"""bench/offline.py --quick: the comparison runs end to end and reports every field."""
import json
import random
import subprocess
import sys

import pytest

from tests.serve_process import ROOT

SHARED_WORKLOAD = ROOT.parent / "shared" / "workloads" / "w1_mixed.json"


def _workload(tmp_path):
    """The project's w1_mixed where the shared folder sits next to the checkout; else a
    workload file of the same schema (a clone elsewhere has no ../shared)."""
    if SHARED_WORKLOAD.exists():
        return SHARED_WORKLOAD
    rng = random.Random(0)
    requests = [{"id": f"r{i}", "prompt_token_ids": [rng.randrange(100, 49000) for _ in range(rng.randint(16, 96))],
                 "max_tokens": rng.randint(8, 32)} for i in range(10)]
    path = tmp_path / "w1_mixed.json"
    path.write_text(json.dumps({"name": "w1_mixed", "requests": requests}))
    return path


@pytest.mark.slow
@pytest.mark.e2e
def test_offline_benchmark_quick(tmp_path):
    out_path = tmp_path / "offline.json"
    workload = _workload(tmp_path)
    command = [sys.executable, "bench/offline.py", "--workload", str(workload), "--quick",
               "--dtype", "float32", "--batch-sizes", "4", "--out", str(out_path)]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_path.read_text())
    systems = {s["system"]: s for s in result["systems"]}
    assert set(systems) == {"mini-infer", "mini-infer-no-prefix-caching", "hf-static-4", "hf-continuous"}
    for name in ("mini-infer", "mini-infer-no-prefix-caching", "hf-static-4"):
        s = systems[name]
        assert s["output_tokens"] == sum(min(16, n) for n in _max_tokens(workload)[:8])
        assert s["output_tokens_per_s"] > 0 and 0 < s["roofline_fraction"] < 1
        assert {"p50", "p90", "p99", "mean"} <= set(s["ttft_s"]) and s["peak_memory_gib"] > 0
    assert result["ratio_vs_best_static"] > 0 and result["matmul_flops_per_s"] > 1e9
    assert result["prefix_caching_throughput_ratio"] > 0 and result["prefix_caching_ttft_p50_ratio"] > 0
    assert systems["mini-infer-no-prefix-caching"]["prefix_cache_queries"] == 0
    num_prompt_tokens = sum(len(r["prompt_token_ids"][:64]) for r in _requests(workload))
    assert systems["mini-infer"]["prefix_cache_queries"] == num_prompt_tokens  # every prompt looked up once
    assert out_path.with_suffix(".png").stat().st_size > 10_000
    assert "mini-infer / hf-static-4" in out.stdout and "prefix caching on / off" in out.stdout


def _requests(workload):
    return json.loads(workload.read_text())["requests"][:8]


def _max_tokens(workload):
    return [r["max_tokens"] for r in _requests(workload)]
