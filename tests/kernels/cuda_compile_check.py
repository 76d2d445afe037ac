"""Compile the Triton kernels for CUDA targets, no GPU needed (run in its own process).

The interpreter runs kernels as Python, so it cannot catch what only the compiler rejects:
loop-carried type changes, tl.dot shape limits, constexpr misuse, register spills. This
records the launches ``paged_attention`` and ``store_kv`` make for every attention shape
the kernel tests use and for real models' shapes (``kernels.triton_launches``: each launch
keyed by Triton's own binder, as the JIT would key it on the GPU), and compiles each
distinct variant through PTX to a cubin for every architecture given, with the installed
Triton's ``ptxas``.

Usage: ``python tests/kernels/cuda_compile_check.py 80 90``: sm_90 (H100/H200) gets every
variant, other architectures the fp16/bf16 ones. Exit status 0: all compiled; 3: this triton
has no NVIDIA backend; 1: a compile error, or register spills in a half-precision variant
(printed; fp32 spills are printed only: fp32 is the kernels' exactness mode, not a serving
dtype). The first run takes about two minutes on two cores; Triton's cache
(``~/.triton/cache``) makes later runs take seconds.
"""
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

try:
    from kernels.triton_launches import LaunchRecorder, compile_launch
except ImportError:  # pragma: no cover - depends on the installed triton
    sys.exit(3)

from kernels.triton_paged_attention import paged_attention  # noqa: E402
from kernels.triton_store_kv import store_kv  # noqa: E402
from tests.kernels.paged_cases import CHUNKS, DECODE, MIXED  # noqa: E402
from tests.kernels.test_triton_paged_attention import SHAPES  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (num_heads, num_kv_heads, head_dim, block_size) of the other kernel and engine tests, and
# of real models: Qwen2.5-7B, Llama-3-8B, SmolLM2-135M.
OTHER_SHAPES = [(6, 2, 64, 16), (7, 1, 64, 32), (4, 1, 64, 16), (9, 3, 64, 16), (4, 2, 16, 16),
                (6, 2, 16, 16), (28, 4, 128, 16), (32, 8, 128, 16), (9, 3, 64, 16)]
# A batch of every kind: decodes first (some long enough to split), a prefill chunk at a
# non-zero start, a whole prompt.
BATCH = [(4096, 1), (100, 1), (17, 1), (300, 45), (33, 33)]


def _meta(*shape, dtype=torch.int32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def record_attention(recorder_shapes) -> LaunchRecorder:
    """Every launch of decode-first and single-launch batches, fused-QKV (engine) and
    contiguous (tests) queries, over the given shapes and all dtypes."""
    with LaunchRecorder() as recorder:
        for num_heads, num_kv_heads, head_dim, block_size in recorder_shapes:
            for dtype in DTYPES:
                for seqs in (BATCH, DECODE, CHUNKS, MIXED):
                    num_tokens = sum(q for _, q in seqs)
                    num_decodes = next((i for i, (_, q) in enumerate(seqs) if q != 1), len(seqs))
                    width = max(-(-s // block_size) for s, _ in seqs) + 1
                    fused = _meta(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
                    cache = _meta(64, block_size, num_kv_heads, head_dim, dtype=dtype)
                    for query in (fused[:, :num_heads], fused[:, :num_heads].contiguous()):
                        for decodes in {0, num_decodes}:
                            paged_attention(query, cache, cache, _meta(len(seqs), width),
                                            _meta(len(seqs) + 1), _meta(len(seqs)), head_dim ** -0.5,
                                            num_decodes=decodes)
                    key = fused[:, num_heads:num_heads + num_kv_heads]
                    store_kv(key, key, cache, cache, _meta(num_tokens, dtype=torch.int64))
    return recorder


def spill_bytes(ptx: str, arch: int) -> int:
    """Bytes of spill stores ``ptxas -v`` reports for ``ptx`` (Triton's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    gpu_name = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu_name}", str(path),
                              "-o", str(path.with_suffix(".cubin"))],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def _is_fp32(launch) -> bool:
    return launch.key[1][0][0] == "*fp32"  # the first argument's Triton type


def main(archs: list[int]) -> int:
    shapes = sorted({s[1:] for s in SHAPES.values()} | set(OTHER_SHAPES))
    variants = record_attention(shapes).variants()
    print(f"{len(variants)} variants from {len(shapes)} attention shapes x {len(DTYPES)} dtypes")
    failed = False
    for arch in archs:
        start = time.perf_counter()
        todo = [v for v in variants.values() if arch == 90 or not _is_fp32(v)]
        for launch in todo:
            label = f"sm_{arch}: {launch.kernel} {launch.key[1][:3]} {launch.kwargs}"
            try:
                compiled = compile_launch(launch, arch)
            except Exception as e:  # noqa: BLE001 - report which variant, then fail
                print(f"{label}: {type(e).__name__}: {e}")
                return 1
            spills = spill_bytes(compiled.asm["ptx"], arch)
            if spills:
                # fp32 is the kernels' exactness mode (tests), not a serving dtype: its
                # spills are reported; half-precision spills fail the check.
                failed |= not _is_fp32(launch)
                print(f"{label}: {spills} bytes of register spill stores (ptxas -v)"
                      f"{'' if _is_fp32(launch) else ': FAIL'}")
        print(f"sm_{arch}: compiled {len(todo)} variants in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [80, 90]))
