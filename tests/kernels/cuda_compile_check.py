"""Compile the Triton kernels for CUDA targets, no GPU needed (run in its own process).

The interpreter runs kernels as Python, so it cannot catch what only the compiler rejects:
loop-carried type changes, tl.dot shape limits, constexpr misuse. This compiles the launch
configurations ``plan`` picks, through PTX to a cubin, for each architecture given.

Usage: ``python tests/kernels/cuda_compile_check.py 80 90``. Exit status 0: all compiled;
3: this triton has no NVIDIA backend; anything else: a compile error (printed).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - depends on the installed triton
    sys.exit(3)

from kernels.triton_paged_attention import _paged_attention_kernel, _reduce_splits_kernel, plan  # noqa: E402
from kernels.triton_store_kv import _store_kv_kernel  # noqa: E402

TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _signature(fn, constexprs: dict, pointers: dict, floats=()) -> dict:
    """Triton signature: named pointers, fp32 scalars in ``floats``, every other arg i32."""
    def kind(name):
        if name in constexprs:
            return "constexpr"
        return pointers.get(name) or ("fp32" if name in floats else "i32")
    return {name: kind(name) for name in fn.arg_names}


def attention_sources():
    """(label, ASTSource, num_warps) for decode, split decode and prefill launches."""
    shapes = [  # num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, max_context
        (8, 8, 28, 4, 128, 8192), (2, 2, 9, 3, 64, 4096), (4096, 4, 28, 4, 128, 8192),
        (300, 3, 9, 3, 80, 512)]
    for dtype in TRITON_TYPES.values():
        for num_tokens, num_seqs, heads, kv_heads, head_dim, context in shapes:
            p = plan(num_tokens, num_seqs, heads, kv_heads, head_dim, context, 132, dtype == "fp32")
            constexprs = dict(BLOCK_SIZE=16, BLOCK_M=p.block_m, GROUP_PAD=p.group_pad,
                              HEAD_DIM_PAD=p.head_dim_pad, TILE_N=p.tile_n,
                              NUM_SPLITS=p.num_splits,
                              DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST_DOT=False)
            pointers = {n: f"*{dtype}" for n in ("query_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
            pointers |= {n: "*i32" for n in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")}
            pointers |= {n: "*fp32" for n in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")}
            sig = _signature(_paged_attention_kernel, constexprs, pointers, floats=("qk_scale",))
            yield (f"paged_attention {dtype} {p}",
                   ASTSource(_paged_attention_kernel, sig, constexprs), p.num_warps)
            if p.num_splits > 1:
                constexprs = dict(NUM_SPLITS=p.num_splits, HEAD_DIM_PAD=p.head_dim_pad)
                pointers = {"part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
                            "part_sum_ptr": "*fp32", "out_ptr": f"*{dtype}"}
                sig = _signature(_reduce_splits_kernel, constexprs, pointers)
                yield (f"reduce_splits {dtype} {p.num_splits}",
                       ASTSource(_reduce_splits_kernel, sig, constexprs), 4)


def store_kv_sources():
    for dtype in TRITON_TYPES.values():
        constexprs = dict(BLOCK_SIZE=16, HEADS_PAD=4, HEAD_DIM_PAD=128)
        pointers = {n: f"*{dtype}" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
        pointers["slot_mapping_ptr"] = "*i64"
        sig = _signature(_store_kv_kernel, constexprs, pointers)
        yield f"store_kv {dtype}", ASTSource(_store_kv_kernel, sig, constexprs), 4


def main(archs: list[int]) -> int:
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for label, source, num_warps in [*attention_sources(), *store_kv_sources()]:
            try:
                triton.compile(source, target=target, options={"num_warps": num_warps})
            except Exception as e:  # noqa: BLE001 - report which variant, then fail
                print(f"sm_{arch}: {label}: {type(e).__name__}: {e}")
                return 1
            print(f"sm_{arch}: compiled {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [80, 90]))
