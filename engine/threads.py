"""CPU threads of an engine process: how many intra-op threads, and how idle ones wait; and
its memory pages.

How many: the CPUs the process is given (``cpus_given``): ``OMP_NUM_THREADS`` where set (Ray
sets it in an actor from its ``num_cpus``, floored, at least 1: so a Serve engine replica
uses what ``engine_num_cpus`` reserves), else the Ray actor's assigned CPUs, else the CPUs
its affinity mask allows (``taskset``, cgroup cpusets; all cores on a plain host).

How they wait: a short spin, then sleep (``GOMP_SPINCOUNT=1000``). libgomp, torch's OpenMP
runtime on Linux, otherwise spins up to 300,000 iterations after each parallel region before it
sleeps; on a host where another process wants the same cores, the spinning threads and the
other process slow each other down many times over. Not spinning at all
(``OMP_WAIT_POLICY=PASSIVE``) costs the engine itself: a decode step runs ~400 parallel
regions (matmuls, attention, the glue), and waking sleeping threads for each made a 64-sequence
bf16 decode step 100 ms instead of 62 ms. 1,000 spins (libgomp's own count for a host with more
threads than CPUs) keeps the threads awake across the short gaps inside a step and lets them
sleep between steps and while Python runs. Measured (bench/busy_host.py, w1_mixed first 32, bf16,
2 cores, docs/PERFORMANCE.md): quiet 395 tok/s, beside one busy process 184 (0.47); passive 290
and 242; 300,000 spins 390 and 117. libgomp reads its environment once, when torch loads it, so
``set_wait_policy_env`` must run before torch is imported: ``engine/__init__.py`` calls it, and
the engine's Ray actor gets it in its ``runtime_env`` (``app.engine_actor_options``). A value
the user set (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``) is left as is.

Memory pages: torch's CPU allocator puts every buffer of 2 MiB or more on transparent huge
pages (``THP_MEM_ALLOC_ENABLE=1``: page-aligned and ``madvise(MADV_HUGEPAGE)``; torch's
c10/core/impl/alloc_cpu.cpp, pytorch/pytorch#93888). The KV cache (a sequence's blocks lie
anywhere in it) and the weights then take one TLB entry per 2 MiB instead of per 4 KiB. On
the AMD EPYC of docs/PERFORMANCE.md, where the kernel's THP mode is ``madvise``: decode
attention 2-22% faster (kernel_bench, shuffled blocks), w1_mixed 1.00-1.08x (median 1.03x).
torch reads the setting once, at its first CPU allocation, so it travels with the wait
policy (``set_huge_pages_env``, ``huge_pages_env``); a value the user set is left as is
(``0`` turns it off). Where the kernel's THP mode is ``never`` the advice does nothing.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = {"GOMP_SPINCOUNT": "1000"}
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
HUGE_PAGES_SETTING = "THP_MEM_ALLOC_ENABLE"


_wait_policy_before_torch: bool | None = None  # the first set_wait_policy_env()'s answer


def set_wait_policy_env() -> bool:
    """Put ``WAIT_POLICY_ENV`` into ``os.environ`` unless the user chose a wait policy.

    Returns:
        Whether this process's OpenMP runtime will see it: False when torch was imported
        before (libgomp has read its environment already).
    """
    global _wait_policy_before_torch
    users_own = any(name in os.environ for name in USER_WAIT_SETTINGS)
    os.environ.update(wait_policy_env())  # the user's own settings where there are any
    if _wait_policy_before_torch is None:
        _wait_policy_before_torch = users_own or "torch" not in sys.modules
    return "torch" not in sys.modules


def wait_policy_applied() -> bool:
    """Whether torch's OpenMP runtime in this process runs with the wait settings in
    ``os.environ``: the user's own were there from the start, or the first
    ``set_wait_policy_env()`` (``import engine``) came before torch was imported. False where
    torch came first and the setting is the engine's: libgomp then kept its default,
    300,000 spins, whatever ``GOMP_SPINCOUNT`` says now."""
    return bool(_wait_policy_before_torch)


def wait_policy_env() -> dict[str, str]:
    """The wait settings for another process's environment (a Ray actor's ``runtime_env``):
    this process's ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` where either is set, else
    ``WAIT_POLICY_ENV``."""
    chosen = {name: os.environ[name] for name in USER_WAIT_SETTINGS if name in os.environ}
    return chosen or dict(WAIT_POLICY_ENV)


def set_huge_pages_env() -> bool:
    """Put ``huge_pages_env()`` into ``os.environ`` (see the module docstring).

    Returns:
        Whether torch will see it: False when torch was imported before (its allocator may
        have read the setting already).
    """
    os.environ.update(huge_pages_env())
    return "torch" not in sys.modules


def huge_pages_requested() -> bool:
    """Whether this process asks torch for huge pages (``THP_MEM_ALLOC_ENABLE`` is ``1``)."""
    return os.environ.get(HUGE_PAGES_SETTING) == "1"


def huge_pages_env() -> dict[str, str]:
    """The huge-pages setting for a process's environment: this process's
    ``THP_MEM_ALLOC_ENABLE`` where set, else ``{"THP_MEM_ALLOC_ENABLE": "1"}``."""
    return {HUGE_PAGES_SETTING: os.environ.get(HUGE_PAGES_SETTING, "1")}


def cpus_given() -> int:
    """The number of CPUs this process may compute on (see the module docstring), >= 1."""
    from_env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if from_env.isdigit() and int(from_env) >= 1:
        return int(from_env)
    ray_cpus = _ray_assigned_cpus()
    if ray_cpus is not None:
        return max(1, int(ray_cpus))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _ray_assigned_cpus() -> float | None:
    if "ray" not in sys.modules:  # not a Ray worker: importing Ray here would cost seconds
        return None
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_assigned_resources().get("CPU")


def kernel_thp_mode() -> str | None:
    """The kernel's transparent-huge-pages mode (``always``, ``madvise`` or ``never``: the
    bracketed word of /sys/kernel/mm/transparent_hugepage/enabled), or None where there is no
    such file (not Linux, or a kernel without THP)."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def configure_cpu_threads() -> int:
    """Set torch's intra-op threads to ``cpus_given()`` and return that number."""
    import torch

    num_threads = cpus_given()
    torch.set_num_threads(num_threads)
    wait = ", ".join(f"{k}={v}" for k, v in os.environ.items() if k in USER_WAIT_SETTINGS) or "libgomp's default"
    if not wait_policy_applied():
        wait = "libgomp's default (torch was imported before the engine set its wait policy)"
    huge_pages = "on" if huge_pages_requested() else "off"
    logger.info("CPU threads: %d intra-op (torch), OpenMP wait: %s, huge pages (%s): %s (kernel THP mode: %s)",
                num_threads, wait, HUGE_PAGES_SETTING, huge_pages, kernel_thp_mode())
    return num_threads
