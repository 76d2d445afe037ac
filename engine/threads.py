"""CPU threads of an engine process: how many intra-op threads, and how idle ones wait; and
its memory pages.

How many: the CPUs the process is given (``cpus_given``): ``OMP_NUM_THREADS`` where set (Ray
sets it in an actor from its ``num_cpus``, floored, at least 1: so a Serve engine replica
uses what ``engine_num_cpus`` reserves), else the Ray actor's assigned CPUs, else the CPUs
its affinity mask allows (``taskset``, cgroup cpusets; all cores on a plain host).

How they wait: a spin, then sleep (``GOMP_SPINCOUNT=30000``), with as many threads as the
other processes leave CPUs free (``FreeCpuThreads``). A decode step runs ~400 parallel regions
(matmuls, attention), with single-threaded glue between them; a worker thread that has gone
to sleep in between costs a futex wake per region (~60 us on a KVM guest). libgomp's own
default spins 300,000 iterations first: its spin iteration is a ``pause`` instruction,
12.7 ns on an Intel Xeon with AMX-BF16 (timed, 30,000 in a loop), so ~4 ms of a core after every
region. 30,000 (~0.4 ms there) keeps the threads awake across a step's gaps: on that Xeon (2
vCPUs), bf16 w1_mixed (``python -m engine generate``, 2026-12-02), 1,000 / 3,000 /
10,000 / 30,000 / 300,000 spins gave 367.7-376.2 / 389.3-390.3 / 425.1 / 443.5-445.6 /
443.1-450.2 output tok/s. Spinning threads and another process on the same cores slow each
other down many times over (docs/PERFORMANCE.md, "Threads on a busy host": 0.11-0.30 of the
quiet throughput at 10,000-300,000 spins on an AMD EPYC); ``FreeCpuThreads`` drops a thread
when other processes use the CPU it would spin on, so no thread spins on a CPU that another
process wants, and takes it back when they stop. ``OMP_WAIT_POLICY=PASSIVE`` (no spin: 100 ms
instead of 62 ms a 64-sequence decode step there) or any ``GOMP_SPINCOUNT`` the user sets is
left as is. libgomp reads its environment once, when torch loads it, so
``set_wait_policy_env`` must run before torch is imported: ``engine/__init__.py`` calls it, and
the engine's Ray actor gets it in its ``runtime_env`` (``app.engine_actor_options``).

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
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = {"GOMP_SPINCOUNT": "30000"}
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
HUGE_PAGES_SETTING = "THP_MEM_ALLOC_ENABLE"
FIT_THREADS_SETTING = "MINI_INFER_FIT_THREADS"  # "0": always cpus_given() threads (FreeCpuThreads)


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
    ``WAIT_POLICY_ENV``; and ``MINI_INFER_FIT_THREADS`` where set (``FreeCpuThreads``)."""
    chosen = {name: os.environ[name] for name in USER_WAIT_SETTINGS if name in os.environ}
    fitting = {FIT_THREADS_SETTING: os.environ[FIT_THREADS_SETTING]} if FIT_THREADS_SETTING in os.environ else {}
    return {**(chosen or WAIT_POLICY_ENV), **fitting}


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
    mask = affinity_cpus()
    return max(1, len(mask) if mask is not None else os.cpu_count() or 1)


def affinity_cpus() -> frozenset[int] | None:
    """The CPUs this process's affinity mask allows, or None where there is no such mask (not
    Linux)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


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


def fit_threads_setting() -> bool:
    """``$MINI_INFER_FIT_THREADS``: whether ``FreeCpuThreads`` fits the threads to the free
    CPUs (``1``, the default) or keeps ``cpus_given()`` (``0``).

    Raises:
        ValueError: naming the variable, for another value.
    """
    setting = os.environ.get(FIT_THREADS_SETTING, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{FIT_THREADS_SETTING} must be 0 (always cpus_given() threads) or 1 "
                         f"(fewer while other processes use the CPUs); got {setting!r}")
    return setting == "1"


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


def read_busy_cpu_seconds(cpus: frozenset[int], path: str = "/proc/stat") -> float | None:
    """Seconds the CPUs ``cpus`` have spent busy since boot, all processes together: user, nice,
    system, irq, softirq and steal time of their ``cpuN`` lines in ``path`` (proc(5)), or None
    where the file or a CPU's line is missing (not Linux)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    ticks, seen = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        ticks += user + nice + system + irq + softirq + steal
        seen += 1
    return ticks / os.sysconf("SC_CLK_TCK") if seen == len(cpus) else None


class FreeCpuThreads:
    """torch's intra-op threads, fitted to the CPUs that other processes leave free.

    Every ``interval_s`` (at the next ``update``) it compares the busy time of the CPUs in this
    process's affinity mask (``read_busy_cpu_seconds``) with this process's own CPU time
    (``time.process_time``, every thread of it): the rest is what other processes ran there,
    ``others`` CPUs on average. It then runs ``threads`` intra-op threads, between 1 and
    ``max_threads``: one fewer as soon as they no longer fit in the CPUs left free
    (``len(cpus) - others < min(threads, len(cpus)) - 0.5``, e.g. another process using more
    than half a CPU of two; a count above the CPUs that the user asked for is kept while no
    other process needs them),
    one more back once the free CPUs have room for it with 0.3 to spare (hysteresis: a load
    that hovers near half a CPU does not flip the count every interval). A thread that would
    spin (``WAIT_POLICY_ENV``) on a CPU another process wants costs both many times over;
    one fewer thread costs a quiet host nothing, since the count comes back within an interval
    of the other process stopping.

    ``update`` must run on the thread that runs the forward: OpenMP's thread count
    (``omp_set_num_threads``, which ``torch.set_num_threads`` calls) belongs to the calling
    thread.

    Args:
        max_threads: the most threads, ``cpus_given()``; 1 turns the fitting off, as does
            ``MINI_INFER_FIT_THREADS=0`` in the environment.
        interval_s: seconds between two readings (0.5: a busy neighbour costs at most about
            that long at the spin's pace).
        cpus: the CPUs to watch (default: this process's affinity mask).
        busy_seconds, process_time, clock, set_threads: where the readings come from and the
            count goes (``read_busy_cpu_seconds``, ``time.process_time``, ``time.monotonic``,
            ``torch.set_num_threads``); tests pass their own.

    Raises:
        ValueError: ``MINI_INFER_FIT_THREADS`` is set to something other than 0 or 1.
    """

    def __init__(self, max_threads: int, interval_s: float = 0.5, *, cpus: frozenset[int] | None = None,
                 busy_seconds: Callable[[frozenset[int]], float | None] = read_busy_cpu_seconds,
                 process_time: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] | None = None) -> None:
        if cpus is None:
            cpus = affinity_cpus() or frozenset()  # not Linux: no /proc/stat to read either
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s = interval_s
        self.cpus = cpus
        self.others = 0.0  # the last reading: CPUs other processes used, on average
        self._busy_seconds, self._process_time, self._clock = busy_seconds, process_time, clock
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        fitting = max_threads > 1 and fit_threads_setting()
        self._last = self._read() if fitting else None

    @property
    def enabled(self) -> bool:
        """Whether the count is fitted: more than one thread, the setting on, a first reading."""
        return self._last is not None

    def _read(self) -> tuple[float, float, float] | None:
        busy = self._busy_seconds(self.cpus) if self.cpus else None
        return None if busy is None else (self._clock(), busy, self._process_time())

    def update(self) -> int:
        """Take a reading if ``interval_s`` has passed since the last one and set the thread
        count from it; returns the count now in force. A reading more than 4 intervals after
        the last (the engine had no step to run) only starts the next interval."""
        if not self.enabled or self._clock() - self._last[0] < self.interval_s:
            return self.threads
        now = self._read()
        if now is None:
            return self.threads
        wall, busy, own = (b - a for a, b in zip(self._last, now, strict=True))
        self._last = now
        if wall > 4 * self.interval_s:  # no step for a while (an idle engine): read afresh
            return self.threads
        self.others = max(0.0, (busy - own) / wall)
        free = len(self.cpus) - self.others
        threads = self.threads
        if free < min(threads, len(self.cpus)) - 0.5:
            threads = max(1, math.floor(free + 0.5))
        elif threads < self.max_threads and free >= threads + 0.7:
            # all CPUs free again: the count asked for, even one above the CPUs (OMP_NUM_THREADS)
            threads = self.max_threads if free + 0.3 >= len(self.cpus) else math.floor(free + 0.3)
        if threads != self.threads:
            logger.info("intra-op threads %d -> %d: other processes used %.2f of %d CPUs",
                        self.threads, threads, self.others, len(self.cpus))
            self._set_threads(threads)
            self.threads = threads
        return self.threads
