"""The kernels compile for sm_80 and sm_90 even where no GPU can run them, without register
spills in fp16/bf16.

Under the interpreter the kernels run as Python, which accepts code the compiler rejects;
this compiles every variant the kernel tests and real models launch, in separate processes (the
interpreter flag is fixed per process at import). On a CUDA machine the other tests
compile and run the kernels for real, so this one is skipped there.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("cuda_compile_check.py")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels for real")
def test_kernels_compile_for_sm80_and_sm90():
    # One process per architecture, side by side: each compiles serially (Triton's compiler
    # and ptxas). sm_90 has the most variants, so on two cores this takes about 0.6 of one
    # process for both (117 -> 74 s from a cold Triton cache).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {arch: subprocess.Popen([sys.executable, str(SCRIPT), arch], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for arch in ("80", "90")}
    try:
        outputs = {arch: run.communicate(timeout=600) for arch, run in runs.items()}
    finally:  # a timeout leaves nothing running
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    if any(run.returncode == 3 for run in runs.values()):
        pytest.skip("this triton build has no NVIDIA backend")
    for arch, run in runs.items():
        stdout, stderr = outputs[arch]
        assert run.returncode == 0, f"sm_{arch}: " + stdout[-3000:] + stderr[-3000:]
