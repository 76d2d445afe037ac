"""The parts of ``bench/gpu_check.sh`` (one GPU check, under 8 minutes on an H200), and their
merge. Each part is a subcommand that writes one JSON file; the shell script runs each under
its own time limit, so a part that fails or hangs costs only its own result.

- ``env``: python, torch, Triton, transformers versions; the device; that ``engine`` and
  ``kernels`` import without Ray, FastAPI, pydantic or gguf (the GPU machine has none).
- ``tests``: the Triton kernel tests and the CUDA engine tests, on the GPU (pytest).
- ``accuracy``: Triton against the torch reference in bf16 at Qwen2.5-7B (28/4/128),
  Llama-3-8B (32/8/128) and SmolLM2-135M (9/3/64) attention shapes, on one batch of every
  kind: decodes (two of 4k tokens, which split), a prefill chunk at a non-zero start, a
  whole prompt; as per-kind launches and as one prefill-kind launch.
- ``engine``: ``dummy:qwen2.5-7b`` on w1_mixed (``bench/workloads.py``), cold (first
  generate after start-up) and warm, with the Triton variants compiled by start-up and by
  the end; the batch-1 decode step against the weight-read limit (weight bytes / the
  device's copy bandwidth); the share of wall time the GPU is busy in decode steps at batch
  1 and 64 (below 1: launch-bound).
- ``merge``: every part's JSON, exit status and log tail, in one file.

(``bench/kernel_bench.py bench`` is the decode-attention GB/s part.) ``--dry-run`` runs each
part without CUDA: arguments, imports, the workload, the test list (collected, not run).

    python bench/gpu_check.py engine --backend triton --json-out engine.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench.workloads import make_workload  # noqa: E402

# The packages the application needs and the GPU machine does not have.
APP_ONLY_PACKAGES = ("ray", "fastapi", "pydantic", "gguf")
# The Triton kernel tests and the tests that need CUDA, run on the GPU by the ``tests`` part.
GPU_TESTS = ("tests/kernels/test_triton_paged_attention.py", "tests/kernels/test_triton_store_kv.py",
             "tests/kernels/test_attention_dispatch_sdpa.py",
             "tests/engine/test_engine_triton_backend.py", "tests/engine/test_cuda.py")
MODEL = "dummy:qwen2.5-7b"
ACCURACY_SHAPES = {"qwen2.5-7b": (28, 4, 128), "llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
# (seq_len, query_len), decodes first: two 4k-token decodes (split), short decodes, a chunk
# of 300 tokens after 512 cached ones, a whole prompt.
ACCURACY_BATCH = [(4096, 1), (4100, 1), (1000, 1), (37, 1), (812, 300), (200, 200)]
PARTS = ("env", "tests", "accuracy", "kernel_bench", "engine_triton", "engine_torch")


# ---------------------------------------------------------------------------- env


def run_env(dry_run: bool) -> dict:
    """Versions, the device, and the import check (no application-only package loaded)."""
    import torch
    import transformers
    import triton

    import engine.llm  # noqa: F401 - what the engine part imports
    import kernels.triton_paged_attention  # noqa: F401

    result = {"python": platform.python_version(), "torch": torch.__version__,
              "torch_cuda": torch.version.cuda, "triton": triton.__version__,
              "transformers": transformers.__version__,
              "app_only_packages_installed": [p for p in APP_ONLY_PACKAGES if importlib.util.find_spec(p)],
              "app_only_packages_imported": [p for p in APP_ONLY_PACKAGES if p in sys.modules],
              "cuda_available": torch.cuda.is_available(), "dry_run": dry_run}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result |= {"device": props.name, "capability": list(torch.cuda.get_device_capability(0)),
                   "multi_processor_count": props.multi_processor_count,
                   "memory_gib": round(props.total_memory / 2**30, 1),
                   "bf16_by_capability": torch.cuda.get_device_capability(0)[0] >= 8}
    try:
        result["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                              timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        result["nvidia_smi"] = None
    if result["app_only_packages_imported"]:
        raise SystemExit(f"engine/kernels imported {result['app_only_packages_imported']}")
    return result


# ---------------------------------------------------------------------------- tests


def run_tests(dry_run: bool, junit: Path | None) -> int:
    """pytest over ``GPU_TESTS`` (only collected in a dry run); pytest's exit status."""
    import pytest

    missing = [t for t in GPU_TESTS if not (ROOT / t).is_file()]
    if missing:
        raise SystemExit(f"gpu_check: test files not found: {missing}")
    args = [str(ROOT / t) for t in GPU_TESTS] + ["-q", "-p", "no:cacheprovider", "-rs"]
    if junit is not None:
        args.append(f"--junitxml={junit}")
    return int(pytest.main(args + (["--collect-only"] if dry_run else [])))


# ---------------------------------------------------------------------------- accuracy


def run_accuracy(dry_run: bool) -> dict:
    """Triton against the reference per shape and launch mode (bf16): the largest error and
    whether every element is within ``tests/kernels/paged_cases.TOLERANCES``."""
    import torch

    from kernels import reference
    from kernels.triton_paged_attention import _num_cores, paged_attention, plan_launches
    from tests.kernels.paged_cases import TOLERANCES, make_batch

    if dry_run:
        return {"dry_run": True, "shapes": list(ACCURACY_SHAPES)}
    tolerance = TOLERANCES[torch.bfloat16]
    num_decodes = sum(q == 1 for _, q in ACCURACY_BATCH)
    num_tokens = sum(q for _, q in ACCURACY_BATCH)
    rows = []
    for name, (heads, kv_heads, head_dim) in ACCURACY_SHAPES.items():
        batch = make_batch(ACCURACY_BATCH, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=1)
        expected = reference.paged_attention(*batch.args()).float()
        launches = plan_launches(num_tokens, len(ACCURACY_BATCH), num_decodes, heads, kv_heads,
                                 head_dim, batch.block_tables.shape[1] * 16,
                                 _num_cores(batch.query.device))
        row = {"shape": name, "heads": [heads, kv_heads, head_dim],
               "decode_splits": launches[0].num_splits}
        for mode, decodes in (("per_kind", num_decodes), ("one_launch", 0)):
            out = paged_attention(*batch.args(), num_decodes=decodes).float()
            error = (out - expected).abs()
            row[f"{mode}_max_abs_err"] = error.max().item()
            row[f"{mode}_ok"] = bool(torch.isfinite(out).all()) and bool(
                (error <= tolerance["atol"] + tolerance["rtol"] * expected.abs()).all())
        row["ok"] = row["per_kind_ok"] and row["one_launch_ok"]
        rows.append(row)
    return {"batch": ACCURACY_BATCH, "dtype": "bfloat16", "tolerance": tolerance, "rows": rows,
            "ok": all(r["ok"] for r in rows)}


# ---------------------------------------------------------------------------- engine


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (the GPU's busy time when the
    intervals are its kernels)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_summary(seconds: list[float]) -> dict:
    """Median and spread of step times, in ms."""
    ms = sorted(1e3 * s for s in seconds)
    return {"steps": len(ms), "median_ms": round(statistics.median(ms), 3),
            "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3)}


def _add_decoding(engine, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Queue ``batch`` requests and step until every prompt is prefilled."""
    from engine.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}",
                           [100 + (i + j) % 40000 for j in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()


def _finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decode_steps(engine, batch: int, num_steps: int, prompt_len: int) -> dict:
    """Wall time of ``num_steps`` decode steps at ``batch`` sequences (each step ends in the
    sampled tokens' copy to the host, so it includes the GPU's work)."""
    _add_decoding(engine, batch, prompt_len, num_steps + 2)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    _finish(engine)
    return step_summary(times)


def gpu_busy(engine, batch: int, num_steps: int, prompt_len: int, device: str) -> dict:
    """Share of the wall time of ``num_steps`` decode steps during which a kernel ran
    (torch.profiler's CUDA kernel intervals, merged; none on the CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _add_decoding(engine, batch, prompt_len, num_steps + 2)
    engine.step()  # one decode outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        _sync(device)
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        _sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    _finish(engine)
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    busy = union_us(kernels)
    return {"batch": batch, "steps": num_steps, "wall_ms": round(wall_us / 1e3, 3),
            "gpu_busy_ms": round(busy / 1e3, 3), "gpu_busy_fraction": round(busy / wall_us, 3),
            "kernels_per_step": round(len(kernels) / num_steps, 1)}


def generate_workload(llm, workload: dict) -> dict:
    from engine.sampling_params import SamplingParams

    requests = workload["requests"]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r["prompt_token_ids"] for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / seconds, 1)}


def run_engine(backend: str, dry_run: bool, model: str = MODEL, device: str = "cuda",
               quick: bool = False) -> dict:
    """The engine with one attention backend (see the module docstring). ``model``,
    ``device`` and ``quick`` (8 short requests, small decode batches) exist so that the
    test suite can run this part on a CPU."""
    from common import quick_workload

    workload = make_workload("w1_mixed")
    workload = quick_workload(workload) if quick else workload
    result = {"model": model, "backend": backend, "workload": workload["name"],
              "requests": len(workload["requests"]), "dry_run": dry_run}
    if dry_run:
        from engine.llm import LLM  # noqa: F401 - the imports of a real run
        return result
    with empty_triton_cache():
        return _measure_engine(backend, model, device, quick, workload, result)


@contextlib.contextmanager
def empty_triton_cache():
    """Cold means cold: Triton compiles into a fresh ``$TRITON_CACHE_DIR`` (read at each
    compile), which is removed afterwards and the variable restored."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    cache_dir = tempfile.mkdtemp(prefix="gpu-check-triton-")
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    try:
        yield cache_dir
    finally:
        if previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous
        shutil.rmtree(cache_dir, ignore_errors=True)


def _measure_engine(backend: str, model: str, device: str, quick: bool, workload: dict, result: dict) -> dict:
    from engine.llm import LLM
    from kernels.triton_launches import compiled_variant_counts

    batches, prompt_len, steps = ((1, 4), 32, 4) if quick else ((1, 64), 512, 24)
    start = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", device=device, attention_backend=backend)
    engine = llm.llm_engine
    result["startup_s"] = round(time.perf_counter() - start, 2)
    result["num_kv_blocks"] = engine.model_runner.num_blocks
    result["triton_variants_after_startup"] = compiled_variant_counts()
    result["cold"] = generate_workload(llm, workload)
    result["warm"] = generate_workload(llm, workload)
    result["triton_variants_after_runs"] = compiled_variant_counts()
    result["output_tokens_per_s"] = result["warm"]["output_tokens_per_s"]
    batch1 = decode_steps(engine, 1, steps, prompt_len)
    weight_bytes = engine.model_runner.model.weight_bytes()
    result["batch1_decode"] = batch1 | {"weight_gb": round(weight_bytes / 1e9, 2)}
    if device == "cuda":
        result["batch1_decode"] |= weight_read_limit(batch1["median_ms"], weight_bytes)
    result["gpu_busy"] = [gpu_busy(engine, b, steps // 3 + 1, prompt_len, device) for b in batches]
    return result


def weight_read_limit(step_ms: float, weight_bytes: int) -> dict:
    """A decode step against the time to read every weight once at the device's copy
    bandwidth (a large device-to-device copy, read + write bytes per second)."""
    import torch
    from kernel_bench import copy_bandwidth_gbps

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    copy_gbps = copy_bandwidth_gbps(flush)
    limit_ms = weight_bytes / (copy_gbps * 1e9) * 1e3
    return {"copy_gbps": round(copy_gbps, 1), "weight_read_limit_ms": round(limit_ms, 3),
            "ratio_to_limit": round(step_ms / limit_ms, 2)}


# ---------------------------------------------------------------------------- merge


def _read(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.exists() else None


def _tail(text: str | None, lines: int = 30) -> str | None:
    return None if text is None else "\n".join(text.rstrip().splitlines()[-lines:])


def read_part(parts: Path, name: str) -> dict:
    """A part's status (from its ``.rc``), its JSON, and its log's tail unless it passed."""
    rc_text = (_read(parts / f"{name}.rc") or "").strip()
    rc = int(rc_text) if rc_text.lstrip("-").isdigit() else None
    status = "not run" if rc is None else {0: "ok", 124: "timed out"}.get(rc, f"failed (exit {rc})")
    result = {"status": status, "rc": rc}
    text = _read(parts / f"{name}.json")
    try:
        result.update(json.loads(text) if text else {})
    except json.JSONDecodeError as e:
        result["json_error"] = str(e)
    log = _read(parts / f"{name}.log")
    if log is not None and rc != 0:
        result["log_tail"] = _tail(log)
    elif log is not None and name == "tests":
        result["summary"] = _tail(log, 1)
    return result


def merge(parts: Path, date: str) -> dict:
    """Every part under ``parts`` in one dict; ``ok`` when each passed."""
    merged = {"date": date, **{name: read_part(parts, name) for name in PARTS}}
    rates = [merged[f"engine_{b}"].get("output_tokens_per_s") for b in ("triton", "torch")]
    if all(isinstance(r, (int, float)) and r > 0 for r in rates):
        merged["triton_over_torch_w1"] = round(rates[0] / rates[1], 3)
    merged["ok"] = all(merged[name]["status"] == "ok" for name in PARTS)
    return merged


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("env", "accuracy", "engine"):
        part = sub.add_parser(name)
        part.add_argument("--json-out", type=Path, required=True)
        part.add_argument("--dry-run", action="store_true")
        if name == "engine":
            part.add_argument("--backend", choices=("triton", "torch"), required=True)
            part.add_argument("--model", default=MODEL)
            part.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
            part.add_argument("--quick", action="store_true", help="8 short requests (tests)")
    tests = sub.add_parser("tests")
    tests.add_argument("--dry-run", action="store_true")
    tests.add_argument("--junit", type=Path)
    merge_cmd = sub.add_parser("merge")
    merge_cmd.add_argument("--dir", type=Path, required=True)
    merge_cmd.add_argument("--out", type=Path, required=True)
    merge_cmd.add_argument("--date", default=datetime.date.today().isoformat())
    args = parser.parse_args(argv)

    if args.command == "tests":
        return run_tests(args.dry_run, args.junit)
    if args.command == "merge":
        result = merge(args.dir, args.date)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        for name in PARTS:
            print(f"  {name}: {result[name]['status']}")
        print(f"wrote {args.out}: {'all parts ok' if result['ok'] else 'SOME PARTS FAILED'}")
        return 0 if result["ok"] else 1
    if args.command == "env":
        result = run_env(args.dry_run)
    elif args.command == "accuracy":
        result = run_accuracy(args.dry_run)
    else:
        result = run_engine(args.backend, args.dry_run, args.model, args.device, args.quick)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2)[-3000:])
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
