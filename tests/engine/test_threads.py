"""engine.threads: intra-op threads from the CPUs given, OpenMP's wait policy, huge pages."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import threads

ROOT = Path(__file__).resolve().parents[2]


def test_cpus_given_follows_omp_num_threads_then_the_affinity_mask(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.cpus_given() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.cpus_given() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})  # taskset -c 5
    assert threads.cpus_given() == 1


def test_cpus_given_in_a_ray_actor_is_its_num_cpus_floored(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_ray_assigned_cpus", lambda: 2.5)
    assert threads.cpus_given() == 2
    monkeypatch.setattr(threads, "_ray_assigned_cpus", lambda: 0.5)
    assert threads.cpus_given() == 1


def test_the_wait_is_a_short_spin_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert threads.set_wait_policy_env() is False  # torch is imported here: too late for it
    assert os.environ["GOMP_SPINCOUNT"] == "1000"
    assert "OMP_WAIT_POLICY" not in os.environ
    assert threads.wait_policy_env() == {"GOMP_SPINCOUNT": "1000"}
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    threads.set_wait_policy_env()
    assert "GOMP_SPINCOUNT" not in os.environ
    assert threads.wait_policy_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    threads.set_wait_policy_env()
    assert os.environ["GOMP_SPINCOUNT"] == "50" and "OMP_WAIT_POLICY" not in os.environ
    assert threads.wait_policy_env() == {"GOMP_SPINCOUNT": "50"}


def test_huge_pages_are_on_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert threads.huge_pages_env() == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert threads.set_huge_pages_env() is False  # torch is imported here: too late for it
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    threads.set_huge_pages_env()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    assert threads.huge_pages_env() == {"THP_MEM_ALLOC_ENABLE": "0"}


@pytest.mark.parametrize("setting,huge", [(None, True), ("0", False)])
def test_importing_engine_puts_large_cpu_buffers_on_huge_pages(setting, huge):
    # With THP_MEM_ALLOC_ENABLE=1 as it loads, torch's allocator page-aligns a buffer of >= 2 MiB
    # and advises huge pages for it; otherwise it aligns to 64 bytes past malloc's header. In the
    # kernel's "madvise" mode only advised memory gets huge pages (AnonHugePages).
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    code = ("import engine, torch; x = torch.ones(64 << 20, dtype=torch.uint8); "
            "print(x.data_ptr() % 4096 == 0); "
            "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHuge')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    page_aligned, huge_kib = out.stdout.split()
    assert page_aligned == str(huge)
    if threads.kernel_thp_mode() == "madvise":
        assert (int(huge_kib) >= 32 * 1024) is huge  # most of the 64 MiB


def _fresh_python(code: str, **user_env: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter with ``user_env`` as its only OpenMP wait settings."""
    env = {k: v for k, v in os.environ.items() if k not in threads.USER_WAIT_SETTINGS}
    env.update(user_env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True)


def test_importing_engine_sets_the_policy_before_torch_loads():
    out = _fresh_python("import sys, os, engine; assert 'torch' not in sys.modules; import torch; "
                        "from engine.threads import wait_policy_applied; "
                        "print(os.environ['GOMP_SPINCOUNT'], wait_policy_applied())")
    assert out.stdout.strip() == "1000 True"


def test_torch_imported_first_is_reported_as_libgomps_default():
    code = ("import logging, torch, engine; from engine import threads; logging.basicConfig(level='INFO'); "
            "print(threads.wait_policy_applied()); threads.configure_cpu_threads()")
    users_own = _fresh_python(code, GOMP_SPINCOUNT="5000")  # libgomp read it at start-up
    assert users_own.stdout.strip() == "True"
    assert "OpenMP wait: GOMP_SPINCOUNT=5000," in users_own.stderr
    out = _fresh_python(code)
    assert out.stdout.strip() == "False"
    assert "OpenMP wait: libgomp's default (torch was imported before the engine set its wait policy)," \
        in out.stderr


def test_a_cpu_engine_sets_torch_threads_to_the_cpus_given(monkeypatch):
    from engine import LLM

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        torch.set_num_threads(2)
        llm = LLM("dummy:tiny-llama", device="cpu", kv_cache_memory_gb=0.01)
        assert llm.llm_engine.model_runner.num_threads == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
