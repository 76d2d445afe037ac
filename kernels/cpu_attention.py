"""The CPU backend: decode tokens through a C++ kernel that reads K and V in place through
the block table (``csrc/cpu_decode_attention.cpp``); longer queries (prompts, prefill
chunks) through the reference's per-sequence SDPA, where matmuls dominate anyway.

The extension is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja,
about a minute) and cached under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); ``scripts/setup.sh`` builds it ahead of time. Where it cannot
be built, ``is_available()`` is False and the engine's ``auto`` backend stays on "torch".
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

import torch

from kernels import reference

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "cpu_decode_attention.cpp"


@functools.cache
def load():
    """Build (once per machine) and import the extension.

    Raises:
        RuntimeError: (or the build's own error) when it cannot be compiled here.
    """
    from torch.utils.cpp_extension import load as load_extension

    # The build runs `ninja`; a virtualenv's own (the `ninja` wheel) may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return load_extension(name="mini_infer_cpu_attention", sources=[str(_SOURCE)],
                          # -fno-math-errno lets GCC vectorise expf through glibc's libmvec
                          extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                          extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def is_available() -> bool:
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
        logger.warning("the C++ CPU attention kernel is unavailable (%s); using the torch reference", exc)
        return False
    return True


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention`` (CPU tensors)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if len(decodes) == len(lens) == query.shape[0]:  # every sequence decodes: the common step
        return load().decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(query)
    if decodes:
        rows = torch.tensor(decodes)
        tokens = torch.tensor([starts[i] for i in decodes])
        out[tokens] = load().decode_attention(query[tokens], k_cache, v_cache,
                                              block_tables[rows].contiguous(), seq_lens[rows], scale)
    reference.prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, scale, out)
    return out
