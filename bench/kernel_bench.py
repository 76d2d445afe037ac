"""Decode paged-attention benchmark on CUDA: Triton against gather-then-SDPA, in GB/s.

``bench`` times one decode step of attention (one query token per sequence) with
Qwen2.5-7B's attention shape (28 query heads, 4 KV heads, head_dim 128, bf16, block_size 16,
shuffled block tables) for every batch x context combination, two ways:

- ``triton``: ``kernels.paged_attention(..., backend="triton")``, reading K/V in place;
- ``gather_sdpa``: gather K/V through the block table into dense tensors, then torch SDPA.

Each is reported as achieved GB/s over the bytes a decode step must move (K and V of every
context token, plus the query in and the output out; block-table reads are ignored) next to
the same run's device-to-device copy bandwidth (a large tensor copy, read + write bytes).
Times are medians of CUDA-event pairs around single calls, after a few warmup calls, with
the L2 cache flushed before each call; host launch overhead is included, so the smallest
combinations measure the launch path, as the engine sees it, not the memory system.

It is one part of ``bench/gpu_check.sh``.

``cpu`` benchmarks the CPU backend (``bench/kernel_bench_cpu.py``): decode attention GB/s
against the same run's copy bandwidth in bf16 and fp32, and prefill attention against the
per-sequence path; a table, and JSON and PNG under ``results/`` (git-ignored).

Usage::

    python bench/kernel_bench.py bench --json-out FILE
    python bench/kernel_bench.py cpu [--shape qwen2.5-7b] [--batches 1,64] [--contexts 512]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cli_types import positive_list

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
MEMORY_HEADROOM = 0.8  # use at most this share of free device memory for one combination


@dataclass(frozen=True)
class AttentionShape:
    """An attention layer's shape; ``elem_size`` in bytes (2 for bf16)."""

    num_heads: int = 28
    num_kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    elem_size: int = 2


QWEN2_5_7B = AttentionShape()


# ---------------------------------------------------------------------------- pure helpers


def cache_bytes(batch: int, context: int, shape: AttentionShape) -> int:
    """Bytes of the K and V caches holding ``batch`` sequences of ``context`` tokens."""
    blocks = batch * -(-context // shape.block_size)
    return 2 * blocks * shape.block_size * shape.num_kv_heads * shape.head_dim * shape.elem_size


def decode_bytes(batch: int, context: int, shape: AttentionShape) -> int:
    """Bytes one decode step must move: K and V of every context token, q in and out out."""
    kv = 2 * batch * context * shape.num_kv_heads * shape.head_dim * shape.elem_size
    query_and_out = 2 * batch * shape.num_heads * shape.head_dim * shape.elem_size
    return kv + query_and_out


def footprint_bytes(batch: int, context: int, shape: AttentionShape) -> int:
    """Peak device memory of one combination: the paged cache, its gathered dense copy, and
    one more copy in case SDPA makes the transposed K/V contiguous."""
    return 3 * cache_bytes(batch, context, shape) + 64 * 2**20


def fits(batch: int, context: int, shape: AttentionShape, free_bytes: int) -> bool:
    """Whether a combination fits in ``MEMORY_HEADROOM`` of ``free_bytes``."""
    return footprint_bytes(batch, context, shape) <= MEMORY_HEADROOM * free_bytes


def gbps(num_bytes: int, ms: float) -> float:
    """Bytes moved in ``ms`` milliseconds as GB/s (10**9 bytes per second)."""
    return num_bytes / ms / 1e6


def bench_row(batch: int, context: int, shape: AttentionShape, copy_gbps: float,
              timings_ms: dict[str, float]) -> dict:
    """One result row: bytes, and per path its time, GB/s and share of copy bandwidth."""
    num_bytes = decode_bytes(batch, context, shape)
    row = {"batch": batch, "context": context, "bytes": num_bytes}
    for path, ms in timings_ms.items():
        row[f"{path}_ms"] = round(ms, 4)
        row[f"{path}_gbps"] = round(gbps(num_bytes, ms), 1)
        row[f"{path}_of_copy"] = round(gbps(num_bytes, ms) / copy_gbps, 3)
    return row


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'batch':>5} {'context':>7} {'triton ms':>10} {'GB/s':>7} {'of copy':>7} "
             f"{'gather ms':>10} {'GB/s':>7} {'of copy':>7}"]
    for r in rows:
        if "skipped" in r or "error" in r:
            reason = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(f"{r['batch']:>5} {r['context']:>7}  {reason}")
            continue
        lines.append(f"{r['batch']:>5} {r['context']:>7} {r['triton_ms']:>10.4f} "
                     f"{r['triton_gbps']:>7.0f} {r['triton_of_copy']:>7.2f} "
                     f"{r['gather_sdpa_ms']:>10.4f} {r['gather_sdpa_gbps']:>7.0f} "
                     f"{r['gather_sdpa_of_copy']:>7.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- CUDA part


def time_ms(fn: Callable[[], object], flush, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` by CUDA events, the L2 cache flushed before each call."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbps(flush, num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth of one large tensor, read plus write bytes, GB/s."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), flush)
    return gbps(2 * num_bytes, ms)


def make_decode_inputs(batch: int, context: int, shape: AttentionShape, device: str = "cuda",
                       dtype=None) -> dict:
    """A decode batch: every sequence ``context`` tokens long, its last token the query;
    block tables are a random permutation of the pool. ``dtype`` defaults to bf16."""
    import torch

    dtype = dtype or torch.bfloat16
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return {
        "query": torch.randn(batch, shape.num_heads, shape.head_dim, device=device, dtype=dtype),
        "k_cache": torch.randn(cache_shape, device=device, dtype=dtype),
        "v_cache": torch.randn(cache_shape, device=device, dtype=dtype),
        "block_tables": torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int(),
        "query_start_loc": torch.arange(batch + 1, device=device, dtype=torch.int32),
        "seq_lens": torch.full((batch,), context, device=device, dtype=torch.int32),
        "scale": shape.head_dim ** -0.5,
    }


def gather_sdpa_decode(inputs: dict, context: int, shape: AttentionShape):
    """The torch baseline: gather K/V densely through the block table, then SDPA.

    The group's query heads become SDPA's query length (one decode token per sequence, so
    no mask), which avoids repeating K/V per query head.
    """
    import torch.nn.functional as F

    query, block_tables = inputs["query"], inputs["block_tables"].long()
    batch = query.shape[0]
    group = shape.num_heads // shape.num_kv_heads

    def dense(cache):  # [batch, num_kv_heads, context, head_dim]
        gathered = cache[block_tables].flatten(1, 2)[:, :context]
        return gathered.transpose(1, 2)

    q = query.view(batch, shape.num_kv_heads, group, shape.head_dim)
    out = F.scaled_dot_product_attention(q, dense(inputs["k_cache"]), dense(inputs["v_cache"]),
                                         scale=inputs["scale"])
    return out.reshape(batch, shape.num_heads, shape.head_dim)


def bench_combo(batch: int, context: int, shape: AttentionShape, copy_gbps: float, flush) -> dict:
    """Time both paths on one combination; check they agree."""
    import kernels

    inputs = make_decode_inputs(batch, context, shape)
    args = [inputs[k] for k in ("query", "k_cache", "v_cache", "block_tables",
                                "query_start_loc", "seq_lens", "scale")]
    triton_fn = lambda: kernels.paged_attention(*args, backend="triton", num_decodes=batch)  # noqa: E731
    gather_fn = lambda: gather_sdpa_decode(inputs, context, shape)  # noqa: E731
    max_diff = (triton_fn().float() - gather_fn().float()).abs().max().item()
    row = bench_row(batch, context, shape, copy_gbps,
                    {"triton": time_ms(triton_fn, flush), "gather_sdpa": time_ms(gather_fn, flush)})
    row["max_abs_diff"] = max_diff
    return row


def run_bench(shape: AttentionShape = QWEN2_5_7B) -> dict:
    """All combinations on the current CUDA device; skips those that would not fit."""
    import torch
    import triton

    torch.manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > any L2 cache
    copy = copy_bandwidth_gbps(flush)
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            free, _ = torch.cuda.mem_get_info()
            if not fits(batch, context, shape, free):
                need = footprint_bytes(batch, context, shape) / 2**30
                rows.append({"batch": batch, "context": context,
                             "skipped": f"needs {need:.1f} GiB, {free / 2**30:.1f} GiB free"})
            else:
                try:
                    rows.append(bench_combo(batch, context, shape, copy, flush))
                except Exception as e:  # noqa: BLE001 - record it, keep the other combinations
                    rows.append({"batch": batch, "context": context,
                                 "error": f"{type(e).__name__}: {e}"[:500]})
            torch.cuda.empty_cache()
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "shape": asdict(shape), "dtype": "bfloat16",
            "copy_gbps": round(copy, 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time decode attention (needs CUDA)")
    bench.add_argument("--json-out", type=Path, required=True)
    cpu = sub.add_parser("cpu", help="time the CPU attention kernels (decode and prefill)")
    cpu.add_argument("--shape", default="smollm2-135m", choices=("smollm2-135m", "qwen2.5-7b"))
    cpu.add_argument("--dtypes", default="bfloat16,float32",
                     help="query dtypes, comma-separated; QUERY/fp8_e4m3 or QUERY/fp8_e5m2 "
                     "(bfloat16/fp8_e4m3) for an fp8 cache under QUERY's queries")
    integers = positive_list(int, "integers")
    cpu.add_argument("--batches", type=integers, default="1,4,16,64,256", help="comma-separated")
    cpu.add_argument("--contexts", type=integers, default="128,512,1024,2048,4096", help="comma-separated")
    cpu.add_argument("--isa", help="auto, or one of kernels.cpu_attention.supported_isas() "
                     "(default: $MINI_INFER_CPU_ISA, else auto)")
    cpu.add_argument("--rounds", type=int, default=5, help="timed calls per combination")
    cpu.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    cpu.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                     help="time by the wall clock, or (with --threads 1) the thread's CPU time, which leaves out "
                          "waits for a core on a shared host")
    cpu.add_argument("--no-prefill", action="store_true", help="decode only")
    cpu.add_argument("--out", type=Path, help="JSON path (default results/..., git-ignored)")
    args = parser.parse_args(argv)

    if args.command == "cpu":
        sys.path.insert(0, str(REPO))  # run as a script: make `kernels` importable
        import engine  # noqa: F401 - before torch loads: the engine's OpenMP wait and huge pages

        # isort: split
        import kernel_bench_cpu

        return kernel_bench_cpu.main(args)
    import torch

    if not torch.cuda.is_available():
        print("kernel_bench: FAILED: needs a CUDA GPU (torch.cuda.is_available() is false)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))  # run as a script: make `kernels` importable
    result = run_bench()
    print(f"device-to-device copy: {result['copy_gbps']:.0f} GB/s on {result['device']}")
    print(format_table(result["rows"]))
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
