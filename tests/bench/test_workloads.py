"""``bench/workloads.py`` regenerates the fixed workloads request for request."""
import hashlib
import json
import subprocess
import sys

import pytest

from bench import workloads
from tests.serve_process import ROOT

SHARED = ROOT.parent / "shared" / "workloads"
# sha256 of json.dumps(requests) of the shared files (checked where they are present).
DIGESTS = {"w1_mixed": "d301680208026910", "w2_short": "eaed79f08d219cd2",
           "w3_shared_prefix": "fbfc6bb804f0fc83"}


@pytest.mark.parametrize("name", workloads.NAMES)
def test_digest_of_the_shared_requests(name):
    requests = json.dumps(workloads.make_workload(name)["requests"])
    assert hashlib.sha256(requests.encode()).hexdigest()[:16] == DIGESTS[name]


@pytest.mark.parametrize("name", workloads.NAMES)
def test_equals_the_shared_file(name):
    path = SHARED / f"{name}.json"
    if not path.exists():
        pytest.skip(f"no {path} next to this checkout")
    assert workloads.make_workload(name) == json.loads(path.read_text())


def test_w1_mixed_shape():
    """Holds where ../shared is absent too: the numbers ../shared/workloads/README gives."""
    w1 = workloads.make_workload("w1_mixed")
    requests = w1["requests"]
    assert len(requests) == 64 and requests[0]["id"] == "w1_mixed-0"
    assert sum(len(r["prompt_token_ids"]) for r in requests) == 19418
    assert sum(r["max_tokens"] for r in requests) == 8128
    assert all(16 <= len(r["prompt_token_ids"]) <= 512 and 16 <= r["max_tokens"] <= 256 for r in requests)


def test_cli_writes_the_file(tmp_path):
    out = tmp_path / "w2.json"
    subprocess.run([sys.executable, "bench/workloads.py", "w2_short", "--out", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=60)
    assert json.loads(out.read_text()) == workloads.make_workload("w2_short")


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown workload 'w9'"):
        workloads.make_workload("w9")
