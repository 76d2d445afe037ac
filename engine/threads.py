"""CPU threads of an engine process: how many intra-op threads, and how idle ones wait.

How many: the CPUs the process is given (``cpus_given``): ``OMP_NUM_THREADS`` where set (Ray
sets it in an actor from its ``num_cpus``, floored, at least 1: so a Serve engine replica
uses what ``engine_num_cpus`` reserves), else the Ray actor's assigned CPUs, else the CPUs
its affinity mask allows (``taskset``, cgroup cpusets; all cores on a plain host).

How they wait: passively (``OMP_WAIT_POLICY=PASSIVE``). libgomp, torch's OpenMP runtime on
Linux, otherwise spins up to 300,000 iterations after each parallel region before it sleeps;
on a host where another process wants the same cores, the spinning threads and the other
process slow each other down many times over (measured: bench/busy_host.py,
docs/PERFORMANCE.md). libgomp reads the policy once, when torch loads it, so
``set_wait_policy_env`` must run before torch is imported: ``engine/__init__.py`` calls it,
and the engine's Ray actor gets it in its ``runtime_env`` (``app.engine_actor_options``).
A value the user set (``OMP_WAIT_POLICY`` or libgomp's ``GOMP_SPINCOUNT``) is left as is.
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def set_wait_policy_env() -> bool:
    """Put ``WAIT_POLICY_ENV`` into ``os.environ`` unless the user chose a wait policy.

    Returns:
        Whether this process's OpenMP runtime will see it: False when torch was imported
        before (libgomp has read its environment already).
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ.update(WAIT_POLICY_ENV)
    return "torch" not in sys.modules


def wait_policy_env() -> dict[str, str]:
    """The wait policy for another process's environment (a Ray actor's ``runtime_env``):
    this process's ``OMP_WAIT_POLICY`` where set, else ``WAIT_POLICY_ENV``."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", WAIT_POLICY_ENV["OMP_WAIT_POLICY"])}


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


def configure_cpu_threads() -> int:
    """Set torch's intra-op threads to ``cpus_given()`` and return that number."""
    import torch

    num_threads = cpus_given()
    torch.set_num_threads(num_threads)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    logger.info("CPU threads: %d intra-op (torch), OpenMP wait policy %s", num_threads, policy)
    return num_threads
