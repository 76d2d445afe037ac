"""engine.threads: intra-op threads from the CPUs given, OpenMP's wait policy, huge pages."""
from __future__ import annotations

import os
import subprocess
import sys
import time
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


def test_the_wait_is_a_30000_iteration_spin_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)  # tests/conftest.py sets it
    assert threads.set_wait_policy_env() is False  # torch is imported here: too late for it
    assert os.environ["GOMP_SPINCOUNT"] == "30000"
    assert "OMP_WAIT_POLICY" not in os.environ
    assert threads.wait_policy_env() == {"GOMP_SPINCOUNT": "30000"}
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
    assert out.stdout.strip() == "30000 True"


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


def test_every_cpu_step_fits_the_threads_first(monkeypatch):
    from engine import LLM, SamplingParams

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)
    try:
        llm = LLM("dummy:tiny-llama", device="cpu", kv_cache_memory_gb=0.01)
        runner = llm.llm_engine.model_runner
        assert runner.free_cpu_threads.max_threads == 2
        assert runner.free_cpu_threads.enabled  # /proc/stat, two threads
        assert llm.llm_engine.stats()["num_cpu_threads"] == runner.free_cpu_threads.threads == 2
        runner.free_cpu_threads.threads = 1  # as after a busy neighbour (the count is read, not kept)
        assert llm.llm_engine.stats()["num_cpu_threads"] == 1
        calls = []
        monkeypatch.setattr(runner.free_cpu_threads, "update", lambda: calls.append(1))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        assert len(calls) == 4  # the prompt's step, then three decode steps
    finally:
        torch.set_num_threads(before)


# ---- FreeCpuThreads: fewer threads while other processes use the CPUs ----------------------

def test_busy_cpu_seconds_sum_the_masks_cpu_lines_without_idle_and_iowait(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # cpuN user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(f"cpu  {9 * ticks} 0 0 0 0 0 0 0 0 0\n"
                    f"cpu0 {ticks} {ticks} {ticks} {50 * ticks} {7 * ticks} {ticks} {ticks} {ticks} 0 0\n"
                    f"cpu1 {2 * ticks} 0 0 {40 * ticks} 0 0 0 0 0 0\n"
                    f"cpu2 {100 * ticks} 0 0 0 0 0 0 0 0 0\nintr 12345 0\nctxt 999\n")
    assert threads.read_busy_cpu_seconds(frozenset({0, 1}), str(stat)) == 8.0
    assert threads.read_busy_cpu_seconds(frozenset({1}), str(stat)) == 2.0
    assert threads.read_busy_cpu_seconds(frozenset({0, 3}), str(stat)) is None  # no cpu3 line
    assert threads.read_busy_cpu_seconds(frozenset({0}), str(tmp_path / "missing")) is None


class _Host:
    """A 2-CPU host whose clock, busy time and this process's CPU time a test moves."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0
        self.set_calls: list[int] = []

    def run(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy += (own_cpus + other_cpus) * seconds

    def threads(self, max_threads: int = 2, **kwargs) -> threads.FreeCpuThreads:
        return threads.FreeCpuThreads(max_threads, 0.5, cpus=frozenset({0, 1}),
                                      busy_seconds=lambda cpus: self.busy, process_time=lambda: self.own,
                                      clock=lambda: self.now, set_threads=self.set_calls.append, **kwargs)


def test_a_busy_neighbour_takes_a_thread_away_until_it_stops(monkeypatch):
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)
    host = _Host()
    fit = host.threads()
    assert fit.enabled and fit.threads == 2
    host.run(0.4, own_cpus=2.0, other_cpus=0.0)
    assert fit.update() == 2 and host.set_calls == []  # within the interval: not read
    host.run(0.2, own_cpus=2.0, other_cpus=0.0)
    assert fit.update() == 2 and fit.others == 0.0  # quiet
    host.run(0.5, own_cpus=1.4, other_cpus=0.6)  # a neighbour gets 0.6 CPU beside our spin
    assert fit.update() == 1 and host.set_calls == [1]
    assert fit.others == pytest.approx(0.6)
    host.run(0.5, own_cpus=1.0, other_cpus=1.0)  # it takes the whole CPU we left
    assert fit.update() == 1
    host.run(0.5, own_cpus=1.0, other_cpus=0.4)  # less, but not 0.3 less: no flip back yet
    assert fit.update() == 1 and host.set_calls == [1]
    host.run(0.5, own_cpus=1.0, other_cpus=0.1)  # it stopped
    assert fit.update() == 2 and host.set_calls == [1, 2]
    host.run(0.5, own_cpus=2.0, other_cpus=0.4)  # a proxy's 0.4 CPU fits beside two threads
    assert fit.update() == 2 and host.set_calls == [1, 2]


def test_a_count_above_the_cpus_that_the_user_asked_for_is_kept_on_a_quiet_host(monkeypatch):
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)
    host = _Host()
    fit = host.threads(max_threads=4)  # OMP_NUM_THREADS=4 on two CPUs
    host.run(0.5, own_cpus=2.0, other_cpus=0.0)
    assert fit.update() == 4 and host.set_calls == []
    host.run(0.5, own_cpus=1.4, other_cpus=0.6)
    assert fit.update() == 1
    host.run(0.5, own_cpus=1.0, other_cpus=0.0)
    assert fit.update() == 4 and host.set_calls == [1, 4]


def test_a_reading_after_a_long_idle_gap_only_restarts_the_interval(monkeypatch):
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)
    host = _Host()
    fit = host.threads()
    host.run(30.0, own_cpus=0.0, other_cpus=2.0)  # no step ran for 30 s while another job ran
    assert fit.update() == 2 and host.set_calls == []
    host.run(0.5, own_cpus=1.0, other_cpus=1.0)  # the job is still there at the next step
    assert fit.update() == 1 and host.set_calls == [1]


def test_fitting_is_off_for_one_thread_a_host_without_proc_stat_or_when_asked(monkeypatch):
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)
    host = _Host()
    assert not host.threads(max_threads=1).enabled
    no_stat = threads.FreeCpuThreads(2, cpus=frozenset({0, 1}), busy_seconds=lambda cpus: None,
                                     set_threads=host.set_calls.append)
    assert not no_stat.enabled and no_stat.update() == 2
    monkeypatch.setenv("MINI_INFER_FIT_THREADS", "0")
    asked = host.threads()
    host.run(1.0, own_cpus=1.0, other_cpus=1.0)
    assert not asked.enabled and asked.update() == 2 and host.set_calls == []
    assert threads.wait_policy_env()["MINI_INFER_FIT_THREADS"] == "0"  # and an engine actor gets it
    monkeypatch.setenv("MINI_INFER_FIT_THREADS", "no")
    with pytest.raises(ValueError, match=r"^MINI_INFER_FIT_THREADS must be 0 .* or 1 .*; got 'no'$"):
        host.threads()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_real_busy_process_on_one_of_our_cpus_is_seen(monkeypatch):
    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    set_calls: list[int] = []
    fit = threads.FreeCpuThreads(2, 0.5, cpus=frozenset(cpus), set_threads=set_calls.append)
    code = (f"import os, time\nos.sched_setaffinity(0, {{{cpus[-1]}}})\n"
            "end = time.time() + 20\nwhile time.time() < end: pass")
    busy = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while fit.threads == 2 and time.monotonic() < deadline:
            time.sleep(0.6)
            fit.update()
        assert fit.threads == 1 and set_calls == [1]
        # at most our 2 CPUs, give or take /proc/stat's 10 ms ticks (up to 2 per CPU over a 0.6 s update)
        assert 0.5 < fit.others <= 2.1
    finally:
        busy.kill()
        busy.wait(timeout=10)
