"""Every benchmark runs the engine with the OpenMP wait policy it has in service: each
``bench/*.py`` sets it (``import engine``, through ``bench/common.py``) before torch loads
libgomp, which reads its environment once. offline.py, profile_step.py, batch_table.py and
kernel_bench_cpu.py once imported torch first, ran with libgomp's 300,000 spins and
recorded ``gomp_spincount: 1000`` in their results."""
import os
import subprocess
import sys

from engine.threads import USER_WAIT_SETTINGS
from tests.serve_process import ROOT

PROBE = ("import sys; sys.path.insert(0, 'bench'); import {module}; "
         "from engine.threads import wait_policy_applied; print(wait_policy_applied())")


def _start(code: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in USER_WAIT_SETTINGS}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_every_benchmark_sets_the_wait_policy_before_torch_loads():
    modules = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    assert {"offline", "profile_step", "batch_table", "kernel_bench_cpu", "serving"} <= set(modules)
    runs = {m: _start(PROBE.format(module=m)) for m in modules}  # in parallel: ~4 s each
    answers = {m: p.communicate(timeout=120) for m, p in runs.items()}
    assert {m: out.strip() for m, (out, _) in answers.items()} == dict.fromkeys(modules, "True"), \
        {m: err[-2000:] for m, (_, err) in answers.items() if err}

