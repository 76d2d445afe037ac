"""The CPU part of ``bench/kernel_bench.py``: ``python bench/kernel_bench.py cpu``.

Decode: ``kernels.cpu_attention.paged_attention`` on one decode token per sequence, every
sequence ``context`` tokens long, shuffled block tables, for batch x context in bf16 and fp32
(and, named as ``bfloat16/fp8_e5m2`` or ``bfloat16/fp8_e4m3``, queries of one dtype over an
fp8 cache).
Each is reported as GB/s over the bytes a decode step must move (``kernel_bench.decode_bytes``:
K and V of every context token, the query in and the output out) next to the copy bandwidth
of a 256 MiB tensor (read + write bytes) timed in the same loop: the kernel and the copy take
turns, so a neighbour that slows the machine slows both. The last level cache is flushed
before every timed call (in the engine each layer's K/V has left it by the time it is read
again). Times are medians, of wall time, or with ``--clock cpu`` (one thread only) of the
calling thread's CPU time (``time.thread_time``): on a shared host that leaves out the time
the thread waited for a core, which wall time counts mostly against the longer copy.

Prefill: a whole batch of prompts or a chunk after cached tokens through the same call, against
the reference's per-sequence path (``kernels.reference.paged_attention``: gather each
sequence's K/V, then SDPA), which the CPU backend used for prefill before. The call runs as
the engine runs it (on a CPU with AMX its long bf16 chunks go to torch's SDPA,
``cpu_attention.sdpa_prefill_default``); "tiles ms" is the same call with every chunk on the
project's tile kernels (``prefill="tiles"``).

The attention shape defaults to SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), the
model the CPU engine serves; ``--shape qwen2.5-7b`` takes kernel_bench's GPU shape.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

# Before torch loads: importing the engine package sets its OpenMP wait policy (engine.threads).
import engine  # noqa: F401

# isort: split
import torch
from kernel_bench import QWEN2_5_7B, AttentionShape, decode_bytes, gbps, make_decode_inputs

from engine.threads import huge_pages_requested

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"  # git-ignored; the same folder as bench/common.py's RESULTS
SHAPES = {"smollm2-135m": AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16),
          "qwen2.5-7b": QWEN2_5_7B}
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096)
DTYPES = ("bfloat16", "float32")
COPY_BYTES = 256 * 2**20
FLUSH_BYTES = 128 * 2**20  # the least flushed: 4x the 32 MiB L3 of the CPU this was written on
# (name, [(seq_len, query_len)]): prompts as the engine's 2,048-token chunks meet them
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
PREFILL_CASES = (
    ("8 prompts x 256", [(256, 256)] * 8),
    ("1 prompt x 2048", [(2048, 2048)]),
    ("512 after 1536 cached", [(2048, 512)]),
    ("64 decodes x 512 + 512-token chunk", [(512, 1)] * 64 + [(1024, 512)]),
)


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a JSON number that neither rounds small values to 0 nor
    carries timer noise)."""
    return float(f"{x:.4g}")


def time_turns(fns: dict[str, Callable[[], object]], flush: torch.Tensor, rounds: int,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds (by ``clock``) of each function, called in turn ``rounds`` times after
    one warmup round; the last level cache is flushed (``flush`` written) before every call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds + 1):
        for name, fn in fns.items():
            flush.add_(1)
            start = clock()
            fn()
            if i:
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def parse_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """``"bfloat16"`` -> (bf16 queries, bf16 caches); ``"bfloat16/fp8_e5m2"`` or
    ``"bfloat16/fp8_e4m3"`` -> bf16 queries over fp8 caches (the engine's ``kv_cache_dtype``).

    Raises:
        ValueError: for another cache dtype after '/', naming ``--dtypes``.
    """
    query, _, cache = name.partition("/")
    caches = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
    if cache and cache not in caches:
        raise ValueError(f"--dtypes: a cache dtype after '/' must be one of {sorted(caches)}; got {name!r}")
    return getattr(torch, query), caches[cache] if cache else getattr(torch, query)


def make_prefill_inputs(seqs: list[tuple[int, int]], shape: AttentionShape, dtype: torch.dtype,
                        cache_dtype: torch.dtype | None = None) -> list:
    """``paged_attention``'s arguments for ``(seq_len, query_len)`` per sequence: random K/V
    in a pool of exactly the blocks needed, shuffled over the sequences."""
    blocks = [-(-seq_len // shape.block_size) for seq_len, _ in seqs]
    cache_shape = (sum(blocks), shape.block_size, shape.num_kv_heads, shape.head_dim)
    pool = torch.randperm(sum(blocks), dtype=torch.int32)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    for i, count in enumerate(blocks):
        tables[i, :count], pool = pool[:count], pool[count:]
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor([q for _, q in seqs]).cumsum(0)
    caches = [torch.randn(cache_shape).to(cache_dtype or dtype) for _ in range(2)]
    return [torch.randn(int(query_start_loc[-1]), shape.num_heads, shape.head_dim, dtype=dtype), *caches, tables,
            query_start_loc, torch.tensor([s for s, _ in seqs], dtype=torch.int32), shape.head_dim ** -0.5]


def decode_row(batch: int, context: int, shape: AttentionShape, dtype: torch.dtype, isa: str | None,
               flush: torch.Tensor, copy: tuple[torch.Tensor, torch.Tensor], rounds: int,
               clock: Callable[[], float] = time.perf_counter, cache_dtype: torch.dtype | None = None) -> dict:
    """One batch x context in one dtype (queries; the caches' where ``cache_dtype`` is None):
    kernel and copy times, GB/s, share of copy. ``copy`` is (destination, source)."""
    from kernels import cpu_attention, reference

    inputs = make_decode_inputs(batch, context, shape, device="cpu", dtype=dtype)
    cache_dtype = cache_dtype or dtype
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"].to(cache_dtype), inputs["v_cache"].to(cache_dtype)
    args = [inputs[k] for k in ("query", "k_cache", "v_cache", "block_tables", "query_start_loc",
                                "seq_lens", "scale")]
    kernel = lambda: cpu_attention.paged_attention(*args, isa=isa)  # noqa: E731
    seconds = time_turns({"kernel": kernel, "copy": lambda: copy[0].copy_(copy[1])}, flush, rounds, clock)
    # K and V at the cache's element size, the query and output at the query's
    num_bytes = (decode_bytes(batch, context, replace(shape, elem_size=cache_dtype.itemsize))
                 + 2 * batch * shape.num_heads * shape.head_dim * (dtype.itemsize - cache_dtype.itemsize))
    kernel_gbps = gbps(num_bytes, seconds["kernel"] * 1e3)
    copy_gbps = gbps(2 * copy[1].numel(), seconds["copy"] * 1e3)
    row = {"batch": batch, "context": context, "bytes": num_bytes, "ms": _sig(seconds["kernel"] * 1e3),
           "gbps": _sig(kernel_gbps), "copy_gbps": _sig(copy_gbps), "of_copy": _sig(kernel_gbps / copy_gbps)}
    if batch * context <= 16 * 1024:  # a spot check against the reference where it is cheap
        expected = reference.paged_attention(*args)
        row["max_abs_diff"] = (kernel().float() - expected.float()).abs().max().item()
    return row


def prefill_rows(shape: AttentionShape, dtype: torch.dtype, isa: str | None, flush: torch.Tensor, rounds: int,
                 cases=PREFILL_CASES, clock: Callable[[], float] = time.perf_counter,
                 cache_dtype: torch.dtype | None = None) -> list[dict]:
    """Each case through the kernel and through the reference's per-sequence path."""
    from kernels import cpu_attention, reference

    rows = []
    for name, seqs in cases:
        args = make_prefill_inputs(seqs, shape, dtype, cache_dtype)
        fns = {"kernel": functools.partial(cpu_attention.paged_attention, *args, isa=isa),
               "tiles": functools.partial(cpu_attention.paged_attention, *args, isa=isa, prefill="tiles"),
               "per_sequence": functools.partial(reference.paged_attention, *args)}
        seconds = time_turns(fns, flush, rounds, clock)
        rows.append({"case": name, "query_tokens": int(args[0].shape[0]),
                     "kernel_ms": _sig(seconds["kernel"] * 1e3), "tiles_ms": _sig(seconds["tiles"] * 1e3),
                     "per_sequence_ms": _sig(seconds["per_sequence"] * 1e3),
                     "speedup": _sig(seconds["per_sequence"] / seconds["kernel"])})
    return rows


def cpu_info() -> dict:
    """The processor's name and its vector-extension flags (avx*, amx*, fma, f16c), from
    /proc/cpuinfo where there is one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"processor": None, "cpu_flags": []}
    field = lambda name: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name)), "")  # noqa: E731
    flags = [f for f in field("flags").split() if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return {"processor": field("model name") or None, "cpu_flags": sorted(flags)}


def cache_size_bytes(text: str) -> int:
    """A size as Linux's sysfs writes a cache's (``"491520K"``, ``"32M"``, ``"512"``) in bytes.

    Raises:
        ValueError: where it is not a number with an optional K, M or G.
    """
    text = text.strip()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def last_level_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest of CPU 0's caches in bytes (``index*/size`` under ``cache_dir``), or None
    where sysfs does not list them."""
    return max((cache_size_bytes(p.read_text()) for p in cache_dir.glob("index*/size")), default=None)


def default_flush_bytes() -> int:
    """Bytes written before each timed call: twice the last level cache, at least FLUSH_BYTES.
    (A KVM Xeon with AMX reports a 480 MiB L3: with 128 MiB flushed, decode attention at b64 x
    ctx512 ran from cache, 1.21 ms against 1.90 ms with 1 GiB flushed, bf16, 2 threads.)"""
    return max(FLUSH_BYTES, 2 * (last_level_cache_bytes() or 0))


def run_cpu(shape_name: str = "smollm2-135m", dtypes=DTYPES, batches=BATCHES, contexts=CONTEXTS,
            isa: str | None = None, rounds: int = 5, prefill_cases=PREFILL_CASES, copy_bytes: int = COPY_BYTES,
            flush_bytes: int | None = None, log=print, clock: str = "wall") -> dict:
    """Every combination; returns the result as JSON-able data. ``clock``: a key of ``CLOCKS``
    ("cpu" measures the calling thread only: use it with one torch thread); ``flush_bytes``:
    default_flush_bytes() where None."""
    from kernels import cpu_attention

    shape = SHAPES[shape_name]
    flush_bytes = default_flush_bytes() if flush_bytes is None else flush_bytes
    flush = torch.zeros(flush_bytes // 4)
    copy = (torch.empty(copy_bytes, dtype=torch.uint8), torch.ones(copy_bytes, dtype=torch.uint8))
    result = {"date": datetime.date.today().isoformat(), **cpu_info(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "clock": clock, "shape_name": shape_name, "shape": asdict(shape),
              "isa": cpu_attention.selected_isa(shape.head_dim, isa),
              "supported_isas": cpu_attention.supported_isas(),
              "load_average_before": os.getloadavg(),  # other processes on a shared machine
              "huge_pages": huge_pages_requested(), "flush_bytes": flush_bytes,
              "decode": {}, "prefill": {}}
    for dtype_name in dtypes:
        dtype, cache_dtype = parse_dtypes(dtype_name)
        rows = result["decode"][dtype_name] = []
        for context in contexts:
            for batch in batches:
                rows.append(decode_row(batch, context, shape, dtype, isa, flush, copy, rounds, CLOCKS[clock],
                                       cache_dtype))
                log(f"{dtype_name} " + format_decode_table(rows[-1:]).splitlines()[-1])
        if prefill_cases:
            result["prefill"][dtype_name] = prefill_rows(shape, dtype, isa, flush, rounds, prefill_cases,
                                                         CLOCKS[clock], cache_dtype)
    result["load_average_after"] = os.getloadavg()
    return result


def format_decode_table(rows: list[dict]) -> str:
    """Decode rows as a fixed-width table."""
    lines = [f"{'batch':>5} {'context':>7} {'ms':>9} {'GB/s':>7} {'copy GB/s':>9} {'of copy':>7}"]
    lines += [f"{r['batch']:>5} {r['context']:>7} {r['ms']:>9.3f} {r['gbps']:>7.1f} {r['copy_gbps']:>9.1f} "
              f"{r['of_copy']:>7.2f}" for r in rows]
    return "\n".join(lines)


def format_prefill_table(rows: list[dict]) -> str:
    """Prefill rows as a fixed-width table."""
    lines = [f"{'case':<36} {'tokens':>6} {'kernel ms':>9} {'tiles ms':>8} {'per-seq ms':>10} {'speedup':>7}"]
    lines += [f"{r['case']:<36} {r['query_tokens']:>6} {r['kernel_ms']:>9.2f} {r['tiles_ms']:>8.2f} "
              f"{r['per_sequence_ms']:>10.2f} {r['speedup']:>6.2f}x" for r in rows]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """GB/s against context, a line per batch, one panel per dtype; copy bandwidth and half of
    it as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(result["decode"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        rows = result["decode"][dtype]
        copy = statistics.median(r["copy_gbps"] for r in rows)
        for batch in sorted({r["batch"] for r in rows}):
            mine = [r for r in rows if r["batch"] == batch]
            ax.plot([r["context"] for r in mine], [r["gbps"] for r in mine], marker="o", label=f"batch {batch}")
        ax.axhline(copy, color="black", linestyle="--", label=f"copy {copy:.0f} GB/s")
        ax.axhline(copy / 2, color="gray", linestyle=":", label="half of copy")
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s", title=f"decode attention, {dtype}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['processor']}, {result['threads']} threads, {result['clock']} time, {result['isa']}, "
                 f"{result['shape_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args) -> int:
    """The ``cpu`` subcommand of kernel_bench.py (its arguments as parsed there)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        print("kernel_bench cpu: --clock cpu times the calling thread only: add --threads 1", file=sys.stderr)
        return 2
    from kernels import cpu_attention

    isas = cpu_attention.supported_isas()
    if args.isa not in (None, "auto", *isas):  # one line, not the kernel's RuntimeError mid-run
        print(f"kernel_bench cpu: --isa {args.isa!r}: this CPU runs auto, {', '.join(isas)}", file=sys.stderr)
        return 2
    result = run_cpu(args.shape, args.dtypes.split(","), args.batches, args.contexts, args.isa, args.rounds,
                     () if args.no_prefill else PREFILL_CASES, clock=args.clock)
    for dtype, rows in result["decode"].items():
        title = f"decode, {dtype} ({result['isa']}, {result['threads']} threads, {result['clock']} time)"
        print(f"\n{title}\n{format_decode_table(rows)}")
    print(f"\nload average before / after: {result['load_average_before']} / {result['load_average_after']}")
    for dtype, rows in result["prefill"].items():
        print(f"\nprefill attention, {dtype}\n{format_prefill_table(rows)}")
    out = args.out or RESULTS / f"kernel-bench-cpu-{result['shape_name']}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0
