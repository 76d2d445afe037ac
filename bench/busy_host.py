"""Offline throughput on a busy host: the engine alone, then beside one busy process.

    python bench/busy_host.py --workload ../shared/workloads/w2_short.json --num-requests 24

Each run is a fresh ``python -m engine generate --workload`` process (OpenMP reads its wait
policy when torch loads, so it cannot change within a process). Conditions, interleaved
run by run so that a drift in the machine's speed hits all of them alike:

- ``quiet``: nothing else started by this benchmark.
- ``busy``: one process spinning in a Python loop, pinned to one core (the last CPU this
  process may use), for the whole run.

Variants: ``engine`` (the engine's defaults: ``engine.threads``, 30,000 spins, threads fitted
to the CPUs other processes leave free), ``fixed_threads`` (the same spin, always one thread a
CPU given: ``MINI_INFER_FIT_THREADS=0``), ``one_thread`` (``OMP_NUM_THREADS=1``), ``passive``
(``OMP_WAIT_POLICY=PASSIVE``: no spinning), ``spin1k`` (``GOMP_SPINCOUNT=1000``, the default
before 2026-12-02), ``spin10k`` and ``spin30k`` (10,000 and 30,000 spins) and ``spin``
(libgomp's default wait when no policy is set, 300,000 spins before sleeping:
``GOMP_SPINCOUNT=300000``; torch's behaviour before ``engine.threads``). The result is each
variant's busy / quiet throughput ratio (medians over ``--repeats``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, load_workload, machine_info, write_result

VARIANTS = {"engine": {}, "spin": {"GOMP_SPINCOUNT": "300000"}, "one_thread": {"OMP_NUM_THREADS": "1"},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin1k": {"GOMP_SPINCOUNT": "1000"},
            "spin10k": {"GOMP_SPINCOUNT": "10000"}, "spin30k": {"GOMP_SPINCOUNT": "30000"},
            "fixed_threads": {"MINI_INFER_FIT_THREADS": "0"}}
_BUSY_LOOP = "import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without its OpenMP settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MINI_INFER_FIT_THREADS")}
    return {**env, **extra}


def start_busy_process() -> subprocess.Popen:
    """One process spinning on one core (the last CPU of this process's affinity mask)."""
    core = max(os.sched_getaffinity(0))
    return subprocess.Popen([sys.executable, "-c", _BUSY_LOOP.format(core=core)])


def run_once(workload: Path, dtype: str, extra_env: dict[str, str], timeout_s: float) -> dict:
    """One ``python -m engine generate --workload`` run: its summary, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "engine", "generate", "--workload", str(workload),
               "--dtype", dtype, "--json-out", str(out)]
        start = time.perf_counter()
        try:
            subprocess.run(cmd, cwd=ROOT, env=_child_env(extra_env), timeout=timeout_s, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {timeout_s:.0f} s"}
        except subprocess.CalledProcessError as exc:
            return {"error": f"exit status {exc.returncode}"}
        summary = json.loads(out.read_text())
        summary["process_seconds"] = round(time.perf_counter() - start, 2)
        return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--num-requests", type=int, default=24, help="the workload's first N")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="engine,spin", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--timeout-s", type=float, default=900,
                        help="per run, start-up (model load) included; a run past it counts as 0 tok/s")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    workload = load_workload(args.workload)  # one line for a bad file, before any run
    workload["requests"] = workload["requests"][: args.num_requests]
    variants = args.variants.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.json"
        path.write_text(json.dumps(workload))
        for repeat in range(args.repeats):
            for condition in ("quiet", "busy"):
                busy = start_busy_process() if condition == "busy" else None
                try:
                    for variant in variants:
                        summary = run_once(path, args.dtype, VARIANTS[variant], args.timeout_s)
                        runs.append({"repeat": repeat, "condition": condition, "variant": variant, **summary})
                        print(f"{repeat} {condition:5} {variant:6} "
                              f"{summary.get('output_tokens_per_s', summary.get('error'))}", flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    result = {"workload": workload["name"], "num_requests": len(workload["requests"]),
              "dtype": args.dtype, "machine": machine_info(), "runs": runs,
              "summary": summarize(runs, variants)}
    path = write_result(f"busy-host-{workload['name']}", result, args.out)
    for variant, row in result["summary"].items():
        print(f"{variant:6}: quiet {row['quiet']} tok/s, busy {row['busy']} tok/s, busy/quiet {row['busy_over_quiet']}")
    print(f"wrote {path}")


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant: median output tok/s quiet and busy (a failed run counts as 0) and their
    ratio."""
    out = {}
    for variant in variants:
        row = {}
        for condition in ("quiet", "busy"):
            rates = [r.get("output_tokens_per_s", 0.0) for r in runs
                     if r["variant"] == variant and r["condition"] == condition]
            row[condition] = round(statistics.median(rates), 2) if rates else None
        row["busy_over_quiet"] = round(row["busy"] / row["quiet"], 3) if row["quiet"] else None
        out[variant] = row
    return out


if __name__ == "__main__":
    main()
