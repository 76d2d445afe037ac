"""bench/structured_outputs.py: both systems run end to end on a tiny workload, every
constrained step is masked, and the masks-only timing reports every batch size."""
import json
import subprocess
import sys

import pytest

from tests.serve_process import ROOT


@pytest.mark.slow
@pytest.mark.e2e
def test_structured_outputs_benchmark_runs(tmp_path):
    requests = [{"id": f"r{i}", "prompt_token_ids": list(range(100 + i, 120 + i)), "max_tokens": 6} for i in range(3)]
    workload = tmp_path / "tiny.json"
    workload.write_text(json.dumps({"name": "tiny", "requests": requests}))
    out_path = tmp_path / "structured.json"
    command = [sys.executable, "bench/structured_outputs.py", "--workload", str(workload), "--rounds", "1",
               "--dtype", "float32", "--out", str(out_path)]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_path.read_text())
    runs = {r["system"]: r for r in result["runs"]}
    assert set(runs) == {"unconstrained", "json"}
    for run in runs.values():
        assert run["num_output_tokens"] == 18 and run["num_steps"] >= 6
    # Counts, not times (a timed comparison can fail on a loaded machine): every sampling step
    # of the constrained run applies bitmasks (6 tokens each: at least 6 such steps), none of
    # the unconstrained run does.
    assert runs["json"]["num_masked_steps"] >= 6 and runs["unconstrained"]["num_masked_steps"] == 0
    assert runs["json"]["mask_fill_ms_per_step"] > 0 and runs["json"]["mask_apply_ms_per_step"] > 0
    assert runs["unconstrained"]["mask_apply_ms_per_step"] == 0
    out_path = tmp_path / "masks.json"
    command = [sys.executable, "bench/structured_outputs.py", "--workload", str(workload), "--masks-only", "1", "3",
               "--out", str(out_path)]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["batch_size"] for r in json.loads(out_path.read_text())["masks_only"]] == [1, 3]
