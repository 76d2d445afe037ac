"""Decode attention of two or more builds of the CPU extension, in one process, in turns.

A kernel change is worth a few percent, and this kind of machine's speed drifts by more than
that between two runs minutes apart (a 2-vCPU VM: copy bandwidth 25-36 GB/s within an hour).
So the builds are compared inside one run: each build's sources (a git revision's
``kernels/csrc``, or a folder such as the working tree's) are compiled into their own
extension, all of them are loaded into this process, and every round calls each build and a
256 MiB copy in turn, with the last level cache flushed before every call, exactly as
``bench/kernel_bench.py cpu`` times one build (``kernel_bench_cpu.time_turns``).

Two extensions cannot both register the library ``mini_infer`` (``silu_and_mul``'s
``TORCH_LIBRARY`` blocks), so each build's copy of ``cpu_attention.cpp`` registers it under
``mini_infer_ab_<n>`` instead; ``paged_attention`` is called through each module as the
project's wrapper calls it, so every build must take the same arguments (those of
``kernels.cpu_attention.paged_attention``'s call into the extension). Each build is compiled
once per source version, with the project's flags, and cached as the project's own build is.

Reported per build, batch x context and dtype: the median ms, GB/s over the bytes a decode step
must move, their share of the copy bandwidth, the time relative to the first build, and (where
cheap) the largest difference from ``kernels.reference``.

A build may end in ``@l1`` or ``@l2`` (``worktree@l2``): its calls then pass ``prefetch_l2``
(``kernels.cpu_attention.decode_prefetch_l2_default``; builds since it was added), so that one
source compares its two prefetch levels; without it a call takes the build's default (L1).

``--tables in-order`` gives each sequence consecutive blocks of the pool, as an engine's tables
mostly are when its sequences were admitted together and their prompts filled their blocks: the
hardware prefetchers see one stream per sequence, where the default shuffled tables (a random
permutation of the pool) leave every block's first lines to be missed or asked for.

``--tables one-block`` points every block-table entry at block 0, so each call reads one
block's K/V (a few KiB, in L1 after its first key): the kernel's arithmetic and bookkeeping
alone, without waiting for memory. Its GB/s and share of the copy count the bytes a real step
would move, so only its ms and speed are meaningful; set against the shuffled tables' times it
shows how much of a call is waiting for memory.

Usage::

    python bench/kernel_ab.py --builds HEAD,worktree --batches 64 --contexts 512
    python bench/kernel_ab.py --builds af9ec10,HEAD --dtypes float32 --rounds 15 --repeats 3
    python bench/kernel_ab.py --builds HEAD,worktree --tables one-block
    python bench/kernel_ab.py --builds 8371f47,HEAD --tables in-order
    python bench/kernel_ab.py --builds HEAD,worktree@l1,worktree@l2 --dtypes bfloat16,float32
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# Before torch loads: importing the engine package sets its OpenMP wait policy (engine.threads).
import engine  # noqa: F401

# isort: split
import torch
from kernel_bench import decode_bytes, gbps, make_decode_inputs
from kernel_bench_cpu import COPY_BYTES, SHAPES, cpu_info, default_flush_bytes, time_turns

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"  # git-ignored
CSRC = "kernels/csrc"
WORKTREE = "worktree"  # --builds: the checkout's kernels/csrc as it is now
LIBRARY_BLOCKS = ("TORCH_LIBRARY_FRAGMENT(mini_infer,", "TORCH_LIBRARY_IMPL(mini_infer,")
REFERENCE_MAX_KEYS = 64 * 512  # batch x context up to which outputs are checked against the reference
TABLES = ("shuffled", "in-order", "one-block")  # --tables: see the module docstring


PREFETCH_SUFFIXES = {"@l1": False, "@l2": True}  # --builds: a build's prefetch_l2 argument


def split_prefetch(spec: str) -> tuple[str, dict[str, bool]]:
    """A ``--builds`` item without its ``@l1`` / ``@l2`` suffix, and the keyword arguments its
    ``paged_attention`` calls take (none without a suffix)."""
    for suffix, l2 in PREFETCH_SUFFIXES.items():
        if spec.endswith(suffix):
            return spec.removesuffix(suffix), {"prefetch_l2": l2}
    return spec, {}


def build_sources(spec: str, root: Path = ROOT) -> dict[str, bytes]:
    """The files of ``kernels/csrc`` for one ``--builds`` item: ``worktree`` (the checkout as
    it is), a folder holding the files, or a git revision of ``root``.

    Raises:
        ValueError: naming ``--builds`` when ``spec`` is none of these.
    """
    folder = root / CSRC if spec == WORKTREE else Path(spec)
    if folder.is_dir():
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    listing = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{spec}:{CSRC}"],
                             capture_output=True, text=True)
    if listing.returncode != 0:
        raise ValueError(f"--builds: {spec!r} is not 'worktree', a folder, or a git revision with "
                         f"{CSRC} ({listing.stderr.strip()})")
    return {name: subprocess.run(["git", "-C", str(root), "show", f"{spec}:{CSRC}/{name}"],
                                 capture_output=True, check=True).stdout
            for name in listing.stdout.split()}


def rename_library(sources: dict[str, bytes], namespace: str) -> dict[str, bytes]:
    """``sources`` with ``cpu_attention.cpp``'s library blocks registering ``namespace``
    instead of ``mini_infer``, so that several builds load into one process.

    Raises:
        ValueError: when ``cpu_attention.cpp`` is missing.
    """
    if "cpu_attention.cpp" not in sources:
        raise ValueError(f"no cpu_attention.cpp among {sorted(sources)}")
    text = sources["cpu_attention.cpp"].decode()
    for block in LIBRARY_BLOCKS:
        text = text.replace(block, block.replace("(mini_infer,", f"({namespace},"))
    return {**sources, "cpu_attention.cpp": text.encode()}


def source_digest(sources: dict[str, bytes]) -> str:
    """12 hex digits of SHA-256 over the files' names and contents (as the extension's name)."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name])
    return digest.hexdigest()[:12]


def load_build(spec: str, index: int, log=print):
    """Compile (once per source version) and import one build; returns its module."""
    from torch.utils.cpp_extension import load as load_extension

    from kernels.cpu_attention import BUILD_CFLAGS, BUILD_LDFLAGS

    sources = rename_library(build_sources(split_prefetch(spec)[0]), f"mini_infer_ab_{index}")
    digest = source_digest(sources)
    folder = Path(tempfile.gettempdir()) / "mini-infer-kernel-ab" / digest
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in sources.items():  # unchanged files keep their times: no rebuild
        path = folder / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
    bin_dir = str(Path(sys.executable).parent)  # ninja from the virtualenv
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    log(f"build {index}: {spec} ({digest})")
    return load_extension(name=f"mini_infer_ab_{index}_{digest}",
                          sources=[str(folder / "cpu_attention.cpp"), str(folder / "attention_kernels.cpp")],
                          extra_cflags=BUILD_CFLAGS, extra_ldflags=BUILD_LDFLAGS, verbose=False)


def block_tables(shuffled: torch.Tensor, tables: str) -> torch.Tensor:
    """``make_decode_inputs``' shuffled block tables ([batch, blocks per sequence], int32) as
    ``tables`` (one of TABLES) asks: as they are, numbered in order row by row, or all block 0."""
    if tables == "in-order":
        return torch.arange(shuffled.numel(), dtype=shuffled.dtype).view(shuffled.shape)
    if tables == "one-block":
        return torch.zeros_like(shuffled)
    return shuffled


def compare(builds: list[str], modules: list, shape_name: str, dtypes, batches, contexts, rounds: int,
            repeats: int, isa: str = "auto", log=print, tables: str = "shuffled") -> dict:
    """Every combination, ``repeats`` times, each time ``rounds`` rounds of every build and the
    copy in turn; returns the result as JSON-able data. ``tables``: one of TABLES.

    Raises:
        ValueError: for ``tables`` not in TABLES.
    """
    if tables not in TABLES:
        raise ValueError(f"--tables must be one of {list(TABLES)}; got {tables!r}")
    from kernels import reference

    shape = SHAPES[shape_name]
    prefetch_kwargs = [split_prefetch(spec)[1] for spec in builds]
    flush = torch.zeros(default_flush_bytes() // 4)
    copy = (torch.empty(COPY_BYTES, dtype=torch.uint8), torch.ones(COPY_BYTES, dtype=torch.uint8))
    result = {"date": datetime.date.today().isoformat(), **cpu_info(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "shape_name": shape_name, "isa": isa, "tables": tables,
              "builds": builds,
              "load_average_before": os.getloadavg(), "rows": []}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for context in contexts:
            for batch in batches:
                inputs = make_decode_inputs(batch, context, shape, device="cpu", dtype=dtype)
                inputs["block_tables"] = block_tables(inputs["block_tables"], tables)
                args = [inputs[k] for k in ("query", "k_cache", "v_cache", "block_tables", "query_start_loc",
                                            "seq_lens", "scale")]
                calls = {f"build {i}": (lambda m=m, kw=kw, args=args: m.paged_attention(*args, isa, 0, False, **kw))
                         for i, (m, kw) in enumerate(zip(modules, prefetch_kwargs, strict=True))}
                diffs = None
                if batch * context <= REFERENCE_MAX_KEYS:
                    expected = reference.paged_attention(*args).float()
                    diffs = [(call().float() - expected).abs().max().item() for call in calls.values()]
                num_bytes = decode_bytes(batch, context, replace(shape, elem_size=dtype.itemsize))
                for repeat in range(repeats):
                    seconds = time_turns({**calls, "copy": lambda: copy[0].copy_(copy[1])}, flush, rounds)
                    copy_gbps = gbps(2 * COPY_BYTES, seconds["copy"] * 1e3)
                    row = {"dtype": dtype_name, "batch": batch, "context": context, "repeat": repeat,
                           "copy_gbps": round(copy_gbps, 1), "builds": []}
                    for i, name in enumerate(calls):
                        ms = seconds[name] * 1e3
                        row["builds"].append({
                            "ms": round(ms, 4), "gbps": round(gbps(num_bytes, ms), 2),
                            "of_copy": round(gbps(num_bytes, ms) / copy_gbps, 3),
                            "speed_vs_first": round(seconds["build 0"] / seconds[name], 3),
                            "max_abs_diff": diffs[i] if diffs else None})
                    result["rows"].append(row)
                    log(format_row(row))
    result["load_average_after"] = os.getloadavg()
    return result


def format_row(row: dict) -> str:
    """One row: the case, the copy, then per build ms, share of copy and speed against build 0."""
    cells = " | ".join(f"{i}: {b['ms']:7.3f} ms {b['of_copy']:4.2f} of copy {b['speed_vs_first']:5.3f}x"
                       for i, b in enumerate(row["builds"]))
    return (f"{row['dtype']:>8} b{row['batch']:<4} ctx{row['context']:<5} copy {row['copy_gbps']:5.1f} GB/s | "
            + cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", default=f"HEAD,{WORKTREE}",
                        help=f"comma-separated: git revisions, folders of {CSRC}'s files, or '{WORKTREE}'; "
                             "the first is the baseline")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batches", default="64")
    parser.add_argument("--contexts", default="512")
    parser.add_argument("--rounds", type=int, default=11, help="timed calls per build and repeat")
    parser.add_argument("--repeats", type=int, default=1, help="times each combination is timed")
    parser.add_argument("--isa", default="auto", help="the kernels every build runs (paged_attention's isa)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--tables", default="shuffled", choices=TABLES,
                        help="block tables: shuffled over the cache, each sequence's blocks consecutive "
                             "(in-order), or every entry block 0 (the arithmetic alone, K/V in L1)")
    parser.add_argument("--out", type=Path, help="JSON path (default results/..., git-ignored)")
    args = parser.parse_args(argv)
    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    if len(builds) < 2:
        parser.error(f"--builds needs at least two builds to compare; got {args.builds!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        loaded: dict[str, object] = {}  # one module per source, whatever its builds' suffixes
        for spec in builds:
            source = split_prefetch(spec)[0]
            if source not in loaded:
                loaded[source] = load_build(source, len(loaded))
        modules = [loaded[split_prefetch(spec)[0]] for spec in builds]
    except ValueError as error:
        parser.error(str(error))
    result = compare(builds, modules, args.shape, args.dtypes.split(","), [int(b) for b in args.batches.split(",")],
                     [int(c) for c in args.contexts.split(",")], args.rounds, args.repeats, args.isa,
                     tables=args.tables)
    out = args.out or RESULTS / f"kernel-ab-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
