"""The CPU KV cache's memory: zeroed without being written at start (``lazily_zeroed_cpu``),
on huge pages where asked for, and refused at start when it cannot fit."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engine import LLM, threads

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process: RSS before and after a 256 MiB lazily zeroed cache, after writing 64 MiB
# of it, whether it reads zero elsewhere, its huge pages (AnonHugePages), and after populate().
PROBE = """
import json, psutil, torch
from engine.model_runner import lazily_zeroed_cpu, populate, HUGE_PAGE_BYTES
rss = lambda: psutil.Process().memory_info().rss
def huge_kib():
    return next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHuge'))
before, huge_before = rss(), huge_kib()
cache = lazily_zeroed_cpu((2, 1024, 64, 1024), torch.bfloat16)  # 256 MiB
allocated = rss()
cache[0, :512].fill_(1.5)  # 64 MiB written
print(json.dumps({"allocated_mib": (allocated - before) / 2**20, "written_mib": (rss() - before) / 2**20,
                  "shape": list(cache.shape), "dtype": str(cache.dtype), "contiguous": cache.is_contiguous(),
                  "huge_aligned": cache.data_ptr() % HUGE_PAGE_BYTES == 0,
                  "sum_written": float(cache[0, :512].double().sum()), "nonzero_elsewhere":
                  int(cache[0, 512:].count_nonzero() + cache[1].count_nonzero()),
                  "huge_mib": (huge_kib() - huge_before) / 1024,
                  "populated": populate(cache), "populated_mib": (rss() - before) / 2**20,
                  "sum_after_populate": float(cache.double().sum())}))
"""


@pytest.mark.parametrize("setting,huge", [(None, True), ("0", False)])
def test_the_cpu_kv_cache_reads_zero_and_commits_only_what_is_written(setting, huge):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["shape"] == [2, 1024, 64, 1024] and probe["dtype"] == "torch.bfloat16"
    assert probe["contiguous"] and probe["huge_aligned"]
    assert probe["allocated_mib"] < 8  # torch.zeros would have written all 256 MiB here
    assert 64 <= probe["written_mib"] < 64 + 16
    assert probe["sum_written"] == 1.5 * 512 * 64 * 1024 and probe["nonzero_elsewhere"] == 0
    if threads.kernel_thp_mode() == "madvise":
        assert (probe["huge_mib"] >= 32) is huge  # most of the 64 MiB written
    # populate() backs the rest (MADV_POPULATE_WRITE, Linux >= 5.14) and changes no value
    assert probe["sum_after_populate"] == probe["sum_written"]
    if probe["populated"]:
        assert 256 <= probe["populated_mib"] < 256 + 16
    else:  # only a kernel before 5.14 lacks MADV_POPULATE_WRITE
        release = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
        assert release < (5, 14), os.uname().release


def test_a_cache_larger_than_the_available_memory_is_refused_at_start():
    too_big = 2 * psutil.virtual_memory().total / 2**30
    with pytest.raises(ValueError, match=r"^kv_cache_memory_gb: the KV cache's [0-9.]+ GiB are more "
                                         r"than this machine's available memory \([0-9.]+ GiB\); "
                                         r"lower kv_cache_memory_gb$"):
        LLM(model="dummy:tiny-llama", dtype="float32", kv_cache_memory_gb=too_big, enforce_eager=True)
    with pytest.raises(ValueError, match=r"^num_gpu_blocks: the KV cache's .* lower num_gpu_blocks$"):
        LLM(model="dummy:tiny-llama", dtype="float32", num_gpu_blocks=10**9, enforce_eager=True)
