"""``bench/gpu_check.sh`` on a machine without a GPU: its dry run in the GPU machine's
Python stack (``gpu_stack.build``), its loud failure without CUDA, and the pure parts of
``bench/gpu_check.py``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from tests.bench import gpu_stack
from tests.serve_process import ROOT


@pytest.fixture(scope="module")
def stack_python(tmp_path_factory):
    return gpu_stack.build(tmp_path_factory.mktemp("gpu-stack") / "venv")


def _run(python, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONNOUSERSITE": "1"}
    return subprocess.run([str(python), "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.e2e
def test_the_stack_has_no_application_packages(stack_python):
    """Control: the venv really lacks what the GPU machine lacks."""
    for name in gpu_stack.ABSENT:
        result = _run(stack_python, f"import {name}")
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, name


@pytest.mark.e2e
def test_engine_and_kernels_import_and_generate_in_the_gpu_stack(stack_python):
    result = _run(stack_python, """
import sys
import engine, kernels
import kernels.triton_paged_attention, kernels.triton_store_kv, kernels.triton_launches
from engine import LLM, SamplingParams
llm = LLM(model="dummy:tiny-llama", dtype="float32", attention_backend="torch", num_gpu_blocks=16)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
print(len(out[0].outputs[0].token_ids), sorted(m for m in ("ray", "fastapi", "pydantic", "gguf") if m in sys.modules))
""")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "4 []"


@pytest.mark.e2e
@pytest.mark.slow
def test_dry_run_in_the_gpu_stack(stack_python, tmp_path):
    env = {**os.environ, "GPU_CHECK_PYTHON": str(stack_python), "PYTHONNOUSERSITE": "1"}
    env.pop("OUT", None)
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [merged_path] = tmp_path.glob("gpu_check-*.json")
    merged = json.loads(merged_path.read_text())
    assert merged["ok"] and {merged[p]["status"] for p in gpu_check.PARTS} == {"ok"}
    env_part = merged["env"]
    assert env_part["app_only_packages_installed"] == [] and env_part["cuda_available"] is False
    assert merged["engine_triton"] == {"status": "ok", "rc": 0, "model": "dummy:qwen2.5-7b",
                                       "backend": "triton", "workload": "w1_mixed",
                                       "requests": 64, "dry_run": True}
    assert "tests collected" in merged["tests"]["summary"]
    assert (tmp_path / "gpu_check-parts" / "tests.log").is_file()


@pytest.mark.e2e
def test_without_cuda_it_fails_loudly(tmp_path):
    """No Python here sees a GPU: exit 2, the reason on stderr, no result file."""
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable}
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--out", str(tmp_path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "FAILED: no Python here sees a CUDA GPU" in result.stderr
    assert f"{sys.executable}: torch " in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.e2e
def test_bad_arguments(tmp_path):
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--fast"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "unknown argument '--fast'" in result.stderr


def test_the_cold_triton_cache_is_removed_and_the_variable_restored(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    with gpu_check.empty_triton_cache() as cache_dir:
        assert os.environ["TRITON_CACHE_DIR"] == cache_dir
        assert Path(cache_dir).name.startswith("gpu-check-triton-") and not any(Path(cache_dir).iterdir())
        (Path(cache_dir) / "kernel.cubin").write_bytes(b"\0")
    assert not Path(cache_dir).exists() and os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    with pytest.raises(RuntimeError, match="boom"), gpu_check.empty_triton_cache() as cache_dir:
        raise RuntimeError("boom")
    assert not Path(cache_dir).exists() and "TRITON_CACHE_DIR" not in os.environ


@pytest.mark.slow
def test_engine_part_on_the_cpu():
    """The engine part end to end, shrunk to run here: every measurement but the CUDA ones."""
    before = os.environ.get("TRITON_CACHE_DIR")
    result = gpu_check.run_engine("torch", dry_run=False, model="dummy:smollm2-135m", device="cpu",
                                  quick=True)
    assert os.environ.get("TRITON_CACHE_DIR") == before  # later tests compile into the usual cache
    assert result["workload"] == "w1_mixed-quick" and result["requests"] == 8
    for run in ("cold", "warm"):
        assert result[run]["output_tokens"] == 8 * 16 and result[run]["output_tokens_per_s"] > 0
    assert result["triton_variants_after_startup"] == result["triton_variants_after_runs"]
    assert result["batch1_decode"]["steps"] == 4 and result["batch1_decode"]["median_ms"] > 0
    assert result["batch1_decode"]["weight_gb"] == pytest.approx(0.27, abs=0.01)  # 135M x 2 bytes
    assert [b["batch"] for b in result["gpu_busy"]] == [1, 4]
    assert all(b["gpu_busy_fraction"] == 0 and b["wall_ms"] > 0 for b in result["gpu_busy"])


def _part(parts, name, rc, payload=None, log=""):
    (parts / f"{name}.rc").write_text(f"{rc}\n")
    (parts / f"{name}.log").write_text(log)
    if payload is not None:
        (parts / f"{name}.json").write_text(json.dumps(payload))


def test_merge_records_every_part(tmp_path):
    _part(tmp_path, "env", 0, {"device": "NVIDIA H200"})
    _part(tmp_path, "tests", 0, log="....\n57 passed in 40.1s\n")
    _part(tmp_path, "accuracy", 1, {"ok": False}, log="shape qwen2.5-7b: max abs err 0.5\n")
    _part(tmp_path, "kernel_bench", 124, log="1 512 ...\n")
    _part(tmp_path, "engine_triton", 0, {"output_tokens_per_s": 300.0})
    _part(tmp_path, "engine_torch", 0, {"output_tokens_per_s": 200.0})
    merged = gpu_check.merge(tmp_path, "2026-01-01")
    assert merged["date"] == "2026-01-01" and merged["env"]["device"] == "NVIDIA H200"
    assert merged["tests"] == {"status": "ok", "rc": 0, "summary": "57 passed in 40.1s"}
    assert merged["accuracy"]["status"] == "failed (exit 1)"
    assert merged["accuracy"]["log_tail"] == "shape qwen2.5-7b: max abs err 0.5"
    assert merged["kernel_bench"] == {"status": "timed out", "rc": 124, "log_tail": "1 512 ..."}
    assert merged["triton_over_torch_w1"] == 1.5 and merged["ok"] is False


def test_merge_cli_with_missing_parts(tmp_path):
    out = tmp_path / "results" / "gpu_check.json"
    assert gpu_check.main(["merge", "--dir", str(tmp_path), "--out", str(out)]) == 1
    merged = json.loads(out.read_text())
    assert merged["tests"] == {"status": "not run", "rc": None}
    assert "triton_over_torch_w1" not in merged and merged["ok"] is False


def test_union_of_kernel_intervals():
    assert gpu_check.union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert gpu_check.union_us([]) == 0


def test_step_summary():
    assert gpu_check.step_summary([0.003, 0.001, 0.002]) == {
        "steps": 3, "median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0}
