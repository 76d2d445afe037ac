"""The CPU backend: one C++ call per layer for the whole flattened batch, decode tokens and
prefill chunks alike, reading K and V in place through the block table, and one that stores the
step's new K/V (``csrc/``); the same extension computes bf16 models' SwiGLU activation
(``silu_and_mul``) and the greedy argmax (``argmax_rows``). On CPUs with AMX, bf16 prefill
chunks of 128 tokens or more go from inside that call to torch's CPU
``scaled_dot_product_attention`` instead, whose matmuls use the tiles
(``sdpa_prefill_default``, ``$MINI_INFER_CPU_PREFILL``).

The kernels are compiled once per instruction set into one extension (AVX-512 with
AVX512_BF16, AVX-512F, AVX2 + FMA + F16C, portable scalar; only the scalar one off x86-64 or
with a compiler other than GCC), without ``-march``: the build does not depend on the build
host's CPU, and each call runs the best kernels the running CPU supports (``supported_isas``),
or the ones a caller names, or else the ones ``$MINI_INFER_CPU_ISA`` names (e.g.
``MINI_INFER_CPU_ISA=avx2 python -m engine generate ...`` runs the engine on the AVX2 kernels
of a CPU with AVX-512). The extension's name carries a hash of its sources and of the Python
environment, so a build cache never serves an older build, nor one for another environment.

It is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja, about a minute)
and cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``);
``scripts/setup.sh`` builds it ahead of time. Where it cannot be built, ``is_available()`` is
False and the engine's ``auto`` backend stays on "torch".
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from kernels.cpu_settings import ISA_ENV, PREFETCH_CHOICES, PREFETCH_ENV, PREFILL_CHOICES, PREFILL_ENV
from kernels.cpu_settings import choice as _choice

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "cpu_attention.cpp", _CSRC / "attention_kernels.cpp"]
BUILD_CFLAGS = ["-O3", "-fopenmp"]  # no -march: the kernels pick their instruction sets (attention_kernels.cpp)
BUILD_LDFLAGS = ["-fopenmp"]


def extension_name() -> str:
    """``mini_infer_cpu_attention_<hash>``: 12 hex digits of SHA-256 over every file in
    ``csrc`` and over the environment it builds against (the Python environment's prefix,
    torch's version and directory). Two environments on one machine (a checkout's ``.venv``
    and a clone's) share the build cache: with one name, each rebuilt it over the other's
    (torch rebuilds where the include paths in ``build.ninja`` change), about 70 s at each
    engine start that alternated between them (a trial's finding)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _CSRC.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join([sys.prefix, torch.__version__, os.path.dirname(torch.__file__)]).encode())
    return f"mini_infer_cpu_attention_{digest.hexdigest()[:12]}"


@functools.cache
def load():
    """Build (once per machine and source version) and import the extension.

    Raises:
        RuntimeError: (or the build's own error) when it cannot be compiled here.
    """
    from torch.utils.cpp_extension import load as load_extension

    # The build runs `ninja`; a virtualenv's own (the `ninja` wheel) may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    module = load_extension(name=extension_name(), sources=[str(s) for s in _SOURCES],
                            extra_cflags=BUILD_CFLAGS, extra_ldflags=BUILD_LDFLAGS, verbose=False)
    # The extension defines torch.ops.mini_infer.silu_and_mul as it loads; its shapes, for
    # torch.compile (the compiled glue calls it as an opaque op):
    torch.library.register_fake("mini_infer::silu_and_mul")(_silu_and_mul_fake)
    return module


def _silu_and_mul_fake(x: torch.Tensor, isa: str, parallel_from_rows: int = 0) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@functools.cache
def is_available() -> bool:
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
        logger.warning("the C++ CPU attention kernel is unavailable (%s); using the torch reference", exc)
        return False
    return True


def supported_isas() -> list[str]:
    """Instruction sets whose kernels this CPU runs, best first, e.g. ``["avx512_bf16",
    "avx512", "avx2", "scalar"]``."""
    return list(load().supported_isas())


def _isa(isa: str | None) -> str:
    return isa or os.environ.get(ISA_ENV) or "auto"


def selected_isa(head_dim: int, isa: str | None = None) -> str:
    """The instruction set a call with ``isa`` runs at ``head_dim``: "auto" picks the best
    this CPU runs at that head_dim (the AVX-512 kernels need a multiple of 16, AVX2's of 8);
    None means ``$MINI_INFER_CPU_ISA``, else "auto".

    Raises:
        RuntimeError: as ``paged_attention`` for an ``isa`` this CPU cannot run.
    """
    return load().selected_isa(head_dim, _isa(isa))


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles that this process may use (torch's own check, which
    also asks the OS for the tile state)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def sdpa_prefill_default(prefill: str | None = None) -> bool:
    """Whether bf16 prefill chunks of 128 tokens or more run through torch's CPU
    ``scaled_dot_product_attention`` (one call per chunk from inside the C++ call, keys and
    values gathered from the chunk's blocks) instead of the key-tile kernels.

    Args:
        prefill: ``"sdpa"``, ``"tiles"`` or ``"auto"``: SDPA where the CPU has AMX, whose
            tiles torch's kernel uses for its matmuls (Xeon with AMX, 2 threads, SmolLM2's
            heads: 5 chunks of 400 tokens in 3.0 ms against the tiles' 5.9 ms, 2 x 1,024 in
            5.0 against 13.8; docs/PERFORMANCE.md). CPUs without AMX keep the tiles, which
            nothing here has measured against SDPA there. None means ``$MINI_INFER_CPU_PREFILL``,
            else ``"auto"``.

    Raises:
        ValueError: for any other value (naming the variable where it came from there).
    """
    prefill = _choice(prefill, "prefill", PREFILL_ENV, PREFILL_CHOICES)
    return prefill == "sdpa" or (prefill == "auto" and has_amx())


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.cache
def is_zen4() -> bool:
    """Whether this is an AMD CPU of family 25 (0x19: Zen 3 and Zen 4) with AVX-512F, which
    only Zen 4 has."""
    info = _cpuinfo()
    return (info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
            and "avx512f" in info.get("flags", "").split())


def decode_prefetch_l2_default(prefetch: str | None = None) -> bool:
    """Whether decode attention prefetches the K/V rows ahead of it into L2 (``prefetcht2``)
    rather than L1 (``prefetcht0``).

    Args:
        prefetch: ``"l1"``, ``"l2"`` or ``"auto"``: L2 on a Zen 4 EPYC (``is_zen4``), where
            it ran batch 64 x context 512 1.27-1.70x (bf16) and 1.54-1.58x (fp32) as fast as
            L1, 2 threads, LLC flushed (docs/PERFORMANCE.md, "On an AMD EPYC with
            AVX512-BF16, Zen 4"); L1 elsewhere, where the kernel's prefetches were tuned and
            L2 has not been measured against it. None means ``$MINI_INFER_CPU_PREFETCH``, else
            ``"auto"``.

    Raises:
        ValueError: for any other value (naming the variable where it came from there).
    """
    prefetch = _choice(prefetch, "prefetch", PREFETCH_ENV, PREFETCH_CHOICES)
    return prefetch == "l2" or (prefetch == "auto" and is_zen4())


def prefill_path(dtype: torch.dtype, prefill: str | None = None) -> str:
    """How ``paged_attention`` runs prefill chunks of 128 tokens or more in ``dtype``:
    ``"sdpa"`` (bf16 where ``sdpa_prefill_default(prefill)``) or ``"tiles"``.

    Raises:
        ValueError: as ``sdpa_prefill_default``.
    """
    return "sdpa" if sdpa_prefill_default(prefill) and dtype == torch.bfloat16 else "tiles"


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, isa: str | None = None, num_splits: int = 0,
                    prefill: str | None = None, prefetch: str | None = None) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention`` (CPU tensors; fp32, bf16 or fp16).

    Args:
        isa: ``"auto"`` (the best this CPU runs), one of ``supported_isas()``, or None:
            ``$MINI_INFER_CPU_ISA`` where set, else ``"auto"``.
        num_splits: 0 splits a decode token's context across threads only when the batch has
            too few tasks to keep every thread busy; ``n > 0`` splits every one ``n`` ways.
        prefill: how bf16 prefill chunks of 128 tokens or more run, ``sdpa_prefill_default``'s
            argument (fp32 and fp16 chunks, and shorter ones, always run as tiles: torch's
            fp32 SDPA was 0.9-1.2x the tiles' time).
        prefetch: where decode tokens prefetch the K/V rows ahead of them,
            ``decode_prefetch_l2_default``'s argument.

    The call releases the GIL while it computes, so that a served replica's other Python
    threads (Ray's, the asyncio loop streaming outputs) run beside the step loop.

    Raises:
        RuntimeError: for inconsistent shapes or dtypes, a block-table entry outside the cache,
            a query longer than its sequence, or an ``isa`` this CPU cannot run.
        ValueError: for a ``prefill`` (or ``$MINI_INFER_CPU_PREFILL``) not in ``PREFILL_CHOICES``,
            or a ``prefetch`` (or ``$MINI_INFER_CPU_PREFETCH``) not in ``PREFETCH_CHOICES``.
    """
    return load().paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  scale, _isa(isa), num_splits, sdpa_prefill_default(prefill),
                                  decode_prefetch_l2_default(prefetch))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, isa: str | None = None) -> None:
    """Same contract as ``kernels.reference.store_kv`` (CPU tensors, ``slot_mapping`` int64), one
    C++ loop of row copies (the reference's two ``index_put_`` calls took ~50 us a layer for a
    64-token decode step, this ~2 us). Into ``float8_e5m2`` caches each row is rounded by the
    vector kernels of ``isa`` (as ``paged_attention``'s argument), bit for bit as
    ``Tensor.to(torch.float8_e5m2)``. Releases the GIL.

    Raises:
        RuntimeError: for shapes, dtypes or strides that do not fit the cache, a slot outside
            ``[-1, num_blocks * block_size)`` (checked before anything is written), or an
            ``isa`` this CPU cannot run.
    """
    load().store_kv(key, value, k_cache, v_cache, slot_mapping, _isa(isa))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for fp32, bf16 or fp16 CPU logits ``[num_rows,
    vocab]`` (vocab contiguous): int64 ``[num_rows]``, the first index of each row's largest
    value, or of its first NaN (a 16-bit value compares as its exact fp32 value). torch's CPU
    argmax is a scalar loop (0.85 ms for 64 x 49,152 fp32 on the AMD EPYC of
    docs/PERFORMANCE.md); this is two vectorised passes per row, rows split over threads
    (bf16 64 x 49,152: 0.20 ms on the Xeon with AMX). Releases the GIL.

    Raises:
        RuntimeError: for logits that are not 2-D fp32, bf16 or fp16 on the CPU with a
            contiguous, non-empty last dimension.
    """
    return load().argmax_rows(logits)


def silu_and_mul(x: torch.Tensor, isa: str | None = None, parallel_from_rows: int | None = None) -> torch.Tensor:
    """SwiGLU's activation on a fused gate/up projection (vLLM's ``silu_and_mul``): ``x [...,
    2 * n]`` bf16 on the CPU -> ``silu(x[..., :n]) * x[..., n:]`` ``[..., n]`` bf16, computed
    in fp32 and rounded once (to nearest even), as Inductor's fused kernel computes it but with
    Cephes' exp (about 1 ulp of fp32, as the attention kernels' softmax) where Inductor calls
    Sleef's (``torch.ops.mini_infer.silu_and_mul``; csrc/activation.h).

    Args:
        isa: as ``paged_attention``'s (both AVX-512 names run the same loop).
        parallel_from_rows: the fewest rows (tokens) whose call splits them over torch's
            intra-op threads; fewer run on the calling thread. ``None`` or 0: from 2**18 output
            elements (171 rows of SmolLM2's 1,536). The engine passes its compiled glue's
            split (``engine.models.llama.glue_parallel_from_tokens``).

    Raises:
        RuntimeError: for a tensor that is not bf16 on the CPU, an odd last dimension, an
            ``isa`` this CPU cannot run, or a negative ``parallel_from_rows``.
    """
    load()
    return torch.ops.mini_infer.silu_and_mul(x, _isa(isa), 0 if parallel_from_rows is None else parallel_from_rows)
