"""Attention kernels behind one dispatch: ``backend="torch"`` (the reference) or ``"triton"``.

Both backends take the same arguments; see ``kernels.reference`` for the contract.
"""
from __future__ import annotations

import torch

from kernels import reference

BACKENDS = ("torch", "triton")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map an engine's ``attention_backend`` setting to a concrete backend.

    Args:
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        device: the device the KV cache lives on.

    Returns:
        ``"triton"`` for ``auto`` on CUDA, ``"torch"`` for ``auto`` elsewhere, else ``backend``.

    Raises:
        ValueError: for any other name.
    """
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of 'auto', 'torch', 'triton'; got {backend!r}")
    return backend


def store_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    """Write new K/V into the paged cache. Arguments as ``kernels.reference.store_kv``."""
    if backend == "triton":
        from kernels.triton_store_kv import store_kv as impl
    else:
        impl = reference.store_kv
    impl(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    backend: str = "torch"):
    """Paged causal attention. Arguments and result as ``kernels.reference.paged_attention``."""
    if backend == "triton":
        from kernels.triton_paged_attention import paged_attention as impl
    else:
        impl = reference.paged_attention
    return impl(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
