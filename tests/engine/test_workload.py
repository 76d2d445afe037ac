"""``engine.workload.read_workload``: the shared workloads, and one clear error per kind of bad file."""
import json

import pytest

from bench import workloads
from engine.workload import WorkloadError, read_workload


def test_a_shared_workload_is_read_whole(tmp_path):
    # bench/workloads.py makes the shared files request for request (tests/bench/test_workloads.py);
    # a clone need not sit beside ../shared
    path = tmp_path / "w3_shared_prefix.json"
    path.write_text(json.dumps(workloads.make_workload("w3_shared_prefix")))
    workload = read_workload(path)
    assert workload["name"] == "w3_shared_prefix" and len(workload["requests"]) == 96


@pytest.mark.parametrize("content, message", [
    ("{", "is not JSON (Expecting property name enclosed in double quotes at line 1)"),
    ([1], "a workload is an object with a non-empty 'requests' list"),
    ({"requests": []}, "a workload is an object with a non-empty 'requests' list"),
    ({"requests": [{"prompt_token_ids": [1, "2"], "max_tokens": 1}]},
     "requests[0] needs 'prompt_token_ids', a non-empty list of token ids"),
    ({"requests": [{"prompt_token_ids": [1], "max_tokens": 1}, {"prompt_token_ids": [1], "max_tokens": 0}]},
     "requests[1] needs 'max_tokens', an integer >= 1"),
])
def test_a_bad_file_is_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "w.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(WorkloadError) as info:
        read_workload(path)
    assert str(info.value).startswith(str(path)) and str(info.value).endswith(message)
    with pytest.raises(WorkloadError, match="^no such file: "):
        read_workload(tmp_path / "none.json")
