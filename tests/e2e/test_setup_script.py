"""``scripts/setup.sh`` notices a torch that cannot use the machine's GPU (here: .venv's CPU
build next to a stand-in ``nvidia-smi`` that lists an H200)."""
import os
import subprocess

import torch

from tests.serve_process import ROOT


def _check_torch(path_prefix: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{path_prefix}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "scripts/setup.sh", "--check-torch"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_cpu_torch_on_a_gpu_machine_is_reported(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    result = _check_torch(str(tmp_path))
    assert result.returncode == 1
    assert "setup: WARNING: this machine has a GPU (GPU 0: NVIDIA H200" in result.stderr
    assert f"(torch {torch.__version__};" in result.stderr
    assert "--index-url https://pypi.org/simple" in result.stderr


def test_no_gpu_no_warning(tmp_path):
    result = _check_torch(str(tmp_path))  # no nvidia-smi in tmp_path, none on this machine
    assert result.returncode == 0 and result.stderr == ""
