"""Shared pieces of the benchmarks: workloads, the machine's matmul rate, a workload's FLOPs,
peak memory, percentiles, and where results go."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

ROOT = Path(__file__).resolve().parents[1]
# Where runs write by default: git-ignored, so that no command changes the checkout.
# bench/results/ holds the committed reference results (docs/PERFORMANCE.md); a run updates
# one only when its --out names it.
RESULTS = ROOT / "results"
sys.path.insert(0, str(ROOT))  # `python bench/x.py` imports the project's packages

# Before torch loads: importing the engine package sets its OpenMP wait policy and huge pages
# (engine/__init__.py, engine.threads).
import engine  # noqa: E402, F401

# isort: split
import torch  # noqa: E402

from engine.device import cpu_has_bf16_matmul  # noqa: E402
from engine.models import head_dim_of  # noqa: E402
from engine.threads import wait_policy_applied  # noqa: E402
from engine.workload import WorkloadError, read_workload  # noqa: E402


def load_workload(path: Path, quick: bool = False) -> dict:
    """A workload file (``shared/workloads/*.json``), cut by ``quick_workload`` if ``quick``.

    Raises:
        SystemExit: one line naming ``--workload`` (``engine.workload.read_workload``'s
            error), for a file that is missing or holds no workload.
    """
    try:
        workload = read_workload(path)
    except WorkloadError as exc:
        raise SystemExit(f"--workload: {exc}") from None
    return quick_workload(workload) if quick else workload


def quick_workload(workload: dict) -> dict:
    """The first 8 requests, prompts cut to 64 tokens and outputs to 16, for CI."""
    requests = [{**r, "prompt_token_ids": r["prompt_token_ids"][:64], "max_tokens": min(16, r["max_tokens"])}
                for r in workload["requests"][:8]]
    return {**workload, "name": workload["name"] + "-quick", "requests": requests}


def machine_info() -> dict:
    return {"machine": platform.machine(), "processor": _cpu_name(), "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "cpu_bf16_matmul_units": cpu_has_bf16_matmul(),
            "cpu_isa_flags": cpu_isa_flags(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            # whether those two reached libgomp (False: torch was imported before engine)
            "omp_wait_settings_applied": wait_policy_applied(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.date.today().isoformat()}


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8")


def cpu_isa_flags() -> list[str]:
    """The vector and matrix instruction sets of ``ISA_FLAGS`` this CPU reports
    (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return [f for f in ISA_FLAGS if f in flags]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def matmul_flops_per_s(dtype: torch.dtype, device: str = "cpu", size: int = 2048, repeats: int = 5) -> float:
    """The median rate of a ``size``-square matmul in ``dtype``: the roofline's compute roof."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def workload_flops(config, requests: list[dict]) -> float:
    """Matmul FLOPs to serve ``requests`` once each, with a KV cache (no recompute).

    Per computed token (every prompt token and every output token but the last): 2 FLOPs per
    weight of the decoder's linear layers, plus attention's ``QK^T`` and ``PV``: ``4 x layers
    x num_heads x head_dim x context``. Per output token: the LM head, ``2 x hidden x vocab``.
    (Kaplan et al. 2020, eq. 2.2, with attention counted exactly.)
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = head_dim_of(config)
    linear = layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                       + 3 * hidden * config.intermediate_size)
    total = 0.0
    for r in requests:
        prompt, output = len(r["prompt_token_ids"]), r["max_tokens"]
        computed = prompt + output - 1
        context_sum = computed * (computed + 1) / 2  # token t attends to t + 1 positions
        total += 2 * linear * computed + 4 * layers * heads * head_dim * context_sum
        total += 2 * hidden * config.vocab_size * output
    return total


class PeakMemory:
    """Peak resident memory of this process (CPU) or peak CUDA allocation during a block."""

    def __init__(self, device: str = "cpu", period_s: float = 0.05) -> None:
        self.device, self.period_s = device, period_s
        self.peak_bytes = 0
        self.start_bytes = 0

    @contextmanager
    def measure(self) -> Iterator["PeakMemory"]:
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
            yield self
            self.peak_bytes = torch.cuda.max_memory_allocated()
            return
        process = psutil.Process()
        self.start_bytes = self.peak_bytes = process.memory_info().rss
        stop = threading.Event()

        def sample():
            while not stop.wait(self.period_s):
                self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)

    def as_dict(self) -> dict:
        return {"peak_memory_gib": round(self.peak_bytes / 2**30, 3),
                "peak_memory_increase_gib": round((self.peak_bytes - self.start_bytes) / 2**30, 3)}


def percentiles(values: list[float], points=(50, 90, 99)) -> dict:
    """``{"p50": ..., "p90": ..., "p99": ..., "mean": ...}`` (nearest-rank), or {} when empty."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]
           for p in points}
    out["mean"] = statistics.fmean(ordered)
    return out


def write_result(name: str, result: dict, out: Path | None = None) -> Path:
    """Write ``result`` as JSON to ``out``, by default ``results/<name>-<date>.json``."""
    path = out or RESULTS / f"{name}-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
